"""The segments of a ragged stage call (docs/method.md §9): what each request brings to it and where that sits.

A :class:`Segment` is one request's new tokens at one stage (a chain's token, a tree level, or a chunk of a prompt),
appended to its pooled cache; a ragged call packs every segment's tokens into one sequence, each taking its
request's next rows of the :class:`~spd.target.kv_pool.KVPool` at its own positions.

Shape suffixes: S packed tokens (every segment's), B segments, T one segment's tokens, N a segment's tree nodes,
D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..errors import SpdInputError
from .kv_cache import StageKVCache


@dataclass
class Segment:
    """A request's new tokens at one stage: ``hidden_1TD`` appended to ``cache`` (a pooled cache), at
    ``positions_T`` (None: the next positions, ``cache.length + i``); ``tree_mask_TN`` the ancestor mask over the last
    N rows after appending (None: causal among the new tokens); ``anchors`` the ``H^l`` to return."""

    cache: StageKVCache
    hidden_1TD: torch.Tensor
    positions_T: torch.Tensor | None = None
    tree_mask_TN: torch.Tensor | None = None
    anchors: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.hidden_1TD.shape[1]


class Packed(NamedTuple):
    """Where each segment of a ragged call sits: its first packed token, the rows its request held before the call,
    and its request's first row in the pool (``(B,)`` each)."""

    starts_B: torch.Tensor
    lengths_B: torch.Tensor
    bases_B: torch.Tensor


def checked_size(seg: Segment) -> int:
    """The segment's token count, once its pooled cache can take them and its tree mask fits."""
    cache, t = seg.cache, seg.size
    if cache.base is None:
        raise RuntimeError("run_ragged needs caches from a KVPool")
    kv_len = cache.length + t
    if kv_len > cache.capacity:
        raise RuntimeError(f"a pooled KV cache of {cache.capacity} rows cannot hold {kv_len}")
    tree_TN = seg.tree_mask_TN
    if tree_TN is not None and (
        tree_TN.dtype != torch.bool or tree_TN.shape[0] != t or not t <= tree_TN.shape[1] <= kv_len
    ):
        raise SpdInputError(
            f"run_ragged: a tree mask must be a bool (T, N) tensor with T = {t} and "
            f"{t} <= N <= {kv_len}, got {tree_TN.dtype} {tuple(tree_TN.shape)}"
        )
    return t


def pack(segments: list[Segment], sizes: list[int]) -> tuple[Packed, torch.Tensor, torch.Tensor]:
    """Where the segments sit in the packed tokens and the pool, and every packed token's position id and row of the
    pool, at once: a segment's tokens take its request's next rows, at the next positions unless it gives its own
    (tree nodes sit at committed length + depth)."""
    sizes_B = torch.tensor(sizes)
    packed = Packed(
        torch.cumsum(sizes_B, 0) - sizes_B,
        torch.tensor([seg.cache.length for seg in segments]),
        torch.tensor([seg.cache.base for seg in segments]),
    )
    starts_B, lengths_B, bases_B = packed
    offsets_S = torch.arange(int(sizes_B.sum())) - starts_B.repeat_interleave(sizes_B)
    q_pos_S = lengths_B.repeat_interleave(sizes_B) + offsets_S
    rows_S = (bases_B + lengths_B).repeat_interleave(sizes_B) + offsets_S
    for seg, start in zip(segments, starts_B.tolist()):
        if seg.positions_T is not None:
            q_pos_S[start : start + seg.size] = seg.positions_T
    return packed, q_pos_S, rows_S
