"""Token selection: greedy, and sampling with temperature / top-k / top-p from a seeded generator.

Warping follows the usual order (temperature, then top-k, then top-p). :func:`warped_probs` is the
distribution the decoders sample from; speculative verification (the engine) compares the target's
and the speculator's warped distributions, so both go through this one function.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import SpdInputError

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with cumulative probability >= top_p; 1 = off
    seed: int | None = None  # seed of the sampling generator (None: nondeterministic)

    def __post_init__(self):
        # SpdInputError is a ValueError: callers that catch ValueError keep working.
        if not _real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise SpdInputError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not _integer(self.top_k) or self.top_k < 0:
            raise SpdInputError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise SpdInputError(f"top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise SpdInputError(f"seed must be None or an integer from -2**63 to 2**64 - 1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (or from system entropy when seed is None)."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warped_probs(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (rows sum to 1); fp32."""
    logits_NV = logits_NV.float() / params.temperature
    vocab = logits_NV.shape[-1]
    if 0 < params.top_k < vocab:
        kth_N1 = torch.topk(logits_NV, params.top_k, dim=-1).values[..., -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    probs_NV = torch.softmax(logits_NV, dim=-1)
    if params.top_p < 1.0:
        sorted_NV, order_NV = torch.sort(probs_NV, dim=-1, descending=True)
        mass_before_NV = torch.cumsum(sorted_NV, dim=-1) - sorted_NV
        # A token is dropped when the more likely tokens already cover top_p; the first is always kept.
        drop_NV = mass_before_NV >= params.top_p
        drop_NV[..., 0] = False
        sorted_NV = sorted_NV.masked_fill(drop_NV, 0.0)
        probs_NV = torch.zeros_like(probs_NV).scatter_(-1, order_NV, sorted_NV)
        probs_NV = probs_NV / probs_NV.sum(dim=-1, keepdim=True)
    return probs_NV


def select_token(logits_NV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The next token per row: argmax when greedy, else a draw from :func:`warped_probs`. Shape (N,)."""
    if params.greedy:
        return torch.argmax(logits_NV, dim=-1)
    probs_NV = warped_probs(logits_NV, params)
    return torch.multinomial(probs_NV, 1, generator=generator)[..., 0]
