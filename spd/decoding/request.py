"""What every engine's ``generate`` shares: the prompt and EOS, the streamer, the ``ar`` mode
(:func:`generate_request`), and ``generate`` itself (:class:`Generates`, which :class:`spd.Engine` and serial
speculative decoding inherit)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import SpdInputError
from .generation import GenerationOutput, OnToken, default_eos, generate_ar
from .sampling import SamplingParams
from ..target.staging import StagedModel


def prepare_prompt(tokenizer, prompt, eos_token_id, model=None):
    """Token ids of a text prompt (needs a tokenizer) or ids as given, and the EOS: ``eos_token_id`` if given,
    else :func:`spd.decoding.generation.default_eos` (the model's generation config, as ``model.generate``, then the
    tokenizer's)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise SpdInputError(
                "a text prompt needs a tokenizer, but this engine has none (the target has no "
                "tokenizer files); pass token ids or load the engine with a tokenizer"
            )
        prompt = tokenizer(prompt)["input_ids"]
    if eos_token_id is None:
        eos_token_id = default_eos(model, tokenizer)
    return prompt, eos_token_id


def generate_request(
    staged: StagedModel,
    tokenizer,
    prompt,
    max_new_tokens: int,
    mode: str,
    sampling: SamplingParams,
    eos_token_id,
    streamer,
    decode: Callable[[list[int], int | Sequence[int] | None, OnToken | None], GenerationOutput],
    on_token: OnToken | None = None,
) -> GenerationOutput:
    """What every engine's ``generate`` shares: the prompt and EOS, the streamer, and the ``ar`` mode;
    ``decode(prompt_ids, eos_token_id, on_token)`` runs the engine's own modes."""
    prompt, eos_token_id = prepare_prompt(tokenizer, prompt, eos_token_id, staged.model)
    on_token, end = _as_callback(streamer, on_token)
    try:
        if mode == "ar":
            return generate_ar(staged, prompt, max_new_tokens, sampling, eos_token_id, on_token)
        return decode(prompt, eos_token_id, on_token)
    finally:
        end()


class Generates:
    """``generate`` for an engine: a subclass sets ``mode`` (its default) and ``engine_name``, has ``staged`` and
    ``tokenizer``, and implements ``run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token)``. Its modes
    are its own and ``ar`` unless it overrides :meth:`check_mode`; :meth:`decode` runs one of its own modes."""

    mode = ""
    engine_name = ""

    def check_mode(self, mode: str) -> None:
        """Refuse (one sentence) a mode this engine does not run."""
        if mode not in (self.mode, "ar"):
            raise SpdInputError(f"unknown mode '{mode}' for {self.engine_name}; expected one of: {self.mode}, ar")

    def decode(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, eos_token_id, on_token, mode: str):
        """One of the engine's own modes (not ``ar``) on prompt ids."""
        return self.run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token)

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        mode: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Callable[[int], None] | object | None = None,
        on_token: OnToken | None = None,
    ) -> GenerationOutput:
        """Generate from a prompt (text needs a tokenizer) or token ids; ``mode`` is the engine's own (default) or
        another it runs (:meth:`check_mode`), ``ar`` included.

        ``streamer`` is a callable taking each committed token id, or an object with ``put``/``end`` (a
        Hugging Face ``TextStreamer``); ``on_token(token, accepted)`` also gets the token's
        ``stats.token_acceptance`` flag and may return True to end the generation after that token
        (``stop_reason`` "stopped": stop strings, cancelled requests). ``eos_token_id`` defaults as in
        ``model.generate`` (:func:`default_eos`).
        """
        mode = mode or self.mode
        self.check_mode(mode)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return generate_request(
            self.staged,
            self.tokenizer,
            prompt,
            max_new_tokens,
            mode,
            sampling,
            eos_token_id,
            streamer,
            lambda ids, eos, callback: self.decode(ids, max_new_tokens, sampling, eos, callback, mode),
            on_token,
        )


def _as_callback(streamer, on_token: OnToken | None = None) -> tuple[OnToken | None, Callable[[], None]]:
    """The run loops' callback ``(token, accepted)`` and a finisher, from a streamer (a callable taking a token
    id or a ``put``/``end`` object, which never sees the flag) and ``on_token``."""

    def end() -> None:
        return None

    if streamer is None:
        put = None
    elif hasattr(streamer, "put") and hasattr(streamer, "end"):
        put, end = (lambda token: streamer.put(torch.tensor([token]))), streamer.end
    elif callable(streamer):
        put = streamer
    else:
        raise SpdInputError("streamer must be a callable taking a token id or an object with put() and end()")
    if on_token is not None and not callable(on_token):
        raise SpdInputError("on_token must be a callable taking a token id and its acceptance flag")
    if put is None:
        return on_token, end

    def callback(token: int, accepted: bool) -> bool | None:
        put(token)
        return on_token(token, accepted) if on_token is not None else None

    return callback, end
