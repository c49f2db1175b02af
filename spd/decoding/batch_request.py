"""One request of a batched pipeline (:mod:`spd.decoding.batch`): its step loop, its stage caches, its prompt in flight
and where it stands."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..target.kv_pool import Region
from ..target.staging import StagedModel, StageOutput
from .backend import LocalStages
from .driver import Prefill, Work
from .generation import GenerationOutput
from .proposers import Proposer
from .tree_width import WidthPolicy


@dataclass
class PromptChunk:
    """A piece of a newcomer's prompt in flight: the rows before ``end``, at stage ``depth``."""

    end: int
    hidden_1TD: torch.Tensor
    depth: int = 0
    anchors: dict[int, torch.Tensor] = field(default_factory=dict)

    def took(self, out: StageOutput) -> None:
        """The chunk ran its next stage with output ``out``."""
        self.anchors.update(out.anchors)
        self.hidden_1TD = out.hidden_BTD
        self.depth += 1


class BatchRequest:
    """One request of a :class:`~spd.decoding.batch.BatchedPipeline`: its loop, its caches and where it stands.

    ``state`` is ``queued``, ``prefill``, ``running``, then ``done`` (``output`` holds the result), ``failed``
    (``error`` holds the exception) or ``cancelled`` (cancelled before its first token)."""

    def __init__(self, rid: int, steps, backend: LocalStages, on_done: Callable[[BatchRequest], None] | None):
        self.id, self.steps, self.backend, self.on_done = rid, steps, backend, on_done
        self.state = "queued"
        self.work: Work | None = None  # what its loop handed over last (None once it ended)
        self.region: Region | None = None
        self.proposer: Proposer | None = None  # its own copy of the engine's proposer (None: the standard pipeline)
        self.source: Proposer | None = None  # the engine's proposer it was copied from (its head, to its end)
        # Its own width policy: a copy of the engine's (SharedWidth under a node budget).
        self.width: WidthPolicy | None = None
        self.output: GenerationOutput | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.chunks: list[PromptChunk] = []  # the prompt in flight (state prefill)
        self.next_row = 0  # the prompt's first row not yet in flight
        self.prefill_anchors: dict[int, list[torch.Tensor]] = {}  # H^l of the prompt's chunks that left stage n
        self.prefill_stage_anchors: list[list[int]] = []  # which of them each stage reports
        self.ran_ahead: list = []  # the levels of its last step that ran before their verification

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    def cancel(self) -> None:
        """End the request: before its first token it leaves at once, after it at its next token
        (``stop_reason`` "stopped")."""
        self.cancelled = True

    @property
    def prefill(self) -> Prefill:
        """Its work while queued or in prefill: the prompt through every stage, what its loop asks first."""
        assert isinstance(self.work, Prefill), self.state
        return self.work

    def next_chunk(self, budget: int, staged: StagedModel, spread: bool) -> int:
        """The prompt's next chunk, at most ``budget`` tokens, enters stage 1 (if any is left); its size. ``spread``:
        the prompt goes in ``n`` equal chunks."""
        ids_1T = self.prefill.ids_1T
        start = self.next_row
        if start >= ids_1T.shape[1] or budget <= 0:
            return 0
        if spread:  # the prompt in n equal chunks: each stage call carries 1/n of it
            budget = min(budget, -(-ids_1T.shape[1] // staged.n_stages))
        end = min(start + budget, ids_1T.shape[1])
        chunk = PromptChunk(end, staged.embed(ids_1T[:, start:end]))
        if 0 in self.prefill.anchors:
            chunk.anchors[0] = chunk.hidden_1TD
        self.chunks.append(chunk)
        self.next_row = end
        return end - start
