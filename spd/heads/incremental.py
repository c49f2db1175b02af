"""The head's incremental forward at inference (docs/method.md §3): rows enter its memory (the per-layer keys and
values of :mod:`spd.heads.memory`) as they reach max depth, and a query attends to the cached rows plus the trailing
rows of the tokens in flight, each at its current depth. :class:`spd.heads.speculator.Speculator` calls these with
itself; the whole-sequence forwards they agree with are its ``forward_train`` and ``forward_dense``.

Shape suffixes: B batch (query rows), D hidden, R trailing rows, M rows of many requests, K keys, S slots (pool
entries), L query rows of an entry, Hk kv heads, C rows, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ..target.sdpa import decode_kernels
from .config import SpeculatorConfig
from .layers import Rope, SpeculatorLayer
from .memory import CacheView, PooledSpeculatorCache, SpeculatorCache, SpeculatorPool, one_pool


class SpeculatorParts(Protocol):
    """What the memory is written and read with: the head's config, decoder layers and rotary embedding."""

    @property
    def config(self) -> SpeculatorConfig: ...

    @property
    def layers(self) -> Sequence[SpeculatorLayer]: ...

    @property
    def rope(self) -> Rope: ...


def append_memory(head: SpeculatorParts, cache: SpeculatorCache, mem_BRD: torch.Tensor) -> None:
    """Append rows that reached max_depth (positions cache.length ...) to the per-layer K/V cache."""
    b, r, _ = mem_BRD.shape
    pos_BR = torch.arange(cache.length, cache.length + r, device=mem_BRD.device).expand(b, r)
    cos, sin = head.rope(pos_BR, mem_BRD.dtype)
    cache.reserve(cache.length + r)
    for i, layer in enumerate(head.layers):
        k, v = layer.memory_kv(mem_BRD, head.config.max_depth, cos, sin)
        cache.keys[i][:, :, cache.length : cache.length + r] = k
        cache.values[i][:, :, cache.length : cache.length + r] = v
    cache.length += r


def append_memory_many(head: SpeculatorParts, caches: Sequence[SpeculatorCache], mems: list[torch.Tensor]) -> None:
    """:func:`append_memory` for many requests at once: ``mems[i]`` (``(P_i, D)``, at max depth) joins
    ``caches[i]``; the rows of every request go through each layer's key and value projections together."""
    sizes = [m.shape[0] for m in mems]
    dev, dtype = mems[0].device, mems[0].dtype
    positions = [position for c, p in zip(caches, sizes) for position in range(c.length, c.length + p)]
    pos_M = torch.tensor(positions, device=dev)
    cos, sin = head.rope(pos_M[:, None], dtype)
    mem_M1D = torch.cat(mems)[:, None]
    for cache, p in zip(caches, sizes):
        cache.reserve(cache.length + p)
    pooled = one_pool(caches)
    if pooled is not None:  # the slots of one pool: every row straight into its request's slot
        pool, slots = pooled
        slot_M = torch.tensor([cache.slot for cache, p in zip(slots, sizes) for _ in range(p)], device=dev)
    for i, layer in enumerate(head.layers):
        k, v = layer.memory_kv(mem_M1D, head.config.max_depth, cos, sin)  # (M, Hk, 1, Dh)
        if pooled is not None:
            pool.keys[i][slot_M, :, pos_M] = k[:, :, 0]
            pool.values[i][slot_M, :, pos_M] = v[:, :, 0]
            continue
        first = 0
        for cache, p in zip(caches, sizes):
            cache.keys[i][0, :, cache.length : cache.length + p] = k[first : first + p, :, 0].transpose(0, 1)
            cache.values[i][0, :, cache.length : cache.length + p] = v[first : first + p, :, 0].transpose(0, 1)
            first += p
    for cache, p in zip(caches, sizes):
        cache.length += p


