"""Verification of a token tree's children against the target's distribution ``p`` after the root (docs/method.md
§6): the lossless rules, one per way the children were chosen.

Siblings are tried in order with the multi-draft rule that matches how they were chosen; never check branches
independently (that is not lossless):
- :func:`verify_greedy` - temperature 0: accept the child equal to the argmax;
- :func:`verify_sampled_deterministic` - children chosen deterministically (top-k / top-W,
  :func:`spd.decoding.tree.grow_top_k`);
- :func:`verify_sampled_recursive` - children drawn at random from draft distributions (SpecInfer-style
  recursive rejection sampling; ``without_replacement`` for the children of :func:`spd.decoding.tree.grow_sampled`).

Shape suffixes: V vocabulary, C candidates being verified.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import SpdInputError


def _candidates(child_tokens: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(child_tokens, list):
        return child_tokens
    return torch.as_tensor(child_tokens, dtype=torch.long).flatten().tolist()


def _probs(p_V: torch.Tensor, name: str = "p") -> torch.Tensor:
    """A float64 copy of a 1-D distribution (float64 keeps the residual updates from drifting)."""
    if p_V.dim() != 1:
        raise SpdInputError(f"{name} must be a 1-D distribution over the vocabulary, got shape {tuple(p_V.shape)}")
    return p_V.detach().to(torch.float64).clone()


def _draw(p_V: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p_V, 1, generator=generator))


def _uniform(p_V: torch.Tensor, generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=p_V.device))


def verify_greedy(p_or_logits_V: torch.Tensor, child_tokens: torch.Tensor | Sequence[int]) -> tuple[int | None, int]:
    """Greedy verification: ``(index of the child equal to the argmax or None, the argmax token)``."""
    token = int(torch.argmax(p_or_logits_V))
    cands = _candidates(child_tokens)
    return (cands.index(token) if token in cands else None), token


def verify_sampled_deterministic(
    p_V: torch.Tensor, child_tokens: torch.Tensor | Sequence[int], generator: torch.Generator | None
) -> tuple[int | None, int]:
    """Lossless multi-candidate sampling for deterministically chosen candidates: ``(index or None, token)``.

    Candidates are tried in order: accept ``x`` with probability ``p(x)``; else set ``p(x) = 0``,
    renormalise and try the next; if all are rejected the token is drawn from the residual ``p``.
    Each step outputs ``p(x) * delta_x + (1 - p(x)) * p(. | != x) = p``, so the token is distributed
    exactly as ``p`` provided that (1) ``p_V`` is the distribution plain sampling would draw from (the
    target's warped probabilities after the root) and (2) the candidate list was fixed without looking
    at this function's random draws (top-k of a draft, top-W of a tree level, any order; duplicates
    are allowed and simply never accepted twice). It does not need the draft's probabilities.
    """
    residual_V = _probs(p_V)
    for i, x in enumerate(_candidates(child_tokens)):
        # Compare with p(x) / mass rather than renormalising in place: exactly 1 when x holds all mass left.
        if _uniform(residual_V, generator) < float(residual_V[x] / residual_V.sum()):
            return i, x
        residual_V[x] = 0.0
    return None, _draw(residual_V, generator)


def verify_sampled_recursive(
    p_V: torch.Tensor,
    child_tokens: torch.Tensor | Sequence[int],
    q_list: torch.Tensor | Sequence[torch.Tensor],
    generator: torch.Generator | None,
    without_replacement: bool = False,
) -> tuple[int | None, int]:
    """Recursive rejection sampling (SpecInfer) for sampled candidates: ``(index or None, token)``.

    Candidate ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; on rejection
    ``p_{i+1} = normalise(max(p_i - q_i, 0))``; if all are rejected the token is drawn from the last
    residual. Step ``i`` outputs ``min(p_i, q_i) + max(p_i - q_i, 0) = p_i``, so the token is
    distributed exactly as ``p`` provided that (1) ``p_V`` is the target's warped distribution after
    the root, and (2) given the context and the earlier candidates ``x_1..x_{i-1}`` (but not this
    function's draws), ``x_i`` was drawn from ``q_i`` and the number of candidates was fixed without
    looking at their values. ``q_list``: one (V,) tensor for i.i.d. draws (every ``q_i = q``), a
    (C, V) tensor or a list for one per candidate; with ``without_replacement`` the candidates were
    drawn one after another without replacement from the one (V,) ``q`` (:func:`grow_sampled`), so
    ``q_i`` is ``q`` renormalised without ``x_1..x_{i-1}``. Candidates that were filtered after
    sampling by a rule that looks at the sampled values (e.g. keeping the top-W of a level by
    cumulative probability) do not qualify: use deterministic candidates and
    :func:`verify_sampled_deterministic` for such trees.
    """
    cands = _candidates(child_tokens)
    if without_replacement:
        if not isinstance(q_list, torch.Tensor) or q_list.dim() != 1:
            raise SpdInputError(
                "verify_sampled_recursive without replacement needs the one (V,) draft distribution "
                "the candidates were drawn from"
            )
        q_rest = _probs(q_list, "the draft distribution q")
    elif isinstance(q_list, torch.Tensor) and q_list.dim() == 1:
        q_list = [q_list] * len(cands)
    if not without_replacement and len(q_list) != len(cands):
        raise SpdInputError(
            f"verify_sampled_recursive needs one draft distribution per candidate: got "
            f"{len(q_list)} for {len(cands)} candidates"
        )
    p_i = _probs(p_V)
    p_i /= p_i.sum()
    for i, x in enumerate(cands):
        if without_replacement:
            q_i = q_rest / q_rest.sum()
            q_rest[x] = 0.0  # the next candidate was drawn from the rest
        else:
            q_i = _probs(q_list[i], "each draft distribution q")
            q_i /= q_i.sum()
        # u < p/q written as u * q < p: q(x) = 0 (x could not have been drawn) accepts whenever p(x) > 0.
        if _uniform(p_i, generator) * float(q_i[x]) < float(p_i[x]):
            return i, x
        residual_V = torch.clamp(p_i - q_i, min=0.0)
        mass = residual_V.sum()
        if mass > 0:  # mass 0 means p_i == q_i: rejection has probability 0 then, keep p_i.
            p_i = residual_V / mass
    return None, _draw(p_i, generator)
