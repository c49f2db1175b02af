"""One stage call over the new tokens of many requests: a ragged batch (docs/method.md §9).

Each request contributes a *segment*: its new tokens at this stage (a chain's token, a tree level, or a chunk of a
prompt) with their position ids and, for tree nodes, their ancestor mask. The segments are packed into one
sequence, so every matrix product of the stage (projections, MLP) runs once for all of them; the attention reads
the keys of every request from the shared :class:`~spd.target.kv_pool.KVPool` buffer in one call, under a mask
that lets each token see exactly what it would see in its own request's stage call: its request's rows (the
committed prefix, and of the tree only its ancestors, or causally the chunk's earlier tokens), never another
request's. New keys and values are written straight into each request's region. On a hybrid target a
linear-attention layer reads and writes each request's own state: the segments whose tokens are one-token sequences
(a chain's next token, one tree depth) as one batch over their stacked states, the others (a prompt chunk, a first
token, a level of several depths) each on its own (:func:`_linear_layer`).

Shape suffixes: S packed tokens (every segment's), T one segment's tokens, N a segment's tree nodes, W the pool
rows the batch spans, D hidden size, Hk KV heads, Dh head dimension.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from ..errors import SpdInputError
from .kv_pool import KVPool
from .linear_state import StackedStates
from .sdpa import decode_kernels
from .staging import (LINEAR_LAYER_TYPE, StageKVCache, StageOutput, _backend_mask, attention_mask, cache_keyword,
                      node_groups, run_linear_layer, tree_attention_mask)


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


class _PooledWrite:
    """The cache a layer sees in a ragged call: ``update`` writes the packed keys/values into each request's rows of
    the pool and returns the rows the batch spans."""

    def __init__(self, pool: KVPool, stage: int, rows_S: torch.Tensor, lo: int, hi: int):
        self.keys_LBHkCDh, self.values_LBHkCDh = pool.keys_LBHkCDh[stage], pool.values_LBHkCDh[stage]
        self.slot = {layer: i for i, layer in enumerate(pool.layer_ids[stage])}
        self.rows_S, self.lo, self.hi = rows_S, lo, hi

    def update(self, key_BHkSDh: torch.Tensor, value_BHkSDh: torch.Tensor, layer_idx: int, *args, **kwargs):
        i = self.slot[layer_idx]
        self.keys_LBHkCDh[i, 0].index_copy_(1, self.rows_S, key_BHkSDh[0])
        self.values_LBHkCDh[i, 0].index_copy_(1, self.rows_S, value_BHkSDh[0])
        return (self.keys_LBHkCDh[i, :, :, self.lo:self.hi], self.values_LBHkCDh[i, :, :, self.lo:self.hi])

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


class _Blocks:
    """Where each segment's queries and keys sit in a ragged call: ``q_BT`` (each segment's rows of the packed tokens)
    and ``k_BK`` (its request's rows of the window of pool rows the call spans), padded, with their validity masks.
    The attention of several segments runs on these blocks (:func:`_block_attention`), not on every query against
    every request's keys: the keys a query may see are its own request's, so the rest would be masked work."""

    def __init__(self, segments: list[Segment], lo: int, device: torch.device):
        q_sizes = [seg.size for seg in segments]
        k_sizes = [seg.cache.length + seg.size for seg in segments]
        t, k = max(q_sizes), max(k_sizes)
        starts = torch.tensor([0] + q_sizes[:-1]).cumsum(0)
        bases = torch.tensor([seg.cache.base - lo for seg in segments])
        self.q_valid_BT = torch.arange(t)[None] < torch.tensor(q_sizes)[:, None]
        self.k_valid_BK = torch.arange(k)[None] < torch.tensor(k_sizes)[:, None]
        self.q_BT = torch.where(self.q_valid_BT, starts[:, None] + torch.arange(t)[None], 0).to(device)
        self.k_BK = torch.where(self.k_valid_BK, bases[:, None] + torch.arange(k)[None], 0).to(device)
        self.q_valid_BT, self.k_valid_BK = self.q_valid_BT.to(device), self.k_valid_BK.to(device)
        self.q_rows = self.q_BT[self.q_valid_BT]  # the packed rows in block order (= the packed order)


_BLOCKS: contextvars.ContextVar[_Blocks | None] = contextvars.ContextVar("spd_ragged_blocks", default=None)
_BLOCK_ATTENTION = "spd_ragged_blocks"


def _block_attention(module, query_1HSD: torch.Tensor, key_1HWD: torch.Tensor, value_1HWD: torch.Tensor,
                     attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention of a ragged call of several segments, block by block: each segment's queries against its own
    request's keys (gathered from the window into one padded batch), under the call's mask restricted to those
    blocks. Equal to the dense masked attention over the whole window up to fp32 rounding."""
    blocks = _BLOCKS.get()
    if blocks is None:  # not inside a ragged call of several segments
        return sdpa_attention_forward(module, query_1HSD, key_1HWD, value_1HWD, attention_mask, dropout, scaling,
                                      **kwargs)
    q_BHTD = query_1HSD[0][:, blocks.q_BT].transpose(0, 1)
    groups = getattr(module, "num_key_value_groups", 1)
    k_BHKD = repeat_kv(key_1HWD[0][:, blocks.k_BK].transpose(0, 1), groups)
    v_BHKD = repeat_kv(value_1HWD[0][:, blocks.k_BK].transpose(0, 1), groups)
    mask_BTK = attention_mask[0, 0][blocks.q_BT[:, :, None], blocks.k_BK[:, None, :]]
    visible_BTK = blocks.k_valid_BK[:, None, :] & blocks.q_valid_BT[:, :, None]
    visible_BTK[:, :, 0] |= ~blocks.q_valid_BT  # a padding query sees one key (a fully masked row is NaN), dropped
    if mask_BTK.dtype == torch.bool:
        mask_BTK = mask_BTK & visible_BTK
    else:
        mask_BTK = torch.where(visible_BTK, mask_BTK, torch.finfo(mask_BTK.dtype).min)
    out_BHTD = torch.nn.functional.scaled_dot_product_attention(q_BHTD, k_BHKD, v_BHKD, attn_mask=mask_BTK[:, None],
                                                                scale=scaling)
    out_SHD = out_BHTD.transpose(1, 2)[blocks.q_valid_BT]  # (S, H, Dh), packed order
    return out_SHD[None].contiguous(), None


AttentionInterface.register(_BLOCK_ATTENTION, _block_attention)


@contextlib.contextmanager
def _by_blocks(staged, stage: int, blocks: _Blocks | None):
    """Within: the stage's attention layers run :func:`_block_attention` over ``blocks`` (None: unchanged)."""
    if blocks is None:
        yield
        return
    configs = {id(m.config): m.config for layer in staged.stage_layers(stage)
               for m in staged.layers[layer].modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "config")}
    saved = {key: config._attn_implementation for key, config in configs.items()}
    token = _BLOCKS.set(blocks)
    try:
        for config in configs.values():
            config._attn_implementation = _BLOCK_ATTENTION
        yield
    finally:
        _BLOCKS.reset(token)
        for key, config in configs.items():
            config._attn_implementation = saved[key]