def query(
    head: SpeculatorParts,
    cache: SpeculatorCache | CacheView,
    trailing: list[tuple[int, torch.Tensor]],
    query_BD: torch.Tensor,
) -> torch.Tensor:
    """Query-stream output (B, D) for the newest position, attending cached rows plus trailing rows.

    ``trailing`` lists the rows after the cached ones, oldest first, as ``(depth, g (B, D))``; the newest
    position (the query's own memory row) is the last of them, or the last cached row when every row
    is already at max depth (PPSD: the newest token has completed stage 1).
    """
    b = query_BD.shape[0]
    c = cache.length
    r = len(trailing)
    dev, dtype = query_BD.device, query_BD.dtype
    pos_BR = torch.arange(c, c + r, device=dev).expand(b, r)
    cos_r, sin_r = head.rope(pos_BR, dtype)
    cos_q, sin_q = head.rope(torch.full((b, 1), c + r - 1, device=dev), dtype)
    scale = head.config.head_dim**-0.5
    h_B1D = query_BD[:, None]
    with decode_kernels(dev):
        for i, layer in enumerate(head.layers):
            q = layer.query_heads(h_B1D, cos_q, sin_q)
            ks, vs = [cache.keys[i][:, :, :c]], [cache.values[i][:, :, :c]]
            for j, (depth, g_BD) in enumerate(trailing):
                k, v = layer.memory_kv(g_BD[:, None], depth, cos_r[:, j : j + 1], sin_r[:, j : j + 1])
                ks.append(k)
                vs.append(v)
            k_all = layer.expand_kv(torch.cat(ks, dim=2))
            v_all = layer.expand_kv(torch.cat(vs, dim=2))
            attn = F.scaled_dot_product_attention(q, k_all, v_all, scale=scale)
            h_B1D = layer.finish(h_B1D, attn)
    return h_B1D[:, 0]


def query_many(
    head: SpeculatorParts,
    caches: Sequence[SpeculatorCache],
    trailing: list[list[tuple[int, torch.Tensor]]],
    queries: list[torch.Tensor],
) -> torch.Tensor:
    """:func:`query` for many requests at once: request ``i`` has its own cache ``caches[i]``, trailing rows
    ``trailing[i]`` (``(depth, g (L_i, D))``, oldest first) and ``L_i`` query rows ``queries[i]`` (the bottom
    nodes of its tree). Returns every query row's output, ``(sum L_i, D)``, in request order.

    One call for the batch: the keys of every query row (its request's cached rows, then its trailing rows)
    are laid out in one padded tensor and attended under a length mask; the trailing rows of one depth are
    projected together. The result equals :func:`query` per request up to fp32 rounding (other shapes).
    When the caches are the slots of one :class:`~spd.heads.memory.SpeculatorPool` (a batched pipeline's
    requests) the keys are read where they lie instead (:func:`_query_pool`).
    """
    pooled = one_pool(caches)
    if pooled is not None and len({cache.slot for cache in pooled[1]}) == len(caches):
        return _query_pool(head, *pooled, trailing, queries)
    cfg = head.config
    dev, dtype = queries[0].device, queries[0].dtype
    sizes = [q.shape[0] for q in queries]
    total, hk, dh = sum(sizes), cfg.num_key_value_heads, cfg.head_dim
    lengths = [cache.length + len(rows) for cache, rows in zip(caches, trailing)]
    row_request_B = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    length_B = torch.tensor(lengths)[row_request_B]
    width = max(lengths)
    mask_B11K = (torch.arange(width)[None] < length_B[:, None]).to(dev)[:, None, None]
    cos_q, sin_q = head.rope((length_B - 1)[:, None].to(dev), dtype)
    groups = _trailing_groups(head, caches, trailing, sizes, dev, dtype)
    cached = _cached_layout(caches, row_request_B, dev)
    scale = cfg.head_dim**-0.5
    h_B1D = torch.cat(queries)[:, None]
    # One padded K/V for every layer: each layer writes the same slots, so the padding stays zero.
    k_BHKD = h_B1D.new_zeros(total, hk, width, dh)
    v_BHKD = h_B1D.new_zeros(total, hk, width, dh)
    with decode_kernels(dev):
        for i, layer in enumerate(head.layers):
            q = layer.query_heads(h_B1D, cos_q, sin_q)
            _copy_cached(k_BHKD, [cache.keys[i] for cache in caches], caches, *cached)
            _copy_cached(v_BHKD, [cache.values[i] for cache in caches], caches, *cached)
            for depth, g_M1D, rows_M, slot_M, (cos, sin) in groups:
                k, v = layer.memory_kv(g_M1D, depth, cos, sin)
                k_BHKD[rows_M, :, slot_M] = k[:, :, 0]
                v_BHKD[rows_M, :, slot_M] = v[:, :, 0]
            attn = F.scaled_dot_product_attention(
                q, layer.expand_kv(k_BHKD), layer.expand_kv(v_BHKD), attn_mask=mask_B11K, scale=scale
            )
            h_B1D = layer.finish(h_B1D, attn)
    return h_B1D[:, 0]


