"""Autoregressive decoding on the staged target (the exact baseline), and what every decoder returns.

The AR decoder runs all stages for each new token with preallocated per-stage KV caches and no
per-step allocation beyond the model's own activations; its greedy output is the argmax at every step, which is
token-identical to ``model.generate(do_sample=False)`` (tested) where the model's generation config adds no logits
processor of its own (``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``, ...): the target's
greedy output, here and in every mode, is its plain argmax.
"""

from __future__ import annotations

import numbers
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..target.staging import SpdInputError, StagedModel
from .sampling import SamplingParams, select_token
from .stats import GenerationStats


@dataclass
class GenerationOutput:
    """New tokens (prompt excluded), their text and the statistics of the call."""

    token_ids: list[int]
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)
    # The new tokens decoded (special tokens skipped), set by ``generate`` and ``chat``; None without a tokenizer.
    text: str | None = None


# Called with each committed token and its ``token_acceptance`` flag, right after it is committed; returning
# True ends the generation after this token (stop_reason "stopped"), e.g. a stop string or a cancelled request.
OnToken = Callable[[int, bool], bool | None]


def as_prompt_ids(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """A prompt as a flat list of ints (a (1, T) or (T,) tensor, or a sequence of integers)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise SpdInputError(f"a prompt tensor must have shape (T,) or (1, T), got {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes, dict)) or not hasattr(input_ids, "__iter__"):
        raise SpdInputError(f"the prompt must be text or a sequence of token ids, got {type(input_ids).__name__}")
    ids = []
    for t in input_ids:
        try:
            ids.append(operator.index(t))  # an int, a NumPy integer or a 0-d integer tensor
        except TypeError:
            raise SpdInputError(f"prompt token ids must be integers, got {t!r}") from None
    return ids


def check_request(staged: StagedModel, prompt_ids: list[int], max_new_tokens: int) -> int:
    """Refuse empty prompts, prompts that fill the context, out-of-vocabulary ids and bad budgets; return the
    budget: how many new tokens fit (``max_new_tokens``, or fewer where the context ends first)."""
    if not prompt_ids:
        raise SpdInputError("the prompt is empty; expected at least one token")
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise SpdInputError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise SpdInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    limit = staged.max_positions
    if limit is not None and len(prompt_ids) >= limit:
        raise SpdInputError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {limit} tokens; "
            "expected a prompt shorter than the context"
        )
    bad = [t for t in prompt_ids if not 0 <= t < staged.vocab_size]
    if bad:
        raise SpdInputError(f"prompt token id {bad[0]} is outside the vocabulary (0..{staged.vocab_size - 1})")
    return max_new_tokens if limit is None else min(max_new_tokens, limit - len(prompt_ids))


def default_eos(model, tokenizer=None) -> int | list[int] | None:
    """The EOS a request stops at when none is given: the model's ``generation_config.eos_token_id``, else the
    tokenizer's ``eos_token_id``, else None (no EOS).

    This is what ``model.generate`` does: it stops at ``generation_config.eos_token_id`` (an int or a list,
    e.g. Qwen3's ``[<|im_end|>, <|endoftext|>]``) and never looks at the tokenizer, so when both exist the
    generation config wins. The tokenizer is only a fallback for models whose generation config names no EOS.
    """
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


def eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The EOS token ids (none for None) of an id or a sequence of them."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset([eos_token_id])
    try:
        if isinstance(eos_token_id, (str, bytes)):
            raise TypeError
        return frozenset(operator.index(t) for t in eos_token_id)
    except TypeError:
        raise SpdInputError(
            f"eos_token_id must be a token id, a list of token ids or None, got {eos_token_id!r}"
        ) from None


@torch.inference_mode()
def generate_ar(
    staged: StagedModel,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    eos_token_id: int | Sequence[int] | None = None,
    on_token: OnToken | None = None,
) -> GenerationOutput:
    """Plain autoregressive decoding through every stage; greedy or sampled (see SamplingParams).

    ``eos_token_id=None`` means no EOS (``Engine.generate`` resolves the default, :func:`default_eos`).
    """
    prompt = as_prompt_ids(input_ids)
    budget = check_request(staged, prompt, max_new_tokens)
    eos = eos_set(eos_token_id)
    stats = GenerationStats(mode="ar", prompt_tokens=len(prompt))
    generator = None if sampling.greedy else sampling.generator(staged.device)
    caches = staged.new_caches(capacity=len(prompt) + budget)

    t0 = time.perf_counter()
    ids_1T = torch.tensor([prompt], dtype=torch.long, device=staged.device)
    hidden_1TD = staged.forward_stages(ids_1T, caches).hidden_BTD
    token_1 = select_token(staged.logits(hidden_1TD[:, -1]), sampling, generator)
    stats.prefill_time_s = time.perf_counter() - t0

    out: list[int] = []
    while True:
        token = int(token_1)
        out.append(token)
        stats.token_acceptance.append(False)  # nothing is speculated
        stopped = on_token is not None and on_token(token, False)
        if token in eos:
            stats.stop_reason = "eos"
            break
        if len(out) >= budget:
            stats.stop_reason = "max_new_tokens" if len(out) >= max_new_tokens else "context_full"
            break
        if stopped:
            stats.stop_reason = "stopped"
            break
        hidden_11D = staged.forward_stages(token_1[None], caches).hidden_BTD
        token_1 = select_token(staged.logits(hidden_11D[:, -1]), sampling, generator)
    stats.wall_time_s = time.perf_counter() - t0
    stats.new_tokens = len(out)
    return GenerationOutput(out, stats, prompt)


def stop_reason(token: int, out: list[int], eos: frozenset[int], budget: int, max_new_tokens: int) -> str:
    """Why the request ends after ``token`` (the last of ``out``): "eos", "max_new_tokens", "context_full", or ""."""
    if token in eos:
        return "eos"
    if len(out) >= budget:
        return "max_new_tokens" if len(out) >= max_new_tokens else "context_full"
    return ""


def first_output(
    first: int, stats: GenerationStats, eos: frozenset[int], budget: int, max_new_tokens: int, on_token: OnToken | None
) -> tuple[list[int], str]:
    """The output after the prefill's token (taken from the prefill logits, not speculated) and the reason it
    already stops the request ("" when it does not): what the step loop and serial drafting share before their
    steps."""
    out = [first]
    stats.token_acceptance.append(False)
    stop = stop_reason(first, out, eos, budget, max_new_tokens)
    if on_token is not None and on_token(first, False) and not stop:
        stop = "stopped"
    return out, stop