def _mask(segments: list[Segment], allowed_SW: torch.Tensor, q_pos_S: torch.Tensor, key_pos_W: torch.Tensor,
          window: int | None, impl: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The attention mask of one window size. A lone segment gets the mask its own stage call would get (None where
    the backend's default is exact), so that a batch of one computes bit for bit what the single-request engine
    does; its keys are exactly its request's rows then."""
    if len(segments) == 1:
        seg = segments[0]
        if seg.tree_mask_TN is not None:
            return tree_attention_mask(q_pos_S, key_pos_W, seg.tree_mask_TN.to(q_pos_S.device), window, impl, dtype)
        return attention_mask(q_pos_S, key_pos_W.shape[0], window, impl, dtype, contiguous=seg.positions_T is None)
    return _backend_mask(allowed_SW, q_pos_S, key_pos_W, window, impl, dtype)


def run_ragged(pool: KVPool, stage: int, segments: list[Segment]) -> list[StageOutput]:
    """Run ``stage`` once over every segment (each cache a region of ``pool``); one output per segment, as
    :meth:`spd.target.staging.StagedModel.run_stage` would give for it alone."""
    staged = pool.staged
    first, last = staged.boundaries[stage], staged.boundaries[stage + 1]
    device = pool.positions_C[stage].device  # (a stage rank's model has no LM head to tell it)
    rows, positions, blocks = [], [], []
    for seg in segments:
        cache, t = seg.cache, seg.size
        if cache.base is None:
            raise RuntimeError("run_ragged needs caches from a KVPool")
        start, kv_len = cache.length, cache.length + seg.size
        if kv_len > cache.capacity:
            raise RuntimeError(f"a pooled KV cache of {cache.capacity} rows cannot hold {kv_len}")
        pos_T = torch.arange(start, kv_len, device=device) if seg.positions_T is None else seg.positions_T.to(device)
        cache.positions_C[start:kv_len] = pos_T
        if seg.tree_mask_TN is None:
            allowed_TK = torch.arange(kv_len, device=device)[None, :] <= torch.arange(start, kv_len, device=device)[:, None]
        else:
            tree_TN = seg.tree_mask_TN.to(device)
            if tree_TN.dtype != torch.bool or tree_TN.shape[0] != t or not t <= tree_TN.shape[1] <= kv_len:
                raise SpdInputError(f"run_ragged: a tree mask must be a bool (T, N) tensor with T = {t} and "
                                    f"{t} <= N <= {kv_len}, got {tree_TN.dtype} {tuple(tree_TN.shape)}")
            allowed_TK = torch.cat([torch.ones(t, kv_len - tree_TN.shape[1], dtype=torch.bool, device=device),
                                    tree_TN], dim=1)
        rows.append(cache.base + torch.arange(start, kv_len, device=device))
        positions.append(pos_T)
        blocks.append(allowed_TK)
    lo = min(seg.cache.base for seg in segments)
    hi = max(seg.cache.base + seg.cache.length + seg.size for seg in segments)
    rows_S, q_pos_S = torch.cat(rows), torch.cat(positions)
    allowed_SW = torch.zeros(rows_S.shape[0], hi - lo, dtype=torch.bool, device=device)
    offset = 0
    for seg, allowed_TK in zip(segments, blocks):
        column = seg.cache.base - lo
        allowed_SW[offset:offset + seg.size, column:column + allowed_TK.shape[1]] = allowed_TK
        offset += seg.size

    hidden_1SD = torch.cat([seg.hidden_1TD for seg in segments], dim=1)
    position_ids_1S = q_pos_S[None]
    position_embeddings = staged.rope(hidden_1SD, position_ids_1S)
    key_pos_W = pool.positions_C[stage][lo:hi]
    cache = _PooledWrite(pool, stage, rows_S, lo, hi)
    wanted = {a for seg in segments for a in seg.anchors}
    collected = {first: hidden_1SD} if first in wanted else {}
    masks: dict[int | None, torch.Tensor] = {}
    # Linear-attention layers (hybrid targets): each segment's tokens from its own request's state.
    groups = [node_groups(seg.tree_mask_TN) if seg.tree_mask_TN is not None and seg.cache.linear is not None
              else None for seg in segments]
    for seg, nodes in zip(segments, groups):
        seg.cache.begin(seg.size, first_node=None if nodes is None else nodes[0][0])
    blocks = _Blocks(segments, lo, device) if len(segments) > 1 else None  # a lone segment: its own stage call
    with decode_kernels(device), _by_blocks(staged, stage, blocks):
        for layer in range(first, last):
            if staged.layer_types[layer] == LINEAR_LAYER_TYPE:
                hidden_1SD = _linear_layer(staged.layers[layer], hidden_1SD, segments, groups, position_ids_1S,
                                           position_embeddings)
                if layer + 1 in wanted:
                    collected[layer + 1] = hidden_1SD
                continue
            window = staged.windows[layer]
            if window not in masks:
                masks[window] = _mask(segments, allowed_SW, q_pos_S, key_pos_W, window, staged.attn_impl,
                                      hidden_1SD.dtype)
            hidden_1SD = staged.layers[layer](hidden_1SD, attention_mask=masks[window],
                                              position_ids=position_ids_1S, use_cache=True,
                                              position_embeddings=position_embeddings,
                                              **{cache_keyword(staged.layers[layer]): cache})
            if layer + 1 in wanted:
                collected[layer + 1] = hidden_1SD

    outputs, offset = [], 0
    for seg in segments:
        end = offset + seg.size
        outputs.append(StageOutput(hidden_1SD[:, offset:end], {a: collected[a][:, offset:end] for a in seg.anchors}))
        offset = end
    for seg, nodes in zip(segments, groups):
        seg.cache.advance(seg.size, tree=nodes is not None)
    return outputs


def _linear_layer(layer, hidden_1SD: torch.Tensor, segments: list[Segment], groups: list, position_ids_1S: torch.Tensor,
                  position_embeddings) -> torch.Tensor:
    """A linear-attention layer over the packed tokens, each segment from its own request's state. The segments whose
    tokens are one-token sequences (a chain's next token, the nodes of one tree depth) run as one batch over their
    stacked states (:class:`~spd.target.linear_state.StackedStates`); a prompt chunk, a first token or a tree level
    of several depths runs on its own, as its request's stage call would run it. A lone segment is exactly that
    stage call."""
    if len(segments) == 1:
        return run_linear_layer(layer, hidden_1SD, segments[0].cache, groups[0], position_ids_1S, position_embeddings)
    out_1SD = torch.empty_like(hidden_1SD)
    stacked, counts, rows, offset = [], [], [], 0
    for seg, nodes in zip(segments, groups):
        end = offset + seg.size
        one_token_each = (nodes is None and seg.size == 1 and seg.cache.linear.length > 0) or \
            (nodes is not None and len(nodes) == 1)
        if one_token_each:
            if nodes is not None:
                seg.cache.linear.select_nodes(*nodes[0])
            stacked.append(seg.cache)
            counts.append(seg.size)
            rows.append(torch.arange(offset, end, device=hidden_1SD.device))
        else:
            cos, sin = position_embeddings
            out_1SD[:, offset:end] = run_linear_layer(layer, hidden_1SD[:, offset:end], seg.cache, nodes,
                                                      position_ids_1S[:, offset:end],
                                                      (cos[:, offset:end], sin[:, offset:end]))
        offset = end
    if stacked:
        rows_B = torch.cat(rows)
        tokens_B1D = hidden_1SD[0, rows_B, None]
        out_1SD[0, rows_B] = layer(tokens_B1D, attention_mask=None, use_cache=True,
                                   position_embeddings=position_embeddings,
                                   **{cache_keyword(layer): StackedStates(stacked, counts)})[:, 0]
    return out_1SD
