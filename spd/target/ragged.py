"""One stage call over the new tokens of many requests: a ragged batch (docs/method.md §9).

Each request contributes a *segment* (:class:`~spd.target.segments.Segment`): its new tokens at this stage (a
chain's token, a tree level, or a chunk of a prompt) with their position ids and, for tree nodes, their ancestor
mask. The segments are packed into one sequence, so every matrix product of the stage (projections, MLP) runs once
for all of them; the attention reads the keys of every request from the shared :class:`~spd.target.kv_pool.KVPool`
buffer: each segment's queries against its own request's rows only (on CPU in place, one attention call per segment:
:class:`Spans`; on CUDA gathered into one padded batch per segment size: :class:`Blocks`), under a mask that lets
each token see exactly what it would see in its own request's stage call (the committed prefix, and of the tree only
its ancestors, or causally the chunk's earlier tokens). New keys and values are written straight into each request's
region. On a hybrid target a linear-attention layer reads and writes each request's own state: the segments whose
tokens are one-token sequences (a chain's next token, one tree depth) as one batch over their stacked states, the
others (a prompt chunk, a first token, a level of several depths) each on its own (:func:`_linear_layer`).

Shape suffixes: S packed tokens (every segment's), T one segment's tokens, N a segment's tree nodes, W the pool
rows the call reads, B segments, K one segment's keys, D hidden size, H / Hk query / KV heads, Dh head dimension.
"""

from __future__ import annotations

import torch

from .kv_pool import KVPool
from .linear_state import NoPastRecording, StackedStates
from .masks import node_groups
from .ragged_attention import Blocks, Spans, in_layout, lone_mask
from .sdpa import decode_kernels
from .segments import Packed, Segment, checked_size, pack
from .staging import LINEAR_LAYER_TYPE, StagedModel, StageOutput, cache_keyword, run_linear_layer


class _PooledWrite(NoPastRecording):
    """The cache a layer sees in a ragged call: ``update`` writes the packed keys/values into each request's rows of
    the pool and returns the rows the call reads: the whole buffer for several segments (their blocks gather their
    requests' rows from it), a lone segment's own rows."""

    def __init__(self, pool: KVPool, stage: int, rows_S: torch.Tensor, lo: int, hi: int):
        self.keys_LBHkCDh, self.values_LBHkCDh = pool.keys_LBHkCDh[stage], pool.values_LBHkCDh[stage]
        self.slot = {layer: i for i, layer in enumerate(pool.layer_ids[stage])}
        self.rows_S, self.lo, self.hi = rows_S, lo, hi

    def update(self, key_BHkSDh: torch.Tensor, value_BHkSDh: torch.Tensor, layer_idx: int, *args, **kwargs):
        i = self.slot[layer_idx]
        self.keys_LBHkCDh[i, 0].index_copy_(1, self.rows_S, key_BHkSDh[0])
        self.values_LBHkCDh[i, 0].index_copy_(1, self.rows_S, value_BHkSDh[0])
        return (self.keys_LBHkCDh[i, :, :, self.lo : self.hi], self.values_LBHkCDh[i, :, :, self.lo : self.hi])


#: How a ragged call of several segments runs its attention: "blocks" (:class:`Blocks`, gathered, one call per
#: segment size), "spans" (:class:`Spans`, in place, one call per segment), or "auto": spans on CPU, blocks on CUDA
#: (where one kernel per group beats a launch per segment).
RAGGED_ATTENTION = "auto"


