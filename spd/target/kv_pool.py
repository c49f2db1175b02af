"""Every request's KV of a batched pipeline in one buffer per stage (docs/method.md §9).

A request holds one *region*: a range of rows, the same in every stage's buffer, as long as its longest possible
sequence (prompt, budget and the tree in flight: the ``capacity`` the step loop asks for). Its stage caches are
:class:`~spd.target.kv_cache.StageKVCache` objects whose buffers are views of its region, so everything a single
request does to its caches (append, truncate after a flush, compact after a prune) works unchanged and touches
only its own rows; a ragged stage call (:mod:`spd.target.ragged`) reads every request's keys from the one buffer
in a single attention call. Regions are handed out first-fit and given back when the request ends; a request
whose region does not fit waits (the KV memory bound). The pool's size is fixed when it is made: ``rows`` rows in
each stage (bytes per row: :meth:`KVPool.row_bytes`).

In the distributed runtime (:mod:`spd.runtime.batch`) each stage rank holds the buffer of its own stage only
(``stages=[s]``), and rank 0 a *ledger*: the same regions and cache lengths with no keys or values
(``ledger=True``), so that the step loop's bookkeeping (lengths, flush, prune) runs on rank 0 unchanged while the
rows themselves live on the stages.

On a hybrid target (docs/method.md, "Hybrid targets") the pool holds the attention layers' rows only; each
request's stage cache carries its own linear-attention state beside them
(:class:`~spd.target.linear_state.LinearStateRing`: a fixed size per request, so ``max_batch`` bounds it), which a
ragged call reads and writes for each request (:func:`spd.target.ragged.run_ragged`), and which rolls back with the
request's flushes like a single request's.

Shape suffixes: L a stage's attention layers, Hk KV heads, C pool rows, Dh head dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpdInputError
from .kv_cache import StageKVCache
from .linear_state import LinearStateRing
from .staging import StagedModel


@dataclass(frozen=True)
class Region:
    """Rows ``[start, start + rows)`` of every stage's buffer."""

    start: int
    rows: int


class KVPool:
    """One KV buffer per stage of ``staged``, ``rows`` rows each, shared by the requests of a batched pipeline.

    ``stages``: the stages whose buffers this process holds (default all; a stage rank holds its own); ``ledger``:
    lengths and positions only, no keys or values (rank 0 of the distributed runtime)."""

    def __init__(
        self,
        staged: StagedModel,
        rows: int,
        stages: list[int] | None = None,
        ledger: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ):
        if not isinstance(rows, int) or rows < 1:
            raise SpdInputError(f"the KV pool needs a positive number of rows, got {rows!r}")
        self.staged, self.rows, self.ledger = staged, rows, ledger
        self.layer_ids, self.linear_ids = map(list, zip(*(staged.stage_layer_kinds(s) for s in range(staged.n_stages))))
        self.stages = list(range(staged.n_stages)) if stages is None else list(stages)
        self.keys_LBHkCDh: dict[int, torch.Tensor] = {}
        self.values_LBHkCDh: dict[int, torch.Tensor] = {}
        self.positions_C: dict[int, torch.Tensor] = {}
        for s in self.stages:
            shape = (len(self.layer_ids[s]), 1, staged.kv_heads, rows, 0 if ledger else staged.head_dim)
            self.keys_LBHkCDh[s] = torch.zeros(shape, dtype=dtype or staged.dtype, device=device or staged.device)
            self.values_LBHkCDh[s] = torch.zeros_like(self.keys_LBHkCDh[s])
            self.positions_C[s] = torch.zeros(rows, dtype=torch.long, device=device or staged.device)
        self.free: list[Region] = [Region(0, rows)]  # sorted by start, never adjacent

    @staticmethod
    def row_bytes(staged: StagedModel) -> int:
        """Bytes one row takes over every stage (keys and values of every layer, and its position)."""
        element = torch.empty((), dtype=staged.dtype).element_size()
        attention = sum(len(staged.stage_layer_kinds(s)[0]) for s in range(staged.n_stages))
        return attention * 2 * staged.kv_heads * staged.head_dim * element + staged.n_stages * 8

    @property
    def free_rows(self) -> int:
        return sum(region.rows for region in self.free)

    def allocate(self, rows: int) -> Region | None:
        """The first free region of ``rows`` rows, or None when none is that long (the request waits)."""
        for i, region in enumerate(self.free):
            if region.rows >= rows:
                rest = Region(region.start + rows, region.rows - rows)
                self.free[i : i + 1] = [rest] if rest.rows else []
                return Region(region.start, rows)
        return None

    def release(self, region: Region) -> None:
        """Give ``region`` back (merged with free neighbours)."""
        free = sorted(self.free + [region], key=lambda r: r.start)
        merged: list[Region] = []
        for r in free:
            if merged and merged[-1].start + merged[-1].rows == r.start:
                merged[-1] = Region(merged[-1].start, merged[-1].rows + r.rows)
            else:
                merged.append(r)
        self.free = merged

    def caches(self, region: Region) -> list[StageKVCache]:
        """Empty caches over ``region``'s rows for every stage this pool holds (views; they never grow)."""
        return [self.cache(s, region) for s in self.stages]

    def cache(self, stage: int, region: Region) -> StageKVCache:
        """An empty cache of ``stage`` over ``region``'s rows (views of the pool's buffers)."""
        end = region.start + region.rows
        cache = StageKVCache.over(
            self.layer_ids[stage],
            self.keys_LBHkCDh[stage][:, :, :, region.start : end],
            self.values_LBHkCDh[stage][:, :, :, region.start : end],
            self.positions_C[stage][region.start : end],
            base=region.start,
        )
        if self.linear_ids[stage] and not self.ledger:  # a hybrid target: the request's own linear-attention state
            # (a stage holds at most n + 1 tokens past the committed prefix: n - 1 in flight, a level run ahead of its
            # verification, as on the distributed runtime's stages)
            cache.linear = LinearStateRing(self.linear_ids[stage], self.staged.n_stages + 2)
        return cache
