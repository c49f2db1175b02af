"""What the routes share of one server (:class:`ServerState`), and what one request may cost it (:class:`Limits`).

A prompt longer in characters than the context could hold is refused before it is tokenized, and prompts are
tokenized with a copy of the pipeline's tokenizer, so that a long one never holds the engine's lock.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

from .metrics import ServerMetrics
from .protocol import HttpError
from .scheduler import Scheduler


@dataclass
class Limits:
    """What one request may cost the server, and who may send one (spd-serve's flags)."""

    max_body_bytes: int = 8 * 2**20  # --max-body-bytes
    max_model_len: int | None = None  # --max-model-len: prompt + max_tokens (default: the model's context)
    api_key: str | None = None  # --api-key / SPD_API_KEY: required on /v1/* when set
    enable_docs: bool = False  # --enable-docs: /docs, /redoc, /openapi.json


def prompt_char_limit(tokenizer, max_model_len: int) -> int:
    """The most characters a prompt that fits ``max_model_len`` tokens can have, with room to spare: no token
    covers more characters than the longest vocabulary entry (byte-level entries: one character per byte),
    doubled for normalizers that fold characters together."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 4) * 2


@dataclass
class ServerState:
    """What the routes share, one per app (``app.state.spd``, reached through :func:`server_state`): the started
    scheduler and its pipeline, the metrics, the served model's name and context, and the tokenizer's copy that
    prompts are tokenized with."""

    scheduler: Scheduler
    metrics: ServerMetrics
    model_name: str
    max_model_len: int | None  # --max-model-len, else the model's context
    max_chars: int | None  # the longest prompt text that could fit max_model_len (prompt_char_limit)
    encoder: object  # the tokenizer prompts are tokenized with (a copy of the pipeline's, if it can be copied)
    encode_lock: threading.Lock  # held while the encoder runs (the engine's own lock when it is not a copy)

    @classmethod
    def build(cls, scheduler: Scheduler, metrics: ServerMetrics, model_name: str, limits: Limits) -> ServerState:
        pipeline = scheduler.pipeline
        tokenizer = pipeline.tokenizer
        max_model_len = limits.max_model_len or pipeline.max_positions
        max_chars = prompt_char_limit(tokenizer, max_model_len) if max_model_len else None
        # Prompts are tokenized on worker threads with their own copy of the tokenizer, so that a long prompt never
        # holds the lock the engine thread decodes the running request with.
        try:
            encoder = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared, under the engine's lock
            encoder = tokenizer
        encode_lock = scheduler.tokenizer_lock if encoder is tokenizer else threading.Lock()
        return cls(scheduler, metrics, model_name, max_model_len, max_chars, encoder, encode_lock)

    @property
    def pipeline(self):
        return self.scheduler.pipeline

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (tokenizing costs memory and time)."""
        if self.max_chars is not None and chars > self.max_chars:
            raise HttpError(
                400,
                f"the {param} has {chars} characters, more than a context of {self.max_model_len} "
                f"tokens can hold (at most {self.max_chars}); expected a shorter {param}",
                param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, special: bool) -> list[int]:
        """``text`` as token ids (``special``: with the tokenizer's special tokens), under the encoder's lock."""
        with self.encode_lock:
            return self.encoder(text, add_special_tokens=special)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """``messages`` rendered with the chat template up to the assistant's turn, as token ids."""
        with self.encode_lock:
            text = self.encoder.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text, False)

    def budget(self, prompt_ids: list[int], max_tokens: int | None, prompt: str = "prompt") -> int:
        """max_tokens (default: the rest of the context), refused when prompt + max_tokens overflow it; ``prompt``
        names the field the prompt came from (``messages`` for chat)."""
        limit, vocab_size = self.max_model_len, self.pipeline.vocab_size
        if not prompt_ids:
            raise HttpError(400, "the prompt is empty; expected at least one token", prompt, code="invalid_value")
        if limit is not None and len(prompt_ids) >= limit:
            raise HttpError(
                400,
                f"the prompt has {len(prompt_ids)} tokens but the server's context (max model len) "
                f"is {limit} tokens; expected a shorter prompt",
                prompt,
                code="context_length_exceeded",
            )
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise HttpError(
                400,
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                prompt,
                code="invalid_value",
            )
        if limit is None:
            return max_tokens or 4096
        if max_tokens is not None and len(prompt_ids) + max_tokens > limit:
            raise HttpError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceed the "
                f"server's context (max model len) of {limit} tokens; expected max_tokens <= "
                f"{limit - len(prompt_ids)}",
                "max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens or limit - len(prompt_ids)
