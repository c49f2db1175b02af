"""The stage back-ends: what the step loop (:mod:`spd.decoding.loop`) and the batched driver
(:mod:`spd.decoding.batch`) ask of the place where the target's stages run, and the back-ends of this process.

- :class:`StageBackend`, one request's stages: :class:`LocalStages` (this process, the
  reference), :class:`~spd.runtime.remote.RemoteStages` (one process per stage over ``torch.distributed``);
- :class:`BatchBackend`, the stage work of many requests at once: :class:`LocalBatch` and
  :class:`~spd.runtime.batch.RemoteBatch`, each giving a request its :class:`StageBackend` (``request_stages``).

``tests/test_layout.py`` checks that every back-end has each method with the protocol's parameters.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..target.kv_cache import StageKVCache
from ..target.kv_pool import KVPool, Region
from ..target.ragged import run_ragged
from ..target.segments import Segment
from ..target.staging import StagedModel, StageOutput
from .tree import Level, TokenTree


class StageBackend(Protocol):
    """One request's ``n`` stages, each with its own KV cache."""

    def configure(self, stage_anchors: list[list[int]], paths: bool = False) -> None:
        """Which hidden states ``H^l`` each stage reports; ``paths``: every level of the coming requests is a chain's
        one node."""

    def prefill(self, prompt_ids_1T: torch.Tensor, anchors: list[int], capacity: int) -> StageOutput:
        """Start a request: fresh caches, the prompt through every stage; H^L and ``anchors`` for all positions."""

    def launch_level(self, level: Level, tree: TokenTree, committed: int, early: bool = False) -> None:
        """A level at depth 0 is about to enter stage 1 (``early``: made during this step, before its
        verification)."""

    def advance(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Every level in flight runs its next stage."""

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root is committed; every stage keeps the subtree ``kept`` (old tree indices)."""

    def flush(self, length: int) -> None:
        """Drop every in-flight activation and cut every stage's KV cache to ``length`` tokens."""


class BatchBackend(Protocol):
    """The stage work of a batched pipeline: a KV pool shared by the requests and one ragged call per stage."""

    pool: KVPool

    def request_stages(self) -> LocalStages:
        """A new request's stage back-end (its prunes and flushes); its caches are views of the pool, from which the
        driver builds each stage call's segments."""

    def open(self, region: Region) -> list[StageKVCache]:
        """A request's caches, one per stage, in its region of the pool."""

    def release(self, region: Region) -> None:
        """The request ended: its region goes back to the pool."""

    def new_step(self) -> None:
        """A pipeline step begins."""

    def idle(self) -> None:
        """Nothing is in flight (the batch is empty)."""

    def start(self, calls: list[list[Segment]]):
        """Start each stage's ragged call over its segments; returns what :meth:`finish` takes."""

    def finish(self, started) -> list[list[StageOutput]]:
        """The outputs of the calls :meth:`start` started, per stage and segment."""


class RemoteStageBackend(StageBackend, Protocol):
    """A stage back-end whose stages run in other processes and that runs a batched pipeline's stage work there too
    (:class:`spd.runtime.remote.RemoteStages`)."""

    def batch_backend(self, rows: int) -> BatchBackend:
        """The back-end of a batched pipeline over these stages, with a KV pool of ``rows`` rows on each."""


class LocalStages:
    """All ``n`` stages in this process, each with its own KV cache: the reference stage back-end
    (:class:`spd.decoding.backend.StageBackend`).

    The loop talks to its stages only through these methods; :class:`spd.runtime.remote.RemoteStages` implements
    them over ``torch.distributed`` (one process per stage).
    """

    def __init__(self, staged: StagedModel):
        self.staged = staged
        self.caches: list[StageKVCache] = []
        self.stage_anchors: list[list[int]] = [[] for _ in range(staged.n_stages)]
        self.paths = False

    def configure(self, stage_anchors: list[list[int]], paths: bool = False) -> None:
        """Which hidden states ``H^l`` each stage reports (empty lists: none); ``paths``: every level of the coming
        requests is one node whose ancestors are all the nodes before it (a chain)."""
        self.stage_anchors = stage_anchors
        self.paths = paths

    def prefill(self, prompt_ids_1T: torch.Tensor, anchors: list[int], capacity: int) -> StageOutput:
        """Start a request: fresh caches, the prompt through every stage; H^L and ``anchors`` for all positions."""
        self.caches = self.staged.new_caches(capacity=capacity)
        return self.staged.forward_stages(prompt_ids_1T, self.caches, anchors=anchors)

    def launch_level(self, level: Level, tree: TokenTree, committed: int, early: bool = False) -> None:
        """A level at depth 0 is about to enter stage 1 (``early``: made during this step, before its
        verification); remote stages get it now or at the next step; here it runs at the next advance."""

    def advance(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Every level in flight runs its next stage: committed rows plus its ancestors, at committed + depth."""
        for level in levels:
            stage = level.depth
            cache = self.caches[stage]
            self._check(level, committed)
            if self.paths:  # a chain's node: the next position, causal
                out = self.staged.run_stage(stage, level.hidden_1TD, cache, anchors=self.stage_anchors[stage])
            else:
                positions_1T, tree_mask_TN = self._tree_rows(level, tree, committed)
                out = self.staged.run_stage(
                    stage,
                    level.hidden_1TD,
                    cache,
                    positions_1T,
                    anchors=self.stage_anchors[stage],
                    tree_mask_TN=tree_mask_TN,
                )
            self.took(level, out)

    def segment(self, level: Level, tree: TokenTree, committed: int) -> Segment:
        """The level's next stage as a segment of a ragged batch (:mod:`spd.target.ragged`; pooled caches)."""
        self._check(level, committed)
        if self.paths:
            return Segment(self.caches[level.depth], level.hidden_1TD, anchors=self.stage_anchors[level.depth])
        positions_1T, tree_mask_TN = self._tree_rows(level, tree, committed)
        return Segment(
            self.caches[level.depth], level.hidden_1TD, positions_1T[0], tree_mask_TN, self.stage_anchors[level.depth]
        )

    def took(self, level: Level, out: StageOutput) -> None:
        """The level ran its next stage with output ``out``."""
        for index, hidden_1TD in out.anchors.items():
            level.anchors[index] = hidden_1TD[0]
        level.hidden_1TD = out.hidden_BTD
        level.depth += 1

    def _check(self, level: Level, committed: int) -> None:
        cache = self.caches[level.depth]
        if cache.length != committed + level.start:
            raise RuntimeError(
                f"stage {level.depth} holds {cache.length} rows but the level starting at tree node "
                f"{level.start} expects {committed + level.start}"
            )

    def _tree_rows(self, level: Level, tree: TokenTree, committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The level's position ids ``(1, T)`` (committed + depth) and its rows of the ancestor mask ``(T, N)``."""
        start, end = level.start, level.start + level.size
        return tree.positions(committed)[start:end][None].to(self.staged.device), tree.mask()[start:end, :end]

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root (row ``committed``) is committed; every stage keeps the subtree ``kept`` (old tree indices). A
        chain keeps every node in place: nothing to move."""
        if not self.paths:
            self.staged.prune_tree(self.caches, committed, kept)

    def flush(self, length: int) -> None:
        """Drop every in-flight activation and cut every stage's KV cache to ``length`` tokens."""
        self.staged.truncate(self.caches, length)


class LocalBatch:
    """The stage work of a batched pipeline in this process: a :class:`~spd.target.kv_pool.KVPool` and one ragged call
    per stage. (:class:`spd.runtime.batch.RemoteBatch` has the same methods for stages on other ranks.)"""

    def __init__(self, staged: StagedModel, rows: int):
        self.staged = staged
        self.pool = KVPool(staged, rows)

    def request_stages(self) -> LocalStages:
        """A new request's stage back-end (its caches come with :meth:`open`)."""
        return LocalStages(self.staged)

    def open(self, region: Region) -> list[StageKVCache]:
        """The stage caches of a request admitted to ``region``."""
        return self.pool.caches(region)

    def release(self, region: Region) -> None:
        """The request ended: its region goes back to the pool."""
        self.pool.release(region)

    def new_step(self) -> None:
        """A pipeline step begins."""

    def idle(self) -> None:
        """No request is queued or in flight."""

    def start(self, calls: list[list[Segment]]) -> list[list[StageOutput]]:
        """Start every stage's segments (``calls[s]``): here one ragged call per stage, run now."""
        return [run_ragged(self.pool, stage, segments) if segments else [] for stage, segments in enumerate(calls)]

    def finish(self, started: list[list[StageOutput]]) -> list[list[StageOutput]]:
        """The outputs of :meth:`start`'s work, per stage and segment."""
        return started
