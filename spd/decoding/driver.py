"""How a request's step loop (:meth:`spd.decoding.loop.StepLoop.steps`, a generator) and its driver talk: the work
the loop hands over (:class:`Prefill`, :class:`Advance`, then :data:`COLLECT` where it needs an advance's outputs),
its questions (:class:`Propose`, :class:`TargetLogits`, answered together for many requests by :func:`answer_many`),
and :func:`drive`, the driver of one request alone. :class:`spd.decoding.batch.BatchedPipeline` drives many.

Shape suffixes: T tokens, L nodes of the bottom level, D hidden size, V vocabulary; a leading 1 is the batch.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from ..target.staging import StagedModel
from .backend import StageBackend
from .generation import GenerationOutput
from .proposers import Proposer, propose_many
from .tree import Level, TokenTree


@dataclass
class Prefill:
    """Work a request hands its driver: the prompt through every stage (fresh caches of ``capacity`` rows); the
    driver answers with the :class:`~spd.target.staging.StageOutput` (H^L and ``anchors`` for every position)."""

    ids_1T: torch.Tensor
    anchors: list[int]
    capacity: int


@dataclass
class Advance:
    """Work a request hands its driver: every level of ``levels`` runs its next stage (``backend.advance``). The
    driver may start it at once; the request then goes on (the proposer's next level) until it hands over
    :data:`COLLECT`, where it needs the outputs.

    ``after_verify``: the second advance of a step whose root level left stage ``n`` (the other levels, after the
    verification pruned them). ``then``: at such a step's first advance, the levels that the second one will move
    if they survive the verification. :func:`drive` runs them after it (pruned first); a batched driver runs them
    with the first advance, in the same stage calls, and the verification then prunes their outputs and rows,
    so its second advance has nothing left to run.
    """

    levels: list[Level]
    tree: TokenTree
    committed: int
    after_verify: bool = False
    then: list[Level] = field(default_factory=list)


@dataclass
class Propose:
    """Work a request hands its driver: the proposer's distributions after the tree's bottom nodes,
    ``proposer.expand(tree, context, levels)``; the driver answers with the ``(L, X)`` log-probabilities. :func:`drive`
    asks the proposer at once; a batched driver asks every request's proposer together
    (:func:`spd.decoding.proposers.propose_many`: one batched head call where the proposers share a head)."""

    proposer: Proposer
    tree: TokenTree
    context: list[int]
    levels: list[Level]

    def answer(self) -> torch.Tensor:
        """The proposer's answer, asked alone."""
        return self.proposer.expand(self.tree, self.context, self.levels)


@dataclass
class TargetLogits:
    """Work a request hands its driver: the target's logits ``(1, V)`` after its root's last row (what the verification
    reads). A batched driver computes those of many requests in one LM-head call (:func:`answer_many`)."""

    staged: StagedModel
    hidden_1D: torch.Tensor

    def answer(self) -> torch.Tensor:
        """The logits, asked alone."""
        return self.staged.logits(self.hidden_1D)


def answer_many(items: Sequence[Propose | TargetLogits]) -> list[torch.Tensor]:
    """The answers to many requests' questions (:class:`Propose`, :class:`TargetLogits`), in their order: the
    proposers' together where they share a head (:func:`~spd.decoding.proposers.propose_many`), the target's
    logits in one LM-head call per target; a question alone of its kind is asked alone."""
    answers: list[torch.Tensor | None] = [None] * len(items)
    proposals = [i for i, item in enumerate(items) if isinstance(item, Propose)]
    for i, answer in zip(proposals, propose_many([items[i] for i in proposals])):
        answers[i] = answer
    by_target: dict[int, list[tuple[int, TargetLogits]]] = {}
    for i, item in enumerate(items):
        if isinstance(item, TargetLogits):
            by_target.setdefault(id(item.staged), []).append((i, item))
    for asked in by_target.values():
        if len(asked) == 1:
            answers[asked[0][0]] = asked[0][1].answer()
            continue
        logits_BV = asked[0][1].staged.logits(torch.cat([item.hidden_1D for _, item in asked]))
        for (i, _), logits_1V in zip(asked, logits_BV.split(1)):
            answers[i] = logits_1V
    # Every item is a Propose or a TargetLogits, so every slot holds its answer now.
    return cast(list[torch.Tensor], answers)


class Collect:
    """The point where a request needs the outputs of the :class:`Advance` it handed over last: the driver finishes
    that work (and applies its outputs to the levels) before it resumes the request."""


COLLECT = Collect()

Work = Prefill | Advance | Propose | TargetLogits | Collect  # what a request's step loop hands its driver
# A request's step loop: it yields its work, is sent each answer (None where there is none) and returns its output.
Steps = Generator[Work, object, GenerationOutput]


def drive(backend: StageBackend, steps: Steps) -> GenerationOutput:
    """Run one request's :meth:`~spd.decoding.loop.StepLoop.steps` on the stage back-end ``backend`` alone. An
    advance runs when the request collects it: after the proposer's step, which a remote back-end's stages overlap
    with work they already have."""
    pending: Advance | None = None
    try:
        work = next(steps)
        while True:
            if isinstance(work, Prefill):
                work = steps.send(backend.prefill(work.ids_1T, work.anchors, work.capacity))
            elif isinstance(work, (Propose, TargetLogits)):
                work = steps.send(work.answer())
            elif isinstance(work, Advance):
                pending, work = work, steps.send(None)
            else:
                assert pending is not None  # COLLECT comes after the Advance it collects
                backend.advance(pending.levels, pending.tree, pending.committed)
                work = steps.send(None)
    except StopIteration as done:
        return done.value
