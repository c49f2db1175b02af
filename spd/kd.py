"""Knowledge-distillation pieces of training: simulated pipeline fills and the chunked KD loss (SPEC section 4).

Shape suffixes: B batch, N positions, D hidden, V vocabulary, C positions in a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sample_fills(batch_size: int, n_stages: int, generator: torch.Generator | None = None,
                 p_full: float = 0.5) -> torch.Tensor:
    """Per-example fill ``a`` (Appendix A.2): ``n`` with probability ``p_full``, else uniform in 1..n-1."""
    full_B = torch.rand(batch_size, generator=generator) < p_full
    if n_stages == 1:
        return torch.ones(batch_size, dtype=torch.long)
    partial_B = torch.randint(1, n_stages, (batch_size,), generator=generator)
    return torch.where(full_B, torch.full_like(partial_B, n_stages), partial_B)


@dataclass
class KDResult:
    """Sums over the valid positions of one batch (divide by ``count`` for means)."""

    loss_sum: torch.Tensor  # differentiable sum of tau^2 * KL(p_teacher || p_student)
    count: int  # valid positions
    agree: int  # positions where argmax(student) == argmax(teacher)


def _chunk_kl(student_CD, teacher_CD, student_head, teacher_head, tau: float):
    """tau^2 * KL(p_teacher || p_student) summed over a chunk, and the number of top-1 agreements."""
    with torch.no_grad():
        teacher_CV = teacher_head(teacher_CD).float()
        log_p_CV = F.log_softmax(teacher_CV / tau, dim=-1)
    student_CV = student_head(student_CD).float()
    log_q_CV = F.log_softmax(student_CV / tau, dim=-1)
    kl = (log_p_CV.exp() * (log_p_CV - log_q_CV)).sum() * tau**2
    agree = (student_CV.argmax(-1) == teacher_CV.argmax(-1)).sum()
    return kl, agree


def kd_loss(student_ND: torch.Tensor, teacher_ND: torch.Tensor, student_head, teacher_head, tau: float = 1.0,
            chunk_size: int = 512) -> KDResult:
    """Forward KL over the full vocabulary for supervised positions, in chunks of ``chunk_size`` positions.

    ``student_ND`` / ``teacher_ND`` are final hidden states of the supervised positions; the heads map them
    to logits. Each chunk is checkpointed (its logits are recomputed in backward), so at most one chunk of
    ``chunk_size x V`` logits exists at any time, in the forward and in the backward pass.
    """
    loss_sum = student_ND.new_zeros((), dtype=torch.float32)
    agree = 0
    grad = torch.is_grad_enabled() and student_ND.requires_grad
    for start in range(0, student_ND.shape[0], chunk_size):
        args = (student_ND[start:start + chunk_size], teacher_ND[start:start + chunk_size], student_head,
                teacher_head, tau)
        if grad:
            kl, n_agree = torch.utils.checkpoint.checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            kl, n_agree = _chunk_kl(*args)
        loss_sum = loss_sum + kl
        agree += int(n_agree)
    return KDResult(loss_sum, int(student_ND.shape[0]), agree)
