"""What every engine's ``generate`` and ``chat`` share: the prompt (text, token ids, or a conversation rendered with
the chat template: :func:`chat_prompt_ids`) and EOS, the streamer of text (:class:`Detokenizer`), the ``ar`` mode and
the output's text (:func:`generate_request`), and ``generate`` and ``chat`` themselves (:class:`Generates`, which
:class:`spd.Engine` and serial speculative decoding inherit)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import SpdInputError
from ..target.staging import StagedModel
from .generation import (
    GenerationOutput,
    OnToken,
    as_prompt_ids,
    check_request,
    default_eos,
    eos_set,
    generate_ar,
)
from .sampling import SamplingParams


def prepare_prompt(tokenizer, prompt, eos_token_id, model=None):
    """Token ids of a text prompt (:func:`prompt_ids`) or ids as given, and the EOS: ``eos_token_id`` if given,
    else :func:`spd.decoding.generation.default_eos` (the model's generation config, as ``model.generate``, then the
    tokenizer's)."""
    prompt = prompt_ids(tokenizer, prompt) if isinstance(prompt, str) else prompt
    if eos_token_id is None:
        eos_token_id = default_eos(model, tokenizer)
    return prompt, eos_token_id


def prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt's token ids: a text tokenized (needs a tokenizer), or token ids checked and flattened
    (:func:`~spd.decoding.generation.as_prompt_ids`)."""
    if not isinstance(prompt, str):
        return as_prompt_ids(prompt)
    if not prompt:
        raise SpdInputError("the prompt is empty; expected text or token ids")
    if tokenizer is None:
        raise SpdInputError(
            "a text prompt needs a tokenizer, but this engine has none (the target has no "
            "tokenizer files); pass token ids or load the engine with a tokenizer"
        )
    return tokenizer(prompt)["input_ids"]


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """A conversation (``[{"role": ..., "content": ...}, ...]``) rendered with the tokenizer's chat template and
    ``add_generation_prompt`` (the assistant's turn comes next), as token ids."""
    check_messages(messages)
    if tokenizer is None:
        raise SpdInputError(
            "chat needs a tokenizer with a chat template, but this engine has none (the target has no "
            "tokenizer files); load the engine with tokenizer=... or pass token ids to generate()"
        )
    if not tokenizer.chat_template:
        raise SpdInputError("this engine's tokenizer has no chat template; pass the prompt as text to generate()")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    # The template writes its own special tokens (BOS included, where it has one): none are added again.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_messages(messages) -> None:
    """Refuse (one sentence) anything but a non-empty list of ``{"role": str, "content": str}`` dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpdInputError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {_short(messages)}"
        )
    for i, message in enumerate(messages):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise SpdInputError(
                f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {_short(message)}"
            )


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_conversation(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)


def _prompt_list(prompt) -> list | None:
    """The prompts of a list of prompts (texts or token-id sequences); None for one prompt (text or token ids)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return None
    one = (str, list, tuple)
    if all(isinstance(p, one) or (isinstance(p, torch.Tensor) and p.dim() >= 1) for p in prompt):
        return list(prompt)
    return None


class Detokenizer:
    """Text pieces of a growing token sequence, as a streamer wants them: each piece is the new suffix of the
    sequence's decoded text (special tokens skipped), so that the pieces concatenate to the whole decoded text.

    A piece is held back while the text ends in U+FFFD (an incomplete UTF-8 character: byte-level tokens split
    multi-byte characters). Only a window is decoded each time: the tokens from the one before the last piece on
    (Text Generation Inference's offsets), because a SentencePiece decoder drops the leading space of a sequence's
    first token, and the window's first token is decoded in both texts compared.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # where the decoded window starts
        self.read = 0  # the end of the tokens already streamed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Take one token; return the new text (empty while a character is incomplete or the token has no text)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def finish(self) -> str:
        """The text held back (an incomplete character at the end stays as U+FFFD, as in the whole text)."""
        before = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


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
    """What every engine's ``generate`` shares: the prompt and EOS, the streamer, the ``ar`` mode and the output's
    text; ``decode(prompt_ids, eos_token_id, on_token)`` runs the engine's own modes."""
    prompt, eos_token_id = prepare_prompt(tokenizer, prompt, eos_token_id, staged.model)
    on_token, end = _as_callback(streamer, on_token, tokenizer)
    try:
        if mode == "ar":
            out = generate_ar(staged, prompt, max_new_tokens, sampling, eos_token_id, on_token)
        else:
            out = decode(prompt, eos_token_id, on_token)
    finally:
        end()
    if tokenizer is not None:
        out.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return out


class Generates:
    """``generate`` and ``chat`` for an engine: a subclass sets ``mode`` (its default) and ``engine_name``, has
    ``staged`` and ``tokenizer``, and implements ``run(prompt_ids, max_new_tokens, sampling, eos_token_id,
    on_token)``. Its modes are its own and ``ar`` unless it overrides :meth:`check_mode`; :meth:`decode` runs one of
    its own modes."""

    mode = ""
    engine_name = ""
    staged: StagedModel  # the target
    tokenizer: Any  # its Hugging Face tokenizer, or None (token-id prompts only)
    # One request of the engine's own mode: run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token).
    run: Callable[..., GenerationOutput]

    def check_mode(self, mode: str) -> None:
        """Refuse (one sentence) a mode this engine does not run."""
        if mode not in (self.mode, "ar"):
            raise SpdInputError(f"unknown mode '{mode}' for {self.engine_name}; expected one of: {self.mode}, ar")

    def decode(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, eos_token_id, on_token, mode: str):
        """One of the engine's own modes (not ``ar``) on prompt ids."""
        return self.run(prompt_ids, max_new_tokens, sampling, eos_token_id, on_token)

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor | Sequence[str | Sequence[int]],
        max_new_tokens: int = 128,
        mode: str | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Callable[[str], object] | object | None = None,
        on_token: OnToken | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate from a prompt: text (needs a tokenizer) or token ids; ``.text``, ``.token_ids`` and ``.stats`` of
        the output are the new text, the new token ids and the decoding statistics. A list of prompts gives a list
        of outputs, one request after another. ``mode`` is the engine's own (default) or another it runs
        (:meth:`check_mode`), ``ar`` included. ``temperature`` (0, the default, is greedy), ``top_k``, ``top_p`` and
        ``seed`` are :class:`~spd.decoding.sampling.SamplingParams`' fields, or ``sampling`` is one (not both).

        ``streamer`` is a callable taking each new piece of text (``lambda piece: print(piece, end="")``; the pieces
        concatenate to ``.text``), or an object with ``put``/``end`` taking token ids (a Hugging Face
        ``TextStreamer``); ``on_token(token, accepted)`` gets each token id with its ``stats.token_acceptance`` flag
        and may return True to end the generation after that token (``stop_reason`` "stopped": stop strings,
        cancelled requests). ``eos_token_id`` defaults as in ``model.generate`` (:func:`default_eos`). Every wrong
        argument raises :class:`~spd.errors.SpdInputError` (a ``ValueError``).
        """
        if _is_conversation(prompt):
            raise SpdInputError(
                "generate takes a prompt (text or token ids); for a list of {'role': ..., 'content': ...} "
                "messages call chat(messages)"
            )
        mode = mode or self.mode
        self.check_mode(mode)
        sampling = sampling_of(sampling, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        requests, listed = self._checked_ids(prompt, max_new_tokens, eos_token_id, streamer, on_token)
        outs = [
            generate_request(
                self.staged,
                self.tokenizer,
                ids,
                max_new_tokens,
                mode,
                sampling,
                eos_token_id,
                streamer,
                lambda request, eos, callback: self.decode(request, max_new_tokens, sampling, eos, callback, mode),
                on_token,
            )
            for ids in requests
        ]
        return outs if listed else outs[0]

    def _checked_ids(
        self, prompt, max_new_tokens: int, eos_token_id, streamer, on_token: OnToken | None
    ) -> tuple[list[list[int]], bool]:
        """The token ids of a call's prompts and whether ``prompt`` is a list of them, with every argument its
        requests read checked before any runs: the streamer (one prompt only), ``on_token``, the EOS and each
        prompt."""
        prompts = _prompt_list(prompt)
        if prompts is not None and (streamer is not None or on_token is not None):
            raise SpdInputError(
                "streamer and on_token follow one request; pass one prompt per call to stream, not a list"
            )
        _as_callback(streamer, on_token, self.tokenizer)  # refused before anything runs, as a wrong EOS is
        eos_set(eos_token_id)
        requests = []
        for one in prompts if prompts is not None else [prompt]:
            ids = prompt_ids(self.tokenizer, one)
            check_request(self.staged, ids, max_new_tokens)  # every prompt of a list, before any runs
            requests.append(ids)
        return requests, prompts is not None

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        max_new_tokens: int = 128,
        mode: str | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        streamer: Callable[[str], object] | object | None = None,
        on_token: OnToken | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """The assistant's reply to a conversation, ``[{"role": "user", "content": "Hi"}, ...]``, rendered with the
        tokenizer's chat template (:func:`chat_prompt_ids`); a list of conversations gives a list of outputs. The
        other arguments are :meth:`generate`'s; ``.text`` is the reply."""
        batch = isinstance(messages, (list, tuple)) and bool(messages) and all(_is_conversation(m) for m in messages)
        ids = [chat_prompt_ids(self.tokenizer, m) for m in (messages if batch else [messages])]
        return self.generate(
            ids if batch else ids[0],
            max_new_tokens,
            mode,
            temperature,
            top_k,
            top_p,
            seed,
            eos_token_id,
            streamer,
            on_token,
            sampling,
        )


def sampling_of(sampling: SamplingParams | None, **keywords) -> SamplingParams:
    """A request's :class:`SamplingParams`: ``sampling`` as given, or made from the keywords that are set (None: the
    field's default); one SpdInputError for both at once."""
    given = {name: value for name, value in keywords.items() if value is not None}
    if sampling is None:
        return SamplingParams(**given)
    if not isinstance(sampling, SamplingParams):
        raise SpdInputError(f"sampling must be a SamplingParams, got {_short(sampling)}")
    if given:
        raise SpdInputError(
            "pass the sampling settings as sampling=SamplingParams(...) or as keywords, not both; got sampling= "
            f"and {', '.join(f'{name}=' for name in given)}"
        )
    return sampling


def _as_callback(
    streamer, on_token: OnToken | None = None, tokenizer=None
) -> tuple[OnToken | None, Callable[[], None]]:
    """The run loops' callback ``(token, accepted)`` and a finisher, from a streamer (a callable taking text pieces,
    through a :class:`Detokenizer`, or a ``put``/``end`` object taking token ids; neither sees the flag) and
    ``on_token``."""

    def end() -> None:
        return None

    if streamer is None:
        put = None
    elif hasattr(streamer, "put") and hasattr(streamer, "end"):
        put, end = (lambda token: streamer.put(torch.tensor([token]))), streamer.end
    elif callable(streamer):
        if tokenizer is None:
            raise SpdInputError(
                "streamer receives text, but this engine has no tokenizer; take the token ids with on_token"
            )
        detokenizer = Detokenizer(tokenizer)

        def put(token: int) -> None:
            piece = detokenizer.add(token)
            if piece:
                streamer(piece)

        def end() -> None:
            piece = detokenizer.finish()
            if piece:
                streamer(piece)

    else:
        raise SpdInputError("streamer must be a callable taking text or an object with put() and end()")
    if on_token is not None and not callable(on_token):
        raise SpdInputError("on_token must be a callable taking a token id and its acceptance flag")
    if put is None:
        return on_token, end

    def callback(token: int, accepted: bool) -> bool | None:
        put(token)
        return on_token(token, accepted) if on_token is not None else None

    return callback, end