def _cached_layout(
    caches: Sequence[SpeculatorCache], row_request_B: torch.Tensor, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Where :func:`query_many`'s cached rows go: every query row gets its request's cached keys and values in its
    first slots (``(cached_rows, cached_slots)``, one entry per row copied). Each layer lays every request's cached
    rows out one request after another; ``pick`` repeats a request's for each of its query rows (None: every request
    has one query row)."""
    total = row_request_B.shape[0]
    cached_C = torch.tensor([cache.length for cache in caches])
    per_row_B = cached_C[row_request_B]
    cached_rows = torch.repeat_interleave(torch.arange(total), per_row_B).to(dev)
    starts_B = torch.cumsum(per_row_B, 0) - per_row_B
    slots_M = torch.arange(int(per_row_B.sum())) - torch.repeat_interleave(starts_B, per_row_B)
    cached_slots, pick = slots_M.to(dev), None
    if total > len(caches):
        request_starts = torch.cumsum(cached_C, 0) - cached_C
        pick = (torch.repeat_interleave(request_starts[row_request_B], per_row_B) + slots_M).to(dev)
    return cached_rows, cached_slots, pick


def _copy_cached(
    buffer_BHKD: torch.Tensor,
    held: list[torch.Tensor],
    caches: Sequence[SpeculatorCache],
    cached_rows: torch.Tensor,
    cached_slots: torch.Tensor,
    pick: torch.Tensor | None,
) -> None:
    """One layer's cached keys (or values) ``held`` of every request into the query rows' first slots of
    ``buffer_BHKD`` (:func:`_cached_layout`)."""
    cached_MHD = torch.cat([kv[0, :, : cache.length] for kv, cache in zip(held, caches)], dim=1).transpose(0, 1)
    buffer_BHKD[cached_rows, :, cached_slots] = cached_MHD if pick is None else cached_MHD[pick]


def _trailing_groups(
    head: SpeculatorParts,
    caches: Sequence[SpeculatorCache],
    trailing: list[list[tuple[int, torch.Tensor]]],
    sizes: list[int],
    dev: torch.device,
    dtype: torch.dtype,
) -> list[tuple]:
    """:func:`query_many`'s trailing rows by depth: per group ``(depth, features (M, 1, D), query row (M,), key
    slot (M,), rope (cos, sin))``. Without per-depth memory projections a row's key and value do not depend on
    its depth: every trailing row is one group."""
    cfg = head.config
    by_depth: dict[int, tuple[list, list, list]] = {}
    first = 0
    for cache, rows, size in zip(caches, trailing, sizes):
        rows_B = torch.arange(first, first + size)
        for j, (depth, g_LD) in enumerate(rows):
            gs, bs, slots = by_depth.setdefault(depth if cfg.memory_proj else cfg.max_depth, ([], [], []))
            gs.append(g_LD)
            bs.append(rows_B)
            slots.append(torch.full((size,), cache.length + j))
        first += size
    groups = []
    for depth, (gs, bs, slots) in by_depth.items():
        slot_M = torch.cat(slots)
        rope = head.rope(slot_M[:, None].to(dev), dtype)
        groups.append((depth, torch.cat(gs)[:, None], torch.cat(bs).to(dev), slot_M.to(dev), rope))
    return groups


def _query_pool(
    head: SpeculatorParts,
    pool: SpeculatorPool,
    caches: list[PooledSpeculatorCache],
    trailing: list[list[tuple[int, torch.Tensor]]],
    queries: list[torch.Tensor],
) -> torch.Tensor:
    """:func:`query_many` over the slots of one pool, with nothing gathered: one attention call over the pool's
    buffer, a batch entry per slot. Request ``b`` (slot ``s``, ``c`` cached rows, ``r`` trailing rows, ``L``
    query rows) writes the trailing rows of its query row ``l`` into the scratch rows ``c + l r .. c + (l + 1) r``
    of its slot (at positions ``c .. c + r - 1`` all the same), and its query rows are the entry's queries
    ``0 .. L - 1``; each sees its cached rows and its own trailing rows (a mask). Entries of slots that ask nothing
    and query rows past ``L`` are padding (their outputs are dropped)."""
    dev, dtype = queries[0].device, queries[0].dtype
    sizes = [q.shape[0] for q in queries]
    slots = [cache.slot for cache in caches]
    spans = [cache.length + size * len(rows) for cache, rows, size in zip(caches, trailing, sizes)]
    entries, rows_per_entry, width = max(slots) + 1, max(sizes), max(spans)
    pool.reserve(width)
    counts, groups = _pool_rows(head, caches, trailing, sizes, entries, dev, dtype)
    cached_S1, trailing_S1, asked_S1 = (torch.tensor(x, device=dev)[:, None] for x in counts)
    mask_S1LK = _pool_mask(cached_S1, trailing_S1, asked_S1, rows_per_entry, width)
    cos_q, sin_q = head.rope((cached_S1 + trailing_S1 - 1).expand(entries, rows_per_entry), dtype)
    entry_B = torch.tensor([slot for slot, size in zip(slots, sizes) for _ in range(size)], device=dev)
    row_B = torch.tensor([row for size in sizes for row in range(size)], device=dev)
    h_SLD = queries[0].new_zeros(entries, rows_per_entry, queries[0].shape[-1])
    h_SLD[entry_B, row_B] = torch.cat(queries)
    scale = head.config.head_dim**-0.5
    with decode_kernels(dev):
        for i, layer in enumerate(head.layers):
            keys_SHkCDh, values_SHkCDh = pool.keys[i], pool.values[i]
            for depth, g_M1D, slot_M, row_M, (cos, sin) in groups:
                k, v = layer.memory_kv(g_M1D, depth, cos, sin)
                keys_SHkCDh[slot_M, :, row_M] = k[:, :, 0]
                values_SHkCDh[slot_M, :, row_M] = v[:, :, 0]
            q = layer.query_heads(h_SLD, cos_q, sin_q)
            attn = F.scaled_dot_product_attention(
                q,
                keys_SHkCDh[:entries, :, :width],
                values_SHkCDh[:entries, :, :width],
                attn_mask=mask_S1LK,
                scale=scale,
                enable_gqa=layer.n_heads != layer.n_kv_heads,
            )
            h_SLD = layer.finish(h_SLD, attn)
    return h_SLD[entry_B, row_B]


def _pool_rows(
    head: SpeculatorParts,
    caches: list[PooledSpeculatorCache],
    trailing: list[list[tuple[int, torch.Tensor]]],
    sizes: list[int],
    entries: int,
    dev: torch.device,
    dtype: torch.dtype,
) -> tuple[tuple[list[int], list[int], list[int]], list[tuple]]:
    """:func:`_query_pool`'s rows: per entry its cached rows, trailing rows per query row and query rows (0 for
    entries that ask nothing); and the trailing rows by depth (one group without per-depth projections), per group
    ``(depth, features (M, 1, D), slot (M,), scratch row (M,), rope (cos, sin))``."""
    cfg = head.config
    memory_proj, max_depth = cfg.memory_proj, cfg.max_depth  # (a config's attributes are slow to read)
    cached_S, trailing_S, asked_S = ([0] * entries for _ in range(3))
    by_depth: dict[int, tuple[list, list, list, list]] = {}
    for cache, rows, size in zip(caches, trailing, sizes):
        c, r, slot = cache.length, len(rows), cache.slot
        cached_S[slot], trailing_S[slot], asked_S[slot] = c, r, size
        for j, (depth, g_LD) in enumerate(rows):
            gs, slot_M, row_M, pos_M = by_depth.setdefault(depth if memory_proj else max_depth, ([], [], [], []))
            gs.append(g_LD)
            slot_M.extend([slot] * size)
            row_M.extend(range(c + j, c + j + size * r, r))
            pos_M.extend([c + j] * size)
    groups = []
    for depth, (gs, slot_M, row_M, pos_M) in by_depth.items():
        groups.append(
            (
                depth,
                torch.cat(gs)[:, None],
                torch.tensor(slot_M, device=dev),
                torch.tensor(row_M, device=dev),
                head.rope(torch.tensor(pos_M, device=dev)[:, None], dtype),
            )
        )
    return (cached_S, trailing_S, asked_S), groups


def _pool_mask(
    cached_S1: torch.Tensor, trailing_S1: torch.Tensor, asked_S1: torch.Tensor, rows_per_entry: int, width: int
) -> torch.Tensor:
    """:func:`_query_pool`'s mask ``(S, 1, L, K)``: a query row sees its entry's cached rows and its own trailing rows,
    a padding row key 0 alone."""
    dev = cached_S1.device
    query_L = torch.arange(rows_per_entry, device=dev)
    key_K = torch.arange(width, device=dev)
    own_SL = cached_S1 + query_L[None] * trailing_S1  # each query row's first trailing row
    mask_SLK = (key_K < cached_S1[:, :, None]) | (
        (key_K >= own_SL[:, :, None]) & (key_K < (own_SL + trailing_S1)[:, :, None])
    )
    real_SL = query_L[None] < asked_S1
    return torch.where(real_SL[:, :, None], mask_SLK, key_K == 0)[:, None]  # padding sees row 0 alone
