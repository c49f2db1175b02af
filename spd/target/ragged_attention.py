"""The attention of a ragged stage call (docs/method.md §9): each segment's queries against its own request's keys
only, read from the one :class:`~spd.target.kv_pool.KVPool` buffer that every request's rows share.

Two layouts compute it (:data:`spd.target.ragged.RAGGED_ATTENTION` picks one): :class:`Blocks` gathers each
request's rows into one padded batch per segment size (CUDA's), :class:`Spans` attends to each request's rows in
place, one call per segment (the CPU's). The stage's attention layers reach the layout through Hugging Face's
attention interface (:func:`_block_attention`, switched on by :func:`in_layout`). A lone segment needs no layout:
:func:`lone_mask` gives it the mask its own stage call would get.

Shape suffixes: S packed tokens (every segment's), W the pool rows the call reads, B segments, T one segment's
tokens, K one segment's keys, H / Hk query / KV heads, Dh head dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .masks import attention_mask, tree_attention_mask
from .segments import Packed, Segment
from .staging import StagedModel


class _Group:
    """Segments of one size ``T`` in a ragged call, as one batch: ``q_BT`` their rows of the packed tokens, ``k_BK``
    their requests' rows of the pool (padded to the longest), and which key each query
    may see (``allowed_BTK``: its request's committed rows, and of its own new tokens those before it or, in a tree,
    its ancestors)."""

    def __init__(
        self,
        t: int,
        indices: list[int],
        packed: Packed,
        trees: dict[int, torch.Tensor],
        q_pos_S: torch.Tensor,
        key_pos_W: torch.Tensor,
        device: torch.device,
    ):
        index_B = torch.tensor(indices)
        starts_B, lengths_B, bases_B = (x[index_B] for x in packed)
        k = int(lengths_B.max()) + t
        k_K, t_T = torch.arange(k), torch.arange(t)
        k_valid_BK = k_K[None] < (lengths_B + t)[:, None]
        self.q_BT = (starts_B[:, None] + t_T[None]).to(device)
        self.k_BK = torch.where(k_valid_BK, bases_B[:, None] + k_K[None], 0).to(device)
        # Causal: a query sees its request's committed rows and its segment's tokens up to itself (never the
        # padding past its request's rows); a tree level's rows are its own mask, set below.
        allowed_BTK = k_K[None, None, :] <= (lengths_B[:, None] + t_T[None])[:, :, None]
        for b, i in enumerate(indices):
            if i in trees:
                allowed_BTK[b, :, : trees[i].shape[1]] = trees[i]
        self.allowed_BTK = allowed_BTK.to(device)
        self.q_pos_BT, self.key_pos_BK = q_pos_S[self.q_BT], key_pos_W[self.k_BK]

    def mask(self, window: int | None) -> torch.Tensor:
        """The ``(B, 1, T, K)`` boolean mask with a sliding window (None: full attention)."""
        allowed_BTK = self.allowed_BTK
        if window is not None:
            allowed_BTK = allowed_BTK & (self.q_pos_BT[:, :, None] - self.key_pos_BK[:, None, :] < window)
        return allowed_BTK[:, None]


class Blocks:
    """The attention of a ragged call of several segments as one batch per segment size (CUDA's layout): each group
    (:class:`_Group`: a chain's tokens in one group, a tree's levels of one width in another, each prompt chunk
    with those of its length) gathers its requests' rows from the window into one padded batch, so that no query
    is padding (one prompt chunk of 64 tokens would otherwise pad every other segment's single query to 64) and no
    query attends to another request's rows. One attention call per group."""

    def __init__(
        self,
        segments: list[Segment],
        packed: Packed,
        q_pos_S: torch.Tensor,
        key_pos_W: torch.Tensor,
        device: torch.device,
    ):
        trees = {
            i: torch.cat(
                [
                    torch.ones(seg.size, seg.cache.length + seg.size - seg.tree_mask_TN.shape[1], dtype=torch.bool),
                    seg.tree_mask_TN.to("cpu"),
                ],
                dim=1,
            )
            for i, seg in enumerate(segments)
            if seg.tree_mask_TN is not None
        }  # committed rows, then the tree
        by_size: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            by_size.setdefault(seg.size, []).append(i)
        self.groups = [_Group(t, indices, packed, trees, q_pos_S, key_pos_W, device) for t, indices in by_size.items()]
        self.masks: dict[int | None, list[torch.Tensor]] = {}
        self.window: int | None = None

    def use_window(self, window: int | None) -> None:
        """The next layers attend with this sliding window (None: full attention)."""
        if window not in self.masks:
            self.masks[window] = [group.mask(window) for group in self.groups]
        self.window = window

    def attention(
        self,
        module,
        query_1HSD: torch.Tensor,
        key_1HWD: torch.Tensor,
        value_1HWD: torch.Tensor,
        dropout: float,
        scaling: float | None,
        **kwargs,
    ) -> torch.Tensor:
        """``(1, S, H, Dh)``: each group's queries against their requests' keys, gathered, under the group's mask."""
        h, hk, dh, dv = query_1HSD.shape[1], key_1HWD.shape[1], query_1HSD.shape[3], value_1HWD.shape[3]
        outs = []
        for group, mask_B1TK in zip(self.groups, self.masks[self.window]):
            (b, t), k = group.q_BT.shape, group.k_BK.shape[1]
            q_BHTD = query_1HSD[0].index_select(1, group.q_BT.flatten()).view(h, b, t, dh).transpose(0, 1)
            k_BHKD = key_1HWD[0].index_select(1, group.k_BK.flatten()).view(hk, b, k, dh).transpose(0, 1)
            v_BHKD = value_1HWD[0].index_select(1, group.k_BK.flatten()).view(hk, b, k, dv).transpose(0, 1)
            out_BHTD = torch.nn.functional.scaled_dot_product_attention(
                q_BHTD, k_BHKD, v_BHKD, attn_mask=mask_B1TK, scale=scaling, enable_gqa=h != hk
            )
            outs.append(out_BHTD.transpose(1, 2).reshape(b * t, h, dv))  # in the order of the group's q_BT
        if len(self.groups) == 1:  # one group: its rows are the packed tokens, in order
            return outs[0][None]
        out_SHD = query_1HSD.new_empty(query_1HSD.shape[2], h, dv)
        for group, out in zip(self.groups, outs):
            out_SHD[group.q_BT.flatten()] = out  # (S, H, Dh), in the packed order
        return out_SHD[None]


class Spans:
    """The attention of a ragged call of several segments in place (the CPU's layout): each segment's queries attend
    to its own request's rows as a view of the window, with the mask its own stage call would use
    (:func:`lone_mask`, in SDPA's form), one attention call per segment. Nothing is gathered: on CPU, copying every
    request's rows into a padded batch at every layer cost more than the attention itself (docs/benchmarks.md)."""

    def __init__(
        self,
        segments: list[Segment],
        packed: Packed,
        lo: int,
        q_pos_S: torch.Tensor,
        key_pos_W: torch.Tensor,
        dtype: torch.dtype,
    ):
        self.segments, self.q_pos_S, self.key_pos_W, self.dtype = segments, q_pos_S, key_pos_W, dtype
        # per segment: its first query row, its number of tokens, its first key row in the window, its key rows
        self.spans = [
            (start, seg.size, base - lo, length + seg.size)
            for seg, start, length, base in zip(segments, *(x.tolist() for x in packed))
        ]
        self.masks: dict[int | None, list[torch.Tensor | None]] = {}
        self.window: int | None = None

    def use_window(self, window: int | None) -> None:
        """The next layers attend with this sliding window (None: full attention)."""
        if window not in self.masks:
            self.masks[window] = [
                lone_mask(seg, self.q_pos_S[q : q + t], self.key_pos_W[k : k + kv], window, "sdpa", self.dtype)
                for seg, (q, t, k, kv) in zip(self.segments, self.spans)
            ]
        self.window = window

    def attention(
        self,
        module,
        query_1HSD: torch.Tensor,
        key_1HWD: torch.Tensor,
        value_1HWD: torch.Tensor,
        dropout: float,
        scaling: float | None,
        **kwargs,
    ) -> torch.Tensor:
        """``(1, S, H, Dh)``: each segment's own attention over its rows, in the packed order."""
        gqa = query_1HSD.shape[1] != key_1HWD.shape[1]
        attend = torch.nn.functional.scaled_dot_product_attention
        # (no mask: one query sees every row; a whole prompt's square block is causal, as in its own stage call)
        outs = [
            attend(
                query_1HSD[:, :, q : q + t],
                key_1HWD[:, :, k : k + kv],
                value_1HWD[:, :, k : k + kv],
                attn_mask=mask,
                is_causal=mask is None and t > 1,
                scale=scaling,
                enable_gqa=gqa,
            )
            for (q, t, k, kv), mask in zip(self.spans, self.masks[self.window])
        ]
        return torch.cat(outs, dim=2).transpose(1, 2)


_LAYOUT: contextvars.ContextVar[Blocks | Spans | None] = contextvars.ContextVar("spd_ragged_layout", default=None)
_BLOCK_ATTENTION = "spd_ragged_blocks"


def _block_attention(
    module,
    query_1HSD: torch.Tensor,
    key_1HWD: torch.Tensor,
    value_1HWD: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """The attention of a ragged call of several segments: each segment's queries against its own request's keys
    only, by the call's layout (:class:`Blocks` or :class:`Spans`, its window set for the layer that runs). Equal
    to a dense masked attention over the whole window up to fp32 rounding."""
    layout = _LAYOUT.get()
    if layout is None:  # not inside a ragged call of several segments
        return sdpa_attention_forward(
            module, query_1HSD, key_1HWD, value_1HWD, attention_mask, dropout, scaling, **kwargs
        )
    return layout.attention(module, query_1HSD, key_1HWD, value_1HWD, dropout, scaling, **kwargs), None


AttentionInterface.register(_BLOCK_ATTENTION, _block_attention)


_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stage_configs(staged, stage: int) -> dict[int, PretrainedConfig]:
    """The configs ``stage``'s layers dispatch their attention on (found once per model and stage)."""
    by_stage = _CONFIGS.setdefault(staged, {})
    if stage not in by_stage:
        by_stage[stage] = {
            id(m.config): m.config
            for layer in staged.stage_layers(stage)
            for m in staged.layers[layer].modules()
            if isinstance(getattr(m, "config", None), PretrainedConfig)
        }
    return by_stage[stage]


@contextlib.contextmanager
def in_layout(staged: StagedModel, stage: int, layout: Blocks | Spans | None) -> Iterator[None]:
    """Within: the stage's attention layers run :func:`_block_attention` by ``layout`` (None: unchanged)."""
    if layout is None:
        yield
        return
    configs = _stage_configs(staged, stage)
    saved = {key: config._attn_implementation for key, config in configs.items()}
    token = _LAYOUT.set(layout)
    try:
        for config in configs.values():
            config._attn_implementation = _BLOCK_ATTENTION
        yield
    finally:
        _LAYOUT.reset(token)
        for key, config in configs.items():
            config._attn_implementation = saved[key]


def lone_mask(
    seg: Segment, q_pos_S: torch.Tensor, key_pos_W: torch.Tensor, window: int | None, impl: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The attention mask of a lone segment: the one its own stage call would get (None where the backend's default
    is exact), so that a batch of one computes bit for bit what the single-request engine does; its keys are exactly
    its request's rows then."""
    if seg.tree_mask_TN is not None:
        return tree_attention_mask(q_pos_S, key_pos_W, seg.tree_mask_TN.to(q_pos_S.device), window, impl, dtype)
    return attention_mask(q_pos_S, key_pos_W.shape[0], window, impl, dtype, contiguous=seg.positions_T is None)
