"""A head measured against its target on held-out batches: the KD loss and top-1 agreement at every fill, and the
acceptance they imply (alpha and L'_acc of the pipeline, or the mean acceptance length of serial drafting)."""

from __future__ import annotations

import math

import torch

from ..heads.speculator import Speculator
from ..target.staging import StagedModel
from .distill import distill_step, teacher_anchors, teacher_pass


def expected_accept_length(agreement: dict[int, float], n: int) -> dict[str, float]:
    """Estimate alpha and L'_acc from top-1 agreement per fill (greedy acceptance, independent proposals).

    After a (re)seed the head proposes with fills 1, 2, ..., n, n, ...; proposal j is verified n-1 steps
    after it is made, and the first rejection flushes. A segment with k accepted proposals takes n + k steps
    and commits k + 1 tokens, so by renewal-reward alpha = (1 + E[k]) / (n + E[k]) and L'_acc = n * alpha.
    """
    p = [min(max(agreement[min(j, n)], 0.0), 1.0) for j in range(1, n + 1)]
    prefix, expected_k = 1.0, 0.0
    for j in range(n - 1):
        prefix *= p[j]
        expected_k += prefix  # P(k >= j + 1)
    p_steady = p[n - 1]
    prefix *= p_steady
    expected_k += math.inf if p_steady >= 1 else prefix / (1 - p_steady)  # geometric tail at fill n
    alpha = 1.0 if math.isinf(expected_k) else (1 + expected_k) / (n + expected_k)
    return {"alpha": alpha, "L_acc": n * alpha}


def expected_serial_length(agreement: dict[int, float], m: int) -> float:
    """Mean acceptance length of serial drafting with m drafts (bonus / replacement token included), greedy.

    Draft j is made with j rows in flight (the newest committed token and j - 1 earlier drafts) and counts
    only if every earlier draft was accepted: ``1 + sum_j prod_{i <= j} p_i``.
    """
    prefix, length = 1.0, 1.0
    for j in range(1, m + 1):
        prefix *= min(max(agreement[j], 0.0), 1.0)
        length += prefix
    return length


@torch.no_grad()
def evaluate(head: Speculator, staged: StagedModel, batches: list[dict], tau: float, chunk: int) -> dict:
    """KD loss and top-1 agreement with the target for every fill a = 1..n (a = n: full pipeline).

    A serial head (variant eagle) is measured at every number of drafts in flight a = 1..draft_steps; its
    ``kd_loss`` is their mean, ``top1_full`` the first draft's agreement and ``L_acc_est`` the expected
    acceptance length of ``--mode sd --draft-steps draft_steps`` (bonus included; ``alpha_est`` = L_acc / (m + 1)).
    """
    return eval_metrics(eval_sums(head, staged, batches, tau, chunk), head.config)


@torch.no_grad()
def evaluate_sets(head: Speculator, staged: StagedModel, sets: dict[str, list[dict]], tau: float, chunk: int) -> dict:
    """:func:`evaluate` over every named set's batches together, with each set's own metrics under ``"sets"``."""
    per_set = {name: eval_sums(head, staged, batches, tau, chunk) for name, batches in sets.items()}
    together = {
        a: [sum(sums[a][i] for sums in per_set.values()) for i in range(3)] for a in next(iter(per_set.values()))
    }
    return {
        **eval_metrics(together, head.config),
        "sets": {name: eval_metrics(sums, head.config) for name, sums in per_set.items()},
    }


def eval_sums(head: Speculator, staged: StagedModel, batches: list[dict], tau: float, chunk: int) -> dict:
    """Per fill a = 1..n: [KD loss summed over positions, positions, positions where the head's top-1 agrees]."""
    n = head.config.max_fill
    was_training = head.training
    head.eval()
    sums = {a: [0.0, 0, 0] for a in range(1, n + 1)}
    anchors = teacher_anchors(head, staged)
    for batch in batches:
        hidden = teacher_pass(staged, anchors, batch)
        for a in range(1, n + 1):
            fill_B = torch.full((batch["input_ids"].shape[0],), a, dtype=torch.long, device=batch["input_ids"].device)
            _, r = distill_step(head, staged, hidden, batch, fill_B, tau, chunk)
            sums[a][0] += float(r.loss_sum)
            sums[a][1] += r.count
            sums[a][2] += r.agree
    head.train(was_training)
    return sums


def eval_metrics(sums: dict, cfg) -> dict:
    """The metrics of :func:`evaluate` from :func:`eval_sums`' sums (``cfg``: the head's config)."""
    n = cfg.max_fill
    agreement = {a: s[2] / max(1, s[1]) for a, s in sums.items()}
    if cfg.schedule == "serial":
        length = expected_serial_length(agreement, n)
        return {
            "kd_loss": sum(s[0] for s in sums.values()) / max(1, sum(s[1] for s in sums.values())),
            "top1_full": agreement[1],
            "top1_by_fill": {str(a): round(v, 4) for a, v in agreement.items()},
            "alpha_est": length / (n + 1),
            "L_acc_est": length,
            "positions": sums[1][1],
        }
    est = expected_accept_length(agreement, n)
    return {
        "kd_loss": sums[n][0] / max(1, sums[n][1]),
        "top1_full": agreement[n],
        "top1_by_fill": {str(a): round(v, 4) for a, v in agreement.items()},
        "alpha_est": est["alpha"],
        "L_acc_est": est["L_acc"],
        "positions": sums[n][1],
    }
