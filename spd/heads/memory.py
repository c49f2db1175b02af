"""The SPD head's memory at inference: the keys and values of its depth-max rows, per layer (docs/method.md §3).

A request decoding alone keeps a :class:`SpeculatorCache`; the head appends rows as they reach max depth
(:meth:`spd.heads.speculator.Speculator.append_memory`) and its queries read them
(:meth:`~spd.heads.speculator.Speculator.query`).

The requests of a batched pipeline (:mod:`spd.decoding.batch`) keep theirs in one :class:`SpeculatorPool`: one buffer
per layer of shape ``(slots, Hk, C, Dh)``, a *slot* per request (a :class:`PooledSpeculatorCache`, whose keys and
values are views of its slot), so that the head's joint query over every request
(:meth:`~spd.heads.speculator.Speculator.query_many`) reads every request's rows where they lie, in one attention call
over the buffer, with nothing gathered or copied. The rows of a slot past its cache's length are scratch: the joint
query writes its trailing rows (the tokens in flight) there.

Shape suffixes: B batch, S slots, Hk kv heads, C rows, Dh head dim.
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


class SpeculatorPool:
    """The memory of a batched pipeline's requests: ``slots`` slots of ``capacity`` rows in one buffer per layer (see
    the module docstring). A slot is taken with :meth:`cache` and given back with :meth:`release`; the buffers grow
    (every slot at once) when a request needs more rows than they hold."""

    def __init__(self, config: SpeculatorConfig, slots: int, capacity: int, dtype, device):
        shape = (slots, config.num_key_value_heads, capacity, config.head_dim)
        self._dtype, self._device = dtype, device
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.free = list(range(slots))  # ascending: the lowest free slot is taken first

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def cache(self, capacity: int) -> "PooledSpeculatorCache":
        """An empty cache of at least ``capacity`` rows in the lowest free slot."""
        if not self.free:
            raise RuntimeError(f"the head's memory pool has no free slot (it has {self.keys[0].shape[0]})")
        self.reserve(capacity)
        return PooledSpeculatorCache(self, self.free.pop(0))

    def release(self, cache: "PooledSpeculatorCache") -> None:
        """Give ``cache``'s slot back."""
        if cache.pool is not self or cache.slot in self.free:
            raise RuntimeError(f"slot {cache.slot} is not held in this pool")
        self.free.append(cache.slot)
        self.free.sort()

    def reserve(self, length: int) -> None:
        """At least ``length`` rows in every slot (the rows held are kept)."""
        capacity = self.capacity
        if length <= capacity:
            return
        new_capacity = max(length, 2 * capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = torch.zeros(*old.shape[:2], new_capacity, old.shape[3], dtype=self._dtype, device=self._device)
                new[:, :, :capacity] = old
                store[i] = new


class PooledSpeculatorCache(SpeculatorCache):
    """A request's memory in slot ``slot`` of a :class:`SpeculatorPool`: a :class:`SpeculatorCache` whose keys and
    values (batch 1) are views of that slot, so a request alone reads and writes it as it would its own."""

    def __init__(self, pool: SpeculatorPool, slot: int):
        self.pool, self.slot, self.length = pool, slot, 0

    @property
    def keys(self) -> list[torch.Tensor]:
        return [k[self.slot:self.slot + 1] for k in self.pool.keys]

    @property
    def values(self) -> list[torch.Tensor]:
        return [v[self.slot:self.slot + 1] for v in self.pool.values]

    def reserve(self, length: int) -> None:
        self.pool.reserve(length)
