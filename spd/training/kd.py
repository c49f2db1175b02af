"""Knowledge-distillation pieces of training: simulated pipeline fills and the chunked KD loss (docs/method.md §4).

Shape suffixes: B batch, N positions, D hidden, V vocabulary, C positions in a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sample_fills(
    batch_size: int, n_stages: int, generator: torch.Generator | None = None, p_full: float = 0.5
) -> torch.Tensor:
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


def _chunk_kl(student_CD, teacher_CD, rows: int, student_head, teacher_head, tau: float, draft_ids_K):
    """tau^2 * KL(p_teacher || p_student) summed over the first ``rows`` of a chunk, and their top-1 agreements.

    With a draft vocabulary (``draft_ids_K``: the target ids of the student's K outputs) the teacher is
    restricted to those ids and renormalised; agreement compares the student's choice, mapped to a target id,
    with the teacher's top-1 over the whole vocabulary (the token verification would accept).
    """
    with torch.no_grad():
        teacher_CV = teacher_head(teacher_CD).float()
        teacher_top_C = teacher_CV.argmax(-1)
        if draft_ids_K is not None:
            teacher_CV = teacher_CV[:, draft_ids_K]
        log_p_CV = F.log_softmax(teacher_CV / tau, dim=-1)
    student_CV = student_head(student_CD).float()
    log_q_CV = F.log_softmax(student_CV / tau, dim=-1)
    kl = (log_p_CV.exp() * (log_p_CV - log_q_CV))[:rows].sum() * tau**2
    choice_C = student_CV.argmax(-1)
    if draft_ids_K is not None:
        choice_C = draft_ids_K[choice_C]
    agree = (choice_C == teacher_top_C)[:rows].sum()
    return kl, agree


def _chunk_kl_topk(student_CD, topk_ids_CK, topk_logprobs_CK, rows: int, student_head):
    """KL over k + 1 buckets (the teacher's top k and the rest of the mass) over the first ``rows`` of a chunk, and
    their top-1 agreements."""
    student_CV = student_head(student_CD).float()[:rows]
    topk_ids_CK, topk_logprobs_CK = topk_ids_CK[:rows], topk_logprobs_CK[:rows]
    log_q_CV = F.log_softmax(student_CV, dim=-1)
    log_q_CK = log_q_CV.gather(-1, topk_ids_CK)
    p_CK = topk_logprobs_CK.exp()
    p_rest_C = (1 - p_CK.sum(-1)).clamp(min=0)
    # log(1 - sum q_k) from the log-probs, kept finite when the top k hold (almost) all of the student's mass.
    log_q_rest_C = torch.log1p(-log_q_CK.exp().sum(-1).clamp(max=1 - 1e-6))
    kl = (p_CK * (topk_logprobs_CK - log_q_CK)).sum()
    kl = kl + torch.where(p_rest_C > 0, p_rest_C * (p_rest_C.clamp(min=1e-30).log() - log_q_rest_C), 0.0).sum()
    agree = (student_CV.argmax(-1) == topk_ids_CK[:, 0]).sum()
    return kl, agree


def padded_length(length: int, multiple: int, limit: int | None = None) -> int:
    """``length`` rounded up to a ``multiple``, but not past ``limit`` (nor below ``length``): the one padding rule
    of a batch's rows and of the KD loss's last chunk of positions (``pad_to_multiple_of``)."""
    rounded = -(-length // multiple) * multiple
    return max(length, rounded if limit is None else min(rounded, limit))


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _chunked(
    fn, chunk_size: int, pad_to: int, grad: bool, *tensors_and_rest, n_tensors: int
) -> tuple[torch.Tensor, int]:
    """``fn`` over chunks of ``chunk_size`` rows, the last padded with zero rows to a multiple of ``pad_to`` (which
    ``fn`` leaves out of its sums): that chunk's size, different in every batch, would otherwise give the LM heads'
    matmuls a new shape each step, and a CPU's kernel cache and heap grow with every shape (docs/training.md)."""
    tensors, rest = tensors_and_rest[:n_tensors], tensors_and_rest[n_tensors:]
    loss_sum = tensors[0].new_zeros((), dtype=torch.float32)
    agree = 0
    total = tensors[0].shape[0]
    for start in range(0, total, chunk_size):
        rows = min(chunk_size, total - start)
        padded = padded_length(rows, pad_to, chunk_size)
        args = (*(_padded_rows(t[start : start + rows], padded) for t in tensors), rows, *rest)
        if grad:
            kl, n_agree = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        else:
            kl, n_agree = fn(*args)
        loss_sum = loss_sum + kl
        agree += int(n_agree)
    return loss_sum, agree


def kd_loss(
    student_ND: torch.Tensor,
    teacher_ND: torch.Tensor,
    student_head,
    teacher_head,
    tau: float = 1.0,
    chunk_size: int = 512,
    draft_ids_K: torch.Tensor | None = None,
    pad_to: int = 1,
) -> KDResult:
    """Forward KL over the vocabulary (or the draft vocabulary ``draft_ids_K``) for supervised positions.

    ``student_ND`` / ``teacher_ND`` are final hidden states of the supervised positions; the heads map them
    to logits. Each chunk of ``chunk_size`` positions is checkpointed (its logits are recomputed in
    backward), so at most one chunk of ``chunk_size x V`` logits exists at any time, in the forward and in
    the backward pass.
    """
    grad = torch.is_grad_enabled() and student_ND.requires_grad
    loss_sum, agree = _chunked(
        _chunk_kl,
        chunk_size,
        pad_to,
        grad,
        student_ND,
        teacher_ND,
        student_head,
        teacher_head,
        tau,
        draft_ids_K,
        n_tensors=2,
    )
    return KDResult(loss_sum, int(student_ND.shape[0]), agree)


def kd_loss_topk(
    student_ND: torch.Tensor,
    topk_ids_NK: torch.Tensor,
    topk_logprobs_NK: torch.Tensor,
    student_head,
    chunk_size: int = 512,
    pad_to: int = 1,
) -> KDResult:
    """KD against a stored top-k teacher (temperature 1): KL over the top k tokens and the rest of the mass."""
    grad = torch.is_grad_enabled() and student_ND.requires_grad
    loss_sum, agree = _chunked(
        _chunk_kl_topk, chunk_size, pad_to, grad, student_ND, topk_ids_NK, topk_logprobs_NK, student_head, n_tensors=3
    )
    return KDResult(loss_sum, int(student_ND.shape[0]), agree)
