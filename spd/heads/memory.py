"""The SPD head's memory at inference: the keys and values of its depth-max rows, per layer (docs/method.md §3).

A request keeps a :class:`SpeculatorCache`; the head appends rows as they reach max depth
(:meth:`spd.heads.speculator.Speculator.append_memory`) and its queries read them
(:meth:`~spd.heads.speculator.Speculator.query`).

Shape suffixes: B batch, Hk kv heads, C rows, Dh head dim.
"""

from __future__ import annotations

import torch

from .config import SpeculatorConfig


class SpeculatorCache:
    """Per-layer K/V of the head's depth-max memory rows; truncation sets the length (rollback)."""

    def __init__(self, config: SpeculatorConfig, batch_size: int, capacity: int, dtype, device):
        self._shape = (batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self._dtype, self._device = dtype, device
        self.keys = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(self._shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.length = 0

    def reserve(self, length: int) -> None:
        capacity = self.keys[0].shape[2]
        if length <= capacity:
            return
        new_capacity = max(length, 2 * capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = torch.zeros(*old.shape[:2], new_capacity, old.shape[3], dtype=self._dtype, device=self._device)
                new[:, :, : self.length] = old[:, :, : self.length]
                store[i] = new

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
