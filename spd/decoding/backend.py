"""The stage back-ends' interfaces: what the step loop (:mod:`spd.decoding.loop`) and the batched driver
(:mod:`spd.decoding.batch`) ask of the place where the target's stages run.

- :class:`StageBackend`, one request's stages: :class:`~spd.decoding.loop.LocalStages` (this process, the
  reference), :class:`~spd.runtime.remote.RemoteStages` (one process per stage over ``torch.distributed``);
- :class:`BatchBackend`, the stage work of many requests at once: :class:`~spd.decoding.batch.LocalBatch` and
  :class:`~spd.runtime.batch.RemoteBatch`, each giving a request its :class:`StageBackend` (``request_stages``).

``tests/test_layout.py`` checks that every back-end has each method with the protocol's parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..target.kv_cache import StageKVCache
    from ..target.kv_pool import KVPool, Region
    from ..target.segments import Segment
    from ..target.staging import StageOutput
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

    def request_stages(self) -> StageBackend:
        """A new request's stage back-end (its prunes and flushes)."""

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
