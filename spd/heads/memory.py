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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import SpeculatorConfig


class SpeculatorCache:
    """Per-layer K/V of the head's depth-max memory rows; truncation sets the length (rollback)."""

    def __init__(
        self, config: SpeculatorConfig, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device
    ):
        self._keys, self._values = _buffers(config, batch_size, capacity, dtype, device)
        self.length = 0

    # Read-only: a pooled cache's keys and values are views of its slot (PooledSpeculatorCache).
    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer, ``(B, Hk, C, Dh)``."""
        return self._keys

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer, ``(B, Hk, C, Dh)``."""
        return self._values

    def reserve(self, length: int) -> None:
        """At least ``length`` rows (the cached ones kept)."""
        _grow((self.keys, self.values), length, kept=self.length)

    def truncate(self, length: int) -> None:
        """Keep the rows of positions before ``length`` (a rollback)."""
        self.length = min(self.length, length)

    def expand(self, batch: int) -> CacheView:
        """The cached rows of a batch-1 cache as the cache of ``batch`` queries, read in place (no copy)."""
        return CacheView(
            length=self.length,
            keys=[k[:, :, : self.length].expand(batch, -1, -1, -1) for k in self.keys],
            values=[v[:, :, : self.length].expand(batch, -1, -1, -1) for v in self.values],
        )


@dataclass
class CacheView:
    """Cached rows that several queries read at once (:meth:`SpeculatorCache.expand`): per layer, keys and values
    ``(B, Hk, length, Dh)``."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class SpeculatorPool:
    """The memory of a batched pipeline's requests: ``slots`` slots of ``capacity`` rows in one buffer per layer (see
    the module docstring). A slot is taken with :meth:`cache` and given back with :meth:`release`; the buffers grow
    (every slot at once) when a request needs more rows than they hold."""

    def __init__(self, config: SpeculatorConfig, slots: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.keys, self.values = _buffers(config, slots, capacity, dtype, device)
        self.free = list(range(slots))  # ascending: the lowest free slot is taken first

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def cache(self, capacity: int) -> PooledSpeculatorCache:
        """An empty cache of at least ``capacity`` rows in the lowest free slot."""
        if not self.free:
            raise RuntimeError(f"the head's memory pool has no free slot (it has {self.keys[0].shape[0]})")
        self.reserve(capacity)
        return PooledSpeculatorCache(self, self.free.pop(0))

    def release(self, cache: PooledSpeculatorCache) -> None:
        """Give ``cache``'s slot back."""
        if cache.pool is not self or cache.slot in self.free:
            raise RuntimeError(f"slot {cache.slot} is not held in this pool")
        self.free.append(cache.slot)
        self.free.sort()

    def reserve(self, length: int) -> None:
        """At least ``length`` rows in every slot (every row is kept: the pool does not know the slots' lengths)."""
        _grow((self.keys, self.values), length, kept=self.capacity)


class PooledSpeculatorCache(SpeculatorCache):
    """A request's memory in slot ``slot`` of a :class:`SpeculatorPool`: a :class:`SpeculatorCache` whose keys and
    values (batch 1) are views of that slot, so a request alone reads and writes it as it would its own."""

    def __init__(self, pool: SpeculatorPool, slot: int):
        self.pool, self.slot, self.length = pool, slot, 0

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer, ``(1, Hk, C, Dh)``: a view of the slot."""
        return [k[self.slot : self.slot + 1] for k in self.pool.keys]

    @property
    def values(self) -> list[torch.Tensor]:
        """Per layer, ``(1, Hk, C, Dh)``: a view of the slot."""
        return [v[self.slot : self.slot + 1] for v in self.pool.values]

    def reserve(self, length: int) -> None:
        """At least ``length`` rows in every slot of the pool."""
        self.pool.reserve(length)


def one_pool(caches: Sequence[SpeculatorCache]) -> tuple[SpeculatorPool, list[PooledSpeculatorCache]] | None:
    """The pool every cache of ``caches`` is a slot of, with the caches as its slots; None if they are not all slots
    of one pool."""
    first = caches[0]
    if not isinstance(first, PooledSpeculatorCache):
        return None
    slots = [cache for cache in caches if isinstance(cache, PooledSpeculatorCache) and cache.pool is first.pool]
    return (first.pool, slots) if len(slots) == len(caches) else None


def _buffers(
    config: SpeculatorConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed keys and values, one ``(batch, Hk, capacity, Dh)`` buffer per layer of each."""
    shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
    keys, values = (
        [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)] for _ in range(2)
    )
    return keys, values


def _grow(stores: tuple[list[torch.Tensor], ...], length: int, kept: int) -> None:
    """Replace every buffer of ``stores`` by one of at least ``length`` rows (and at least twice as many as before)
    holding its first ``kept`` rows; nothing when they already hold ``length``."""
    capacity = stores[0][0].shape[2]
    if length <= capacity:
        return
    new_capacity = max(length, 2 * capacity)
    for store in stores:
        for i, old in enumerate(store):
            new = old.new_zeros(*old.shape[:2], new_capacity, old.shape[3])
            new[:, :, :kept] = old[:, :, :kept]
            store[i] = new
