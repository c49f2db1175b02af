"""The speculation module: multi-depth feature fusion, memory-attention decoder layers, norm and LM head.

docs/method.md §2-3. Every position ``i`` contributes one *memory* row ``g^{d}_i = FC_d(concat(H^a_i for a in
anchors[d]))`` at the depth ``d`` it has at speculation time; only the query stream of the newest position
runs through the layers (its input is ``g^{offset}_t``), and each layer reads keys/values from the fixed
memory rows (its own input norm, optional per-depth projection, k/v projections, RoPE at the row's
position). The LM head reads the query stream at ``t`` and predicts ``x_{t+1}``.

Depth of position ``i`` seen from the query at ``t`` with ``a`` tokens in flight (the fill):
``depth(t, i) = min(max_depth, t - i + offset)`` if ``t - i < a`` else ``max_depth``. The SPD default is the
input-state schedule (offset 0, max_depth n); the output-state ablation has offset 1; PPSD uses only
first-stage features (max_depth 1) with offset 1. The *serial* schedule (``variant=eagle``, the EAGLE-style
baseline of ``--mode sd``) has no pipeline: the whole target is one stage (max_depth 1), rows the target has
run are at depth 1, and the ``a`` newest rows (the last committed token and the head's own earlier drafts)
at depth 0: ``depth(t, i) = 0`` if ``t - i < a`` else ``max_depth``, for ``a`` up to ``draft_steps``. These are
settings, not separate code.

Three forwards share the weights:
- :meth:`Speculator.forward_train` - every position of a batch at once, never materialising the
  (n+1)N x N structural mask: causal attention over depth-max memory with offset ``a`` plus a band of
  ``a`` single keys (``i = t - j`` at depth ``min(max_depth, j + offset)``), in one softmax, blockwise over
  query rows and flash-style (only the output and the log-sum-exp are kept for backward; the autograd
  kernels are in :mod:`spd.heads.kernels`);
- :meth:`Speculator.forward_dense` - the reference (n+1)x expanded layout with the dense structural mask
  of Appendix A.3 (for tests and the layout benchmark);
- :meth:`Speculator.append_memory` / :meth:`Speculator.query` - incremental inference with cached K/V of
  depth-max rows; only the trailing rows are recomputed each step (:mod:`spd.heads.incremental`).

The module's ``forward`` is :meth:`~Speculator.forward_train`, with the training objective run inside it when one is
given (spd.training.head_forward). The layers are in :mod:`spd.heads.layers`; the calls the engine makes on the head
are declared in :mod:`spd.heads.interface`.

Shape suffixes: B batch, N positions, D hidden, H query heads, Hk kv heads, Dh head dim, V vocabulary,
J band offsets, R trailing rows, M expanded memory rows ((n+1)N); inside the blockwise attention: K kv
heads (= Hk), G query heads per kv head, C rows of a query block, Q = G x C, P deep keys a block sees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from . import incremental
from .config import SpeculatorConfig
from .interface import InFlightToken, SpeculationHead
from .kernels import ConcatLinear, offset_band_attention
from .layers import RMSNorm, Rope, SpeculatorLayer
from .memory import CacheView, SpeculatorCache, SpeculatorPool

T = TypeVar("T")

# --------------------------------------------------------------------------------------------- model


class Speculator(PreTrainedModel):
    """The SPD speculation head (see the module docstring)."""

    config_class = SpeculatorConfig
    base_model_prefix = "speculator"
    _no_split_modules = ["SpeculatorLayer"]
    config: SpeculatorConfig
    draft_ids: torch.Tensor | None  # a buffer with a draft vocabulary, else None

    def __init__(self, config: SpeculatorConfig):
        super().__init__(config)
        d = config.hidden_size
        # One FC per depth the head can see (all n+1 for SPD); unused depths get none, so that every
        # parameter receives a gradient (DDP) and checkpoints hold no dead weights.
        self.fc = nn.ModuleDict(
            {str(k): nn.Linear(len(config.anchors[k]) * d, d, bias=False) for k in config.used_depths}
        )
        # An nn.ModuleList, whose items torch's annotations leave untyped: the cast names them.
        self.layers = cast(
            "Sequence[SpeculatorLayer]", nn.ModuleList(SpeculatorLayer(config) for _ in range(config.num_layers))
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size or config.vocab_size, bias=False)
        if config.draft_vocab_size:
            # The target id of each LM-head row (sorted, unique); saved with the weights (spd.heads.draft_vocab).
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_ids = None
        self.rope = Rope(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, SpeculatorLayer) and module.memory_proj is not None:
            for proj in module.memory_proj.values():
                assert isinstance(proj, nn.Linear)  # SpeculatorLayer builds them so
                nn.init.eye_(proj.weight)

    # ----------------------------------------------------------------------------------- features
    def features(self, depth: int, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """``g^depth = FC_depth(concat(H^a for a in anchors[depth]))`` for rows that all have this depth."""
        return ConcatLinear.apply(self.fc[str(depth)].weight, *(hidden[a] for a in self.config.anchors[depth]))

    def features_many(self, depth: int, anchor_sets: list[dict[int, torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`features` of several sets of rows of one depth (``(P_i, D)`` per anchor) in one call, split back
        into one ``(P_i, D)`` per set."""
        sizes = [next(iter(anchors.values())).shape[0] for anchors in anchor_sets]
        rows = {a: torch.cat([anchors[a] for anchors in anchor_sets]) for a in self.config.anchors[depth]}
        return list(self.features(depth, rows).split(sizes))

    def trailing_features(
        self, paths: list[list[tuple[int, dict[int, torch.Tensor]]]]
    ) -> list[list[tuple[int, torch.Tensor]]]:
        """Many queries' trailing rows, each path ``[(depth, anchors), ...]``, as ``[(depth, g), ...]``: the rows of
        one depth, of every path, through that depth's FC in one call."""
        by_depth: dict[int, list[dict[int, torch.Tensor]]] = {}
        for path in paths:
            for depth, anchors in path:
                by_depth.setdefault(depth, []).append(anchors)
        features = {depth: iter(self.features_many(depth, group)) for depth, group in by_depth.items()}
        return [[(depth, next(features[depth])) for depth, _ in path] for path in paths]

    def get_input_embeddings(self):
        return None  # the head has no embedding of its own (accelerate's FSDP2 set-up asks)

    def needed_anchors(self) -> list[int]:
        """Every hidden-state index the head reads (over the depths it uses)."""
        return sorted({a for d in self.config.used_depths for a in self.config.anchors[d]})

    def logits(self, hidden_BND: torch.Tensor) -> torch.Tensor:
        """The LM head's logits: over the target vocabulary, or the K draft tokens with a draft vocabulary."""
        return self.lm_head(self.norm(hidden_BND))

    def vocab_logits(self, hidden_BND: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (tokens outside a draft vocabulary get -inf)."""
        logits = self.logits(hidden_BND)
        if self.draft_ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, logits)

    def forward(
        self,
        hidden: dict[int, torch.Tensor],
        fill_B: torch.Tensor,
        valid_BN: torch.Tensor | None = None,
        loss: Callable[..., T] | None = None,
        *loss_args: Any,
    ) -> torch.Tensor | T:
        """The query stream of every position (:meth:`forward_train`), or with ``loss`` a training objective of it,
        ``loss(self, out_BND, hidden, *loss_args)`` (the KD loss: :func:`spd.training.head_forward.kd_objective`).

        The objective runs inside ``forward`` so that data-parallel wrappers (DDP, DeepSpeed) see every parameter it
        uses, the LM head included.
        """
        out_BND = self.forward_train(hidden, fill_B, valid_BN)
        return out_BND if loss is None else loss(self, out_BND, hidden, *loss_args)

    # ------------------------------------------------------------------------------ training path
    def forward_train(
        self,
        hidden: dict[int, torch.Tensor],
        fill_B: torch.Tensor,
        valid_BN: torch.Tensor | None = None,
        query_chunk: int = 512,
    ) -> torch.Tensor:
        """Query-stream outputs (B, N, D) for every position, each with the per-example fill ``a``.

        ``hidden`` maps anchor index -> H^a (B, N, D) from one target forward; ``valid_BN`` marks real
        (non-padding) positions. Attention (:func:`offset_band_attention`) runs over blocks of
        ``query_chunk`` query rows and keeps only its output and log-sum-exp for backward, so at most one
        block's scores (rows x N per head) exist at a time instead of N x N.
        """
        cfg = self.config
        b, n_pos, _ = hidden[0].shape
        dev = hidden[0].device
        pos_BN = torch.arange(n_pos, device=dev).expand(b, n_pos)
        cos, sin = self.rope(pos_BN, hidden[0].dtype)
        if valid_BN is None:
            valid_BN = torch.ones(b, n_pos, dtype=torch.bool, device=dev)
        mem = {d: self.features(d, hidden) for d in cfg.used_depths}
        band_depths = [cfg.depth(j, j + 1) for j in range(cfg.max_fill)]  # band key j < a <= max_fill
        h_BND = mem[cfg.offset]
        for layer in self.layers:
            q = layer.query_heads(h_BND, cos, sin)  # (B, H, N, Dh)
            kv = {d: layer.memory_kv(m, d, cos, sin) for d, m in mem.items()}
            attn = offset_band_attention(q, kv, cfg.max_depth, band_depths, fill_B, valid_BN, query_chunk)
            h_BND = layer.finish(h_BND, attn)
        return h_BND

    def forward_dense(
        self, hidden: dict[int, torch.Tensor], fill_B: torch.Tensor, valid_BN: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Reference: (n+1)x expanded memory [g^n .. g^0] with the dense structural mask (Appendix A.3)."""
        cfg = self.config
        b, n_pos, _ = hidden[0].shape
        dev = hidden[0].device
        if valid_BN is None:
            valid_BN = torch.ones(b, n_pos, dtype=torch.bool, device=dev)
        # Blocks in decreasing depth, as in the paper; a depth the variant never uses (e.g. 0 for the
        # output-state schedule) would be masked out entirely, so its block is left out.
        depths = sorted(cfg.used_depths, reverse=True)
        pos_BN = torch.arange(n_pos, device=dev).expand(b, n_pos)
        cos, sin = self.rope(pos_BN, hidden[0].dtype)
        t_N = torch.arange(n_pos, device=dev)
        dist_NN = t_N[:, None] - t_N[None, :]  # t - T
        # depth(t, T) as a tensor: min(max_depth, t - T + offset) inside the fill (serial: 0), else max_depth.
        inside_NN = (
            torch.zeros_like(dist_NN) if cfg.schedule == "serial" else (dist_NN + cfg.offset).clamp(max=cfg.max_depth)
        )
        want_BNN = torch.where(
            dist_NN[None] < fill_B.view(b, 1, 1),
            inside_NN[None].expand(b, -1, -1),
            torch.full_like(dist_NN, cfg.max_depth)[None].expand(b, -1, -1),
        )
        masks = [(dist_NN[None] >= 0) & (want_BNN == d) & valid_BN[:, None, :] for d in depths]
        mask_BNM = torch.cat(masks, dim=-1)  # the (n+1)N-wide structural mask
        mem = {d: self.features(d, hidden) for d in depths}
        h_BND = mem[cfg.offset]
        for layer in self.layers:
            q = layer.query_heads(h_BND, cos, sin)
            kv = [layer.memory_kv(mem[d], d, cos, sin) for d in depths]
            k_M = layer.expand_kv(torch.cat([k for k, _ in kv], dim=2))
            v_M = layer.expand_kv(torch.cat([v for _, v in kv], dim=2))
            attn = F.scaled_dot_product_attention(q, k_M, v_M, attn_mask=mask_BNM[:, None])
            h_BND = layer.finish(h_BND, attn)
        return h_BND

    # ------------------------------------------------------------------------------ inference path
    # The head's engine calls (spd.heads.interface.SpeculationHead); the authors' heads
    # (spd.heads.published.authors_head) implement the same calls with their own schedule.
    def prefill_anchors(self) -> list[int]:
        """Hidden-state indices the prefill must return for every prompt position."""
        return list(self.config.anchors[self.config.max_depth])

    def prefill_memory(self, cache: SpeculatorCache, anchors: dict[int, torch.Tensor]) -> None:
        """Every prompt position enters the cache at full depth."""
        self.append_memory(cache, self.features(self.config.max_depth, anchors))

    def retire(self, cache: SpeculatorCache, tokens: Sequence[InFlightToken]) -> None:
        """Cache the memory row of every token that just reached max depth (tokens reach it in position order,
        so the cache stays a contiguous prefix of positions)."""
        max_depth = self.config.max_depth
        for token in tokens:
            if token.depth == max_depth and token.position == cache.length:
                self.append_memory(cache, self.features(max_depth, token.anchors)[:, None])

    def propose_logits(self, cache: SpeculatorCache, inflight: Sequence[InFlightToken]) -> torch.Tensor:
        """Logits (1, V) for the position after the newest token in flight, from the tokens' current depths."""
        plan, query = self._plan(cache, inflight)
        rows = [(depth, self.features(depth, anchors)) for depth, anchors in plan]
        query_1D = rows[-1][1] if query is None else self.features(self.config.offset, query)
        return self.vocab_logits(self.query(cache, rows, query_1D))

    def _plan(
        self, cache: SpeculatorCache, inflight: Sequence[InFlightToken]
    ) -> tuple[list[tuple[int, dict[int, torch.Tensor]]], dict[int, torch.Tensor] | None]:
        """A query's trailing rows as ``(depth, anchors)``, and its query's anchors (None: the last row is the query,
        already at the query's depth)."""
        cfg = self.config
        # Rows older than the cache are at max depth; the trailing rows are the in-flight tokens below it.
        trailing = [s for s in inflight if s.position >= cache.length]
        first_uncached = trailing[0].position if trailing else inflight[-1].position + 1
        if first_uncached != cache.length:
            raise RuntimeError("speculator cache and in-flight tokens are out of step")
        rows = [(min(s.depth, cfg.max_depth), s.anchors) for s in trailing]
        return rows, None if rows and rows[-1][0] == cfg.offset else inflight[-1].anchors

    def propose_logits_many(
        self, caches: Sequence[SpeculatorCache], inflights: Sequence[Sequence[InFlightToken]]
    ) -> torch.Tensor:
        """:meth:`propose_logits` of many queries at once, ``inflights[i]`` over ``caches[i]`` (a cache may serve
        several queries): the rows of one depth go through their FC together, then one :meth:`query_many` and one
        LM head. Logits ``(B, V)``, equal to each query's own up to fp32 rounding."""
        plans = [self._plan(cache, inflight) for cache, inflight in zip(caches, inflights)]
        trailing = self.trailing_features([rows for rows, _ in plans])
        asked = [query for _, query in plans if query is not None]
        own = iter(self.features_many(self.config.offset, asked) if asked else [])
        queries = [rows[-1][1] if query is None else next(own) for rows, (_, query) in zip(trailing, plans)]
        return self.vocab_logits(self.query_many(caches, trailing, queries))

    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> SpeculatorCache:
        """An empty cache of ``capacity`` positions for ``batch_size`` sequences."""
        p = next(self.parameters())
        return SpeculatorCache(self.config, batch_size, capacity, p.dtype, p.device)

    def new_pool(self, slots: int, capacity: int = 256) -> SpeculatorPool:
        """The memory of up to ``slots`` requests of a batched pipeline (:class:`~spd.heads.memory.SpeculatorPool`)."""
        p = next(self.parameters())
        return SpeculatorPool(self.config, slots, capacity, p.dtype, p.device)

    def append_memory(self, cache: SpeculatorCache, mem_BRD: torch.Tensor) -> None:
        """Append rows that reached max_depth (positions cache.length ...) to the per-layer K/V cache."""
        incremental.append_memory(self, cache, mem_BRD)

    def append_memory_many(self, caches: Sequence[SpeculatorCache], mems: list[torch.Tensor]) -> None:
        """:meth:`append_memory` for many requests at once (:func:`spd.heads.incremental.append_memory_many`)."""
        incremental.append_memory_many(self, caches, mems)

    def query(
        self, cache: SpeculatorCache | CacheView, trailing: list[tuple[int, torch.Tensor]], query_BD: torch.Tensor
    ) -> torch.Tensor:
        """Query-stream output (B, D) for the newest position, attending cached rows plus trailing rows
        (:func:`spd.heads.incremental.query`)."""
        return incremental.query(self, cache, trailing, query_BD)

    def query_many(
        self,
        caches: Sequence[SpeculatorCache],
        trailing: list[list[tuple[int, torch.Tensor]]],
        queries: list[torch.Tensor],
    ) -> torch.Tensor:
        """:meth:`query` for many requests at once (:func:`spd.heads.incremental.query_many`)."""
        return incremental.query_many(self, caches, trailing, queries)


if TYPE_CHECKING:  # the type checker holds the head to the engine's interface
    _engine_calls: type[SpeculationHead[SpeculatorCache]] = Speculator
