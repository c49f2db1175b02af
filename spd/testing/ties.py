"""Where two greedy runs of the same model may part ways: near ties of the top-two logits.

A batch, another stage cut or another kernel changes the shapes of the matrix products, so fp32 logits can
differ from a solo run's in the last bits (bf16 in the last of its 8). Greedy output then stays the solo run's
except where the solo run's two best tokens were that close: the first token at which two outputs differ is a
*near tie* when the solo run's top-two margin there is below :func:`near_tie_tolerance`; anywhere else a
difference is a bug.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4  # fp32: top-two logits this close may part two runs of the same model (other matrix shapes)


def near_tie_tolerance(top: float, dtype: torch.dtype) -> float:
    """How close the top-two logits may be where two runs of the same model part ways: NEAR_TIE in fp32, else 8
    spacings of the top logit in the dtype (bf16 keeps 8 significant bits, fp16 11)."""
    if dtype == torch.float32:
        return NEAR_TIE
    fraction_bits = 10 if dtype == torch.float16 else 7
    return 8 * 2.0 ** (math.floor(math.log2(max(abs(top), 1e-30))) - fraction_bits)


@dataclass(frozen=True)
class Difference:
    """The first token at which an output parts from the solo run's, and the solo run's top-two margin there."""

    token: int  # index into the generated tokens
    margin: float
    tolerance: float

    @property
    def near_tie(self) -> bool:
        return self.margin < self.tolerance

    def as_dict(self) -> dict:
        return {"token": self.token, "margin": self.margin, "tolerance": self.tolerance, "near_tie": self.near_tie}


@torch.no_grad()
def first_difference(staged, prompt: Sequence[int], solo: Sequence[int], other: Sequence[int]) -> Difference | None:
    """None if ``other`` equals the solo greedy run's ``solo`` (both generated after ``prompt``); else where they
    first differ, with the solo run's top-two margin there (one forward of the whole target over the prefix). An
    output that is a strict prefix of the other differs at its end (margin inf: not a near tie)."""
    solo, other = list(solo), list(other)
    if solo == other:
        return None
    i = next((k for k, (a, b) in enumerate(zip(solo, other)) if a != b), None)
    if i is None:
        return Difference(min(len(solo), len(other)), math.inf, 0.0)
    ids = torch.tensor([list(prompt) + solo[:i]], device=staged.device)
    top2 = torch.topk(staged.model(ids).logits[0, -1].float(), 2).values.tolist()
    return Difference(i, top2[0] - top2[1], near_tie_tolerance(top2[0], staged.dtype))
