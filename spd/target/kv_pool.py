"""Every request's KV of a batched pipeline in one buffer per stage (docs/method.md §9).

A request holds one *region*: a range of rows, the same in every stage's buffer, as long as its longest possible
sequence (prompt, budget and the tree in flight: the ``capacity`` the step loop asks for). Its stage caches are
:class:`~spd.target.staging.StageKVCache` objects whose buffers are views of its region, so everything a single
request does to its caches (append, truncate after a flush, compact after a prune) works unchanged and touches
only its own rows; a ragged stage call (:mod:`spd.target.ragged`) reads every request's keys from the one buffer
in a single attention call. Regions are handed out first-fit and given back when the request ends; a request
whose region does not fit waits (the KV memory bound). The pool's size is fixed when it is made: ``rows`` rows in
each stage (bytes per row: :meth:`KVPool.row_bytes`).

Shape suffixes: L a stage's attention layers, Hk KV heads, C pool rows, Dh head dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpdInputError
from .staging import StageKVCache, StagedModel


@dataclass(frozen=True)
class Region:
    """Rows ``[start, start + rows)`` of every stage's buffer."""

    start: int
    rows: int


class KVPool:
    """One KV buffer per stage of ``staged``, ``rows`` rows each, shared by the requests of a batched pipeline."""

    def __init__(self, staged: StagedModel, rows: int):
        if staged.is_hybrid:
            raise SpdInputError("batched decoding does not run hybrid (linear-attention) targets yet: their "
                                "recurrent state is per request; serve them one request at a time (--max-batch 1)")
        if not isinstance(rows, int) or rows < 1:
            raise SpdInputError(f"the KV pool needs a positive number of rows, got {rows!r}")
        self.staged, self.rows = staged, rows
        self.layer_ids = [list(staged.stage_layers(s)) for s in range(staged.n_stages)]
        shape = (1, staged.kv_heads, rows, staged.head_dim)
        self.keys_LBHkCDh = [torch.zeros(len(ids), *shape, dtype=staged.dtype, device=staged.device)
                             for ids in self.layer_ids]
        self.values_LBHkCDh = [torch.zeros_like(k) for k in self.keys_LBHkCDh]
        self.positions_C = [torch.zeros(rows, dtype=torch.long, device=staged.device) for _ in self.layer_ids]
        self.free: list[Region] = [Region(0, rows)]  # sorted by start, never adjacent

    @staticmethod
    def row_bytes(staged: StagedModel) -> int:
        """Bytes one row takes over every stage (keys and values of every layer, and its position)."""
        element = torch.empty((), dtype=staged.dtype).element_size()
        return staged.num_layers * 2 * staged.kv_heads * staged.head_dim * element + staged.n_stages * 8

    @property
    def free_rows(self) -> int:
        return sum(region.rows for region in self.free)

    def allocate(self, rows: int) -> Region | None:
        """The first free region of ``rows`` rows, or None when none is that long (the request waits)."""
        for i, region in enumerate(self.free):
            if region.rows >= rows:
                rest = Region(region.start + rows, region.rows - rows)
                self.free[i:i + 1] = [rest] if rest.rows else []
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
        """Empty stage caches over ``region``'s rows (views of the pool's buffers; they never grow)."""
        end = region.start + region.rows
        return [StageKVCache.over(self.layer_ids[s], self.keys_LBHkCDh[s][:, :, :, region.start:end],
                                  self.values_LBHkCDh[s][:, :, :, region.start:end],
                                  self.positions_C[s][region.start:end], base=region.start)
                for s in range(len(self.layer_ids))]