def _ragged_layout(
    segments: list[Segment],
    packed: Packed,
    lo: int,
    q_pos_S: torch.Tensor,
    key_pos_W: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> Blocks | Spans:
    """The attention layout of a ragged call of several segments (:data:`RAGGED_ATTENTION`)."""
    if RAGGED_ATTENTION not in ("auto", "blocks", "spans"):
        raise ValueError(f"RAGGED_ATTENTION must be 'auto', 'blocks' or 'spans', not {RAGGED_ATTENTION!r}")
    if RAGGED_ATTENTION == "blocks" or (RAGGED_ATTENTION == "auto" and device.type == "cuda"):
        return Blocks(segments, packed, q_pos_S, key_pos_W, device)
    return Spans(segments, packed, lo, q_pos_S, key_pos_W, dtype)


def run_ragged(pool: KVPool, stage: int, segments: list[Segment]) -> list[StageOutput]:
    """Run ``stage`` once over every segment (each cache a region of ``pool``); one output per segment, as
    :meth:`spd.target.staging.StagedModel.run_stage` would give for it alone."""
    staged = pool.staged
    device = pool.positions_C[stage].device  # (a stage rank's model has no LM head to tell it)
    sizes = [checked_size(seg) for seg in segments]
    packed, q_pos_S, rows_S = pack(segments, sizes)
    rows_S, q_pos_S = rows_S.to(device), q_pos_S.to(device)
    pool.positions_C[stage].index_copy_(0, rows_S, q_pos_S)
    lo, hi = _key_rows(pool, segments)
    key_pos_W = pool.positions_C[stage][lo:hi]
    # Several segments: each attends to its own request's keys only (the layout); a lone one is its own stage call.
    layout = (
        _ragged_layout(segments, packed, lo, q_pos_S, key_pos_W, device, pool.keys_LBHkCDh[stage].dtype)
        if len(segments) > 1
        else None
    )

    hidden_1SD = torch.cat([seg.hidden_1TD for seg in segments], dim=1)
    cache = _PooledWrite(pool, stage, rows_S, lo, hi)
    # Linear-attention layers (hybrid targets): each segment's tokens from its own request's state.
    groups = [
        node_groups(seg.tree_mask_TN) if seg.tree_mask_TN is not None and seg.cache.linear is not None else None
        for seg in segments
    ]
    for seg, nodes in zip(segments, groups):
        seg.cache.begin(seg.size, first_node=None if nodes is None else nodes[0][0])
    with decode_kernels(device), in_layout(staged, stage, layout):
        hidden_1SD, collected = _run_layers(
            staged, stage, hidden_1SD, q_pos_S, key_pos_W, cache, segments, groups, layout
        )

    outputs = _split_outputs(segments, sizes, hidden_1SD, collected)
    for seg, nodes in zip(segments, groups):
        seg.cache.advance(seg.size, tree=nodes is not None)
    return outputs


def _key_rows(pool: KVPool, segments: list[Segment]) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of the pool whose keys the call's attention reads (its window ``W``)."""
    if len(segments) > 1:  # the whole buffer: every request's rows (and a contiguous tensor gathers ~2x faster)
        return 0, pool.rows
    lone = segments[0]  # a lone segment attends to its own rows, as its own stage call would
    return lone.cache.base, lone.cache.base + lone.cache.length + lone.size


def _run_layers(
    staged: StagedModel,
    stage: int,
    hidden_1SD: torch.Tensor,
    q_pos_S: torch.Tensor,
    key_pos_W: torch.Tensor,
    cache: _PooledWrite,
    segments: list[Segment],
    groups: list,
    layout: Blocks | Spans | None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The stage's decoder layers over the packed tokens: their output ``H^{b[s+1]}`` and ``{l: H^l}`` for every
    anchor a segment asks for. Attention layers read through ``layout`` (None: a lone segment, under the mask its own
    stage call would get), linear-attention layers each segment's own state (:func:`_linear_layer`)."""
    first, last = staged.boundaries[stage], staged.boundaries[stage + 1]
    position_ids_1S = q_pos_S[None]
    position_embeddings = staged.rope(hidden_1SD, position_ids_1S)
    wanted = {a for seg in segments for a in seg.anchors}
    collected = {first: hidden_1SD} if first in wanted else {}
    masks: dict[int | None, torch.Tensor | None] = {}  # a lone segment's, by window
    for layer in range(first, last):
        if staged.layer_types[layer] == LINEAR_LAYER_TYPE:
            hidden_1SD = _linear_layer(
                staged.layers[layer], hidden_1SD, segments, groups, position_ids_1S, position_embeddings
            )
            if layer + 1 in wanted:
                collected[layer + 1] = hidden_1SD
            continue
        window = staged.windows[layer]
        if layout is not None:
            layout.use_window(window)  # what this layer's attention reads
        elif window not in masks:
            masks[window] = lone_mask(segments[0], q_pos_S, key_pos_W, window, staged.attn_impl, hidden_1SD.dtype)
        hidden_1SD = staged.layers[layer](
            hidden_1SD,
            attention_mask=masks.get(window),
            position_ids=position_ids_1S,
            use_cache=True,
            position_embeddings=position_embeddings,
            **{cache_keyword(staged.layers[layer]): cache},
        )
        if layer + 1 in wanted:
            collected[layer + 1] = hidden_1SD
    return hidden_1SD, collected


def _split_outputs(
    segments: list[Segment], sizes: list[int], hidden_1SD: torch.Tensor, collected: dict[int, torch.Tensor]
) -> list[StageOutput]:
    """Each segment's share of the packed output and of the anchors it asked for."""
    pieces = {a: hidden.split(sizes, dim=1) for a, hidden in collected.items()}
    return [
        StageOutput(hidden_1TD, {a: pieces[a][i] for a in seg.anchors})
        for i, (seg, hidden_1TD) in enumerate(zip(segments, hidden_1SD.split(sizes, dim=1)))
    ]


def _linear_layer(
    layer,
    hidden_1SD: torch.Tensor,
    segments: list[Segment],
    groups: list,
    position_ids_1S: torch.Tensor,
    position_embeddings,
) -> torch.Tensor:
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
        one_token_each = (nodes is None and seg.size == 1 and seg.cache.linear.length > 0) or (
            nodes is not None and len(nodes) == 1
        )
        if one_token_each:
            if nodes is not None:
                seg.cache.linear.select_nodes(*nodes[0])
            stacked.append(seg.cache)
            counts.append(seg.size)
            rows.append(torch.arange(offset, end, device=hidden_1SD.device))
        else:
            cos, sin = position_embeddings
            out_1SD[:, offset:end] = run_linear_layer(
                layer,
                hidden_1SD[:, offset:end],
                seg.cache,
                nodes,
                position_ids_1S[:, offset:end],
                (cos[:, offset:end], sin[:, offset:end]),
            )
        offset = end
    if stacked:
        rows_B = torch.cat(rows)
        tokens_B1D = hidden_1SD[0, rows_B, None]
        out_1SD[0, rows_B] = layer(
            tokens_B1D,
            attention_mask=None,
            use_cache=True,
            position_embeddings=position_embeddings,
            **{cache_keyword(layer): StackedStates(stacked, counts)},
        )[:, 0]
    return out_1SD
