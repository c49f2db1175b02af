"""The head's training forward: its query stream over every position scored against the target by the chunked KD
loss (docs/method.md §4). :func:`kd_objective` is the objective :func:`spd.training.distill.distill_step` hands the
head's ``forward``, which runs it inside, so that data-parallel wrappers see every parameter it uses.

Shape suffixes: B batch, N positions, D hidden, K stored top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..heads.speculator import Speculator
from .kd import KDResult, kd_loss, kd_loss_topk


def kd_objective(
    head: Speculator,
    out_BND: torch.Tensor,
    hidden: dict[int, torch.Tensor],
    supervised_BN: torch.Tensor,
    teacher_logits: Callable[[torch.Tensor], torch.Tensor],
    tau: float = 1.0,
    chunk_size: int = 512,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    pad_to: int = 1,
) -> KDResult:
    """The chunked KD loss of the head's outputs on supervised positions against the target
    (``teacher_logits(H^L)``), or against a stored top-k teacher ``topk = (ids_BNK, logprobs_BNK)``
    (spd.training.capture)."""
    if topk is not None:
        return kd_loss_topk(
            out_BND[supervised_BN],
            topk[0][supervised_BN],
            topk[1][supervised_BN],
            head.logits,
            chunk_size,
            pad_to,
        )
    teacher_BND = hidden[head.config.target_num_layers]
    return kd_loss(
        out_BND[supervised_BN],
        teacher_BND[supervised_BN],
        head.logits,
        teacher_logits,
        tau,
        chunk_size,
        head.draft_ids,
        pad_to,
    )
