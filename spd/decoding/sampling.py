"""Token selection: greedy, and sampling with temperature / top-k / top-p from a seeded generator.

Warping follows the usual order (temperature, then top-k, then top-p). :func:`warped_probs` is the
distribution the decoders sample from; speculative verification (the engine) compares the target's
and the speculator's warped distributions, so both go through this one function.

:class:`SamplingParams` is a request's settings wherever they travel: the engines' ``generate`` builds it once from
its keywords, the server from a request's fields, and spd-generate and run_pipeline from their flags, which its
fields declare as :class:`~spd.decoding.spec.DecodingSpec`'s do (``top_k`` is ``--top-k``).
"""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..errors import SpdInputError
from .spec import add_field_flags, fields_argv, finite_float, flag

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: spd-generate declares its flags from this module and checks them before torch
# loads (a wrong flag or a missing path is refused at once).

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy (argmax). Every field is also a flag."""

    temperature: float = flag(0.0, "sampling temperature, 0 = greedy (default: %(default)s)", finite_float)
    top_k: int = flag(0, "sample from the k most likely tokens, 0 = off (default: %(default)s)", int)
    top_p: float = flag(1.0, "nucleus sampling mass, 1 = off (default: %(default)s)", finite_float)
    seed: int | None = flag(None, "sampling seed (default: none, a fresh draw each run)", int)

    def __post_init__(self):
        check_sampling(vars(self))

    # ------------------------------------------------------------------------------------ the flags
    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Add ``--temperature``, ``--top-k``, ``--top-p`` and ``--seed`` to ``parser``."""
        add_field_flags(cls, parser)

    @classmethod
    def from_args(cls, args) -> SamplingParams:
        """From a program's parsed flags (any object with these attribute names); a wrong value is one
        SpdInputError naming its flag (``--top-k``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        check_sampling(values, flags=True)
        return cls(**values)

    def argv(self) -> list[str]:
        """The flags that give another program (the distributed runtime's) these settings."""
        return fields_argv(self, [f.name for f in fields(self)])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (or from system entropy when seed is None)."""
        import torch

        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def check_sampling(values: dict, flags: bool = False) -> None:
    """Refuse the first of ``values`` (a value per field of :class:`SamplingParams`) that no request can use: one
    SpdInputError naming the field (``top_k``), or its flag (``--top-k``) with ``flags``."""
    temperature, top_k, top_p, seed = (values[f] for f in ("temperature", "top_k", "top_p", "seed"))
    for field, fine, expected in (
        ("temperature", _real(temperature) and 0 <= temperature < math.inf, "a finite number >= 0 (0: greedy)"),
        ("top_k", _integer(top_k) and top_k >= 0, "an integer >= 0 (0: off)"),
        ("top_p", _real(top_p) and 0 < top_p <= 1, "a number in (0, 1] (1: off)"),
        (
            "seed",
            seed is None or (_integer(seed) and SEED_MIN <= seed <= SEED_MAX),
            "None or an integer from -2**63 to 2**64 - 1",
        ),
    ):
        if not fine:
            # SpdInputError is a ValueError: callers that catch ValueError keep working.
            name = "--" + field.replace("_", "-") if flags else field
            raise SpdInputError(f"{name} must be {expected}, got {values[field]!r}")


def warped_probs(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (rows sum to 1); fp32."""
    import torch

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
    import torch

    if params.greedy:
        return torch.argmax(logits_NV, dim=-1)
    probs_NV = warped_probs(logits_NV, params)
    return torch.multinomial(probs_NV, 1, generator=generator)[..., 0]
