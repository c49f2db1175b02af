"""Target staging: a Hugging Face decoder-only causal LM cut into ``n`` pipeline stages.

The wrapper slices the real model (its embedding, decoder layers, final norm, LM head and rotary
embedding); it forks no modeling code. Stage ``s`` (0-based here, 1..n in the paper) owns layers
``[boundaries[s], boundaries[s+1])`` (the cut, :mod:`spd.target.cut`). Each stage has its own KV cache
(:class:`~spd.target.kv_cache.StageKVCache`), positions and RoPE, so one stage can run on tokens independently of the
others, as in a pipeline.

Hidden-state convention (docs/method.md §1): ``H^0`` is the token embedding and ``H^l`` is the output of
decoder layer ``l-1``, *before* the final norm. Anchors are requested by these indices ``l``.

Token trees (docs/method.md §6): a stage's cache holds the committed tokens followed by the tree nodes it has
run, in BFS order. ``run_stage(..., tree_mask_TN=...)`` runs tree nodes at explicit positions (committed
length + depth) under committed-causal + ancestor-mask attention (:mod:`spd.target.masks`), and
:meth:`StagedModel.prune_tree` / :meth:`StageKVCache.keep` compact the caches after the tree is pruned (see
:mod:`spd.decoding.tree`).

Shapes are named with suffixes: B batch, T new tokens, P cached tokens (past), K = P + T keys,
D hidden size, V vocabulary, Hk key/value heads, Dh head dim, C cache capacity, N tree nodes in the cache.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import SpdInputError
from .cut import split_layers
from .kv_cache import StageKVCache
from .linear_state import LinearStateRing
from .loading import load_causal_lm
from .masks import attention_mask, node_groups, tree_attention_mask
from .sdpa import decode_kernels

# Decoder-layer kinds the staging wrapper runs: attention with a KV cache, and linear attention (Gated
# DeltaNet, hybrid models such as Qwen3.5 / Qwen3-Next) with a conv + recurrent state (spd.target.linear_state).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR_LAYER_TYPE = "linear_attention"
_SUPPORTED_LAYER_TYPES = (*_ATTENTION_LAYER_TYPES, LINEAR_LAYER_TYPE)
# Attention backends whose mask format the wrapper builds; other backends are switched to sdpa.
_MASK_FORMATS = ("sdpa", "eager")


@dataclass
class StageOutput:
    """Result of running one stage: its output hidden states and the requested anchor layers."""

    hidden_BTD: torch.Tensor  # H^{b[s+1]}, pre-norm
    anchors: dict[int, torch.Tensor] = field(default_factory=dict)  # l -> H^l_BTD


def run_linear_layer(
    layer: nn.Module,
    hidden_BTD: torch.Tensor,
    cache: StageKVCache,
    groups: list[tuple[int, int, torch.Tensor]] | None,
    position_ids_BT: torch.Tensor | None,
    position_embeddings,
) -> torch.Tensor:
    """One linear-attention decoder layer on a stage call's ``T`` tokens, from and into ``cache``'s state: a chain of
    tokens (``groups`` None) as one sequence, tree nodes (:func:`node_groups`) depth by depth as a batch of one-token
    sequences, each from its parent's state. A recurrent layer takes no attention mask (there is no padding)."""
    kw = {cache_keyword(layer): cache}
    if groups is None:
        return layer(
            hidden_BTD,
            attention_mask=None,
            position_ids=position_ids_BT,
            use_cache=True,
            position_embeddings=position_embeddings,
            **kw,
        )
    parts, offset = [], groups[0][0]
    for node_first, node_end, parents_T in groups:
        cache.linear.select_nodes(node_first, node_end, parents_T)
        nodes_T1D = hidden_BTD[0, node_first - offset : node_end - offset, None]
        parts.append(
            layer(nodes_T1D, attention_mask=None, use_cache=True, position_embeddings=position_embeddings, **kw)[:, 0]
        )
    return torch.cat(parts)[None]


def cache_keyword(layer: nn.Module) -> str:
    """The keyword a Hugging Face decoder layer takes its cache by: ``cache`` where its forward names it so
    (transformers 5.24, where ``past_key_values`` still works with a warning until 5.40), else
    ``past_key_values`` (older versions)."""
    cls = type(layer)
    if cls not in _CACHE_KEYWORD:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORD[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORD[cls]


_CACHE_KEYWORD: dict[type, str] = {}


def _layer_types(config) -> list[str]:
    """Per layer: ``full_attention``, ``sliding_attention`` or ``linear_attention``."""
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        # Mistral-style configs: one sliding_window setting for every layer.
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        return [kind] * n
    unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise SpdInputError(
            f"the model has decoder layers of type {unsupported}, but staging supports only "
            f"{list(_SUPPORTED_LAYER_TYPES)} layers"
        )
    return list(layer_types[:n])


def _layer_windows(config, layer_types: list[str]) -> list[int | None]:
    """Per layer: the sliding-window size, or None for full (or linear) attention."""
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in layer_types]


class TargetShape:
    """Properties of a staged target read off its ``boundaries``, ``lm_head`` and ``config``: shared by
    :class:`StagedModel` and its offline stand-in, :class:`spd.training.capture.CapturedTarget`."""

    boundaries: list[int]
    lm_head: nn.Module
    config: object

    @property
    def n_stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads


class StagedModel(TargetShape, nn.Module):
    """A Hugging Face causal LM cut into pipeline stages; see the module docstring."""

    def __init__(self, model: nn.Module, n_stages: int | None = None, boundaries: list[int] | None = None):
        super().__init__()
        config = model.config
        impl = getattr(config, "_attn_implementation", None) or "sdpa"
        if impl not in _MASK_FORMATS:
            model.set_attn_implementation("sdpa")
            impl = "sdpa"
        base = model.base_model
        if isinstance(getattr(base, "language_model", None), nn.Module):
            # The multimodal layout (Qwen3_5ForConditionalGeneration): the text decoder is ``language_model``.
            base, config = base.language_model, config.get_text_config()
        try:
            self.embed_tokens: nn.Module = base.embed_tokens
            self.layers: nn.ModuleList = base.layers
            self.norm: nn.Module = base.norm
            self.rotary_emb: nn.Module = base.rotary_emb
        except AttributeError as exc:
            raise SpdInputError(
                f"model type '{config.model_type}' does not have the decoder-only layout staging expects "
                "(embed_tokens, layers, norm, rotary_emb)"
            ) from exc
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.model = model
        self.config = config
        self.attn_impl = impl
        self.num_layers = len(self.layers)
        if n_stages is None and boundaries is None:
            n_stages = 1
        self.boundaries = split_layers(self.num_layers, n_stages, boundaries)
        self.layer_types = _layer_types(config)
        self.windows = _layer_windows(config, self.layer_types)

    # ------------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        n_stages: int | None = None,
        boundaries: list[int] | None = None,
        revision: str | None = None,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> StagedModel:
        """Load a causal LM from a local directory or a hub id (with revision) and cut it into stages."""
        model = load_causal_lm(name_or_path, revision=revision, dtype=dtype, device=device, **kwargs)
        return cls(model, n_stages=n_stages, boundaries=boundaries)

    # ---------------------------------------------------------------------------------- properties
    @property
    def is_hybrid(self) -> bool:
        """Whether some decoder layers are linear attention (their state is rolled back from a ring)."""
        return LINEAR_LAYER_TYPE in self.layer_types

    def stage_layers(self, stage: int) -> range:
        """Indices of the decoder layers owned by ``stage`` (0-based)."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_layer_kinds(self, stage: int) -> tuple[list[int], list[int]]:
        """``stage``'s layers that keep keys and values (attention), and those that keep a recurrent state (linear
        attention, on hybrid targets)."""
        layers = self.stage_layers(stage)
        return (
            [layer for layer in layers if self.layer_types[layer] != LINEAR_LAYER_TYPE],
            [layer for layer in layers if self.layer_types[layer] == LINEAR_LAYER_TYPE],
        )

    # -------------------------------------------------------------------------------------- caches
    def new_caches(self, batch_size: int = 1, capacity: int = 256, rollback: int | None = None) -> list[StageKVCache]:
        """One empty cache per stage. ``rollback``: how many tokens a stage may run past a length it can still be
        truncated back to (linear-attention layers keep ``rollback + 1`` states; default ``n``; KV caches always
        truncate freely)."""
        depth = (self.n_stages if rollback is None else rollback) + 1
        return [self.new_stage_cache(s, batch_size, capacity, depth) for s in range(self.n_stages)]

    def new_stage_cache(
        self,
        stage: int,
        batch_size: int = 1,
        capacity: int = 256,
        ring_depth: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> StageKVCache:
        """An empty cache for ``stage``'s layers (the distributed runtime builds only its own, with the dtype and
        device of its layers)."""
        attention, linear = self.stage_layer_kinds(stage)
        ring = LinearStateRing(linear, ring_depth or self.n_stages + 1) if linear else None
        return StageKVCache(
            attention,
            self.kv_heads,
            self.head_dim,
            batch_size,
            capacity,
            dtype or self.dtype,
            device or self.device,
            linear=ring,
        )

    @staticmethod
    def truncate(caches: list[StageKVCache], length: int) -> None:
        """Truncate every stage's KV cache to ``length`` tokens (rollback)."""
        for cache in caches:
            cache.truncate(length)

    @staticmethod
    def prune_tree(caches: list[StageKVCache], committed: int, kept: torch.Tensor) -> int:
        """After the tree's root is verified, commit it and keep the subtree ``kept`` in every stage's cache.

        The root's row ``committed`` stays where it is (it becomes the last committed token) and the
        kept nodes (old tree indices from :meth:`spd.decoding.tree.TokenTree.prune_to_child`) move right after
        it, in order; each stage keeps those it has already run (a BFS prefix of the tree). Returns the
        new committed length, the new root's row. On a miss, ``truncate(caches, committed + 1)`` instead.
        """
        kept = torch.as_tensor(kept, dtype=torch.long)
        for cache in caches:
            held = cache.length - committed  # tree nodes this stage has run, root included
            if held < 1:
                raise ValueError(
                    f"prune_tree: a stage holds {cache.length} rows, so it has not run the root at row {committed}"
                )
            cache.keep(committed + 1, kept[kept < held] - 1)
        return committed + 1

    # ------------------------------------------------------------------------------------- compute
    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """H^0: the token embeddings."""
        return self.embed_tokens(input_ids_BT)

    def rope(self, hidden_BTD: torch.Tensor, position_ids_BT: torch.Tensor):
        """(cos, sin) for the given positions; shared by every stage of one step."""
        return self.rotary_emb(hidden_BTD, position_ids=position_ids_BT)

    def run_stage(
        self,
        stage: int,
        hidden_BTD: torch.Tensor,
        cache: StageKVCache,
        position_ids_BT: torch.Tensor | None = None,
        anchors: tuple[int, ...] | list[int] = (),
        position_embeddings=None,
        tree_mask_TN: torch.Tensor | None = None,
    ) -> StageOutput:
        """Run one stage on ``T`` new tokens appended to its cache; positions default to cache.length + i.

        Explicit ``position_ids_BT`` get an explicit causal mask by absolute position (key j is visible
        to a query at position p iff j <= p), which is what pipelined decoding needs.

        Tree nodes: ``tree_mask_TN`` (bool) is the mask over the last N keys after appending (the tree
        nodes in the cache, these T last), i.e. rows ``[N-T, N)`` and columns ``[0, N)`` of the tree's
        ancestor mask; the keys before them are committed and all visible. ``position_ids_BT`` are then
        required (committed length + depth).

        ``anchors`` are hidden-state indices ``l`` in ``[b[s], b[s+1]]`` to return (``H^{b[s]}`` is the
        stage's input).
        """
        with decode_kernels(hidden_BTD.device):
            return self._run_stage(
                stage, hidden_BTD, cache, position_ids_BT, anchors, position_embeddings, tree_mask_TN
            )

    def _run_stage(
        self, stage, hidden_BTD, cache, position_ids_BT, anchors, position_embeddings, tree_mask_TN
    ) -> StageOutput:
        first, last = self.boundaries[stage], self.boundaries[stage + 1]
        t = hidden_BTD.shape[1]
        contiguous = position_ids_BT is None
        if tree_mask_TN is not None:
            self._check_tree_mask(tree_mask_TN, t, cache.length + t, contiguous)
            tree_mask_TN = tree_mask_TN.to(hidden_BTD.device)
        if contiguous:
            position_ids_BT = torch.arange(cache.length, cache.length + t, device=hidden_BTD.device)[None]
        if position_embeddings is None:
            position_embeddings = self.rope(hidden_BTD, position_ids_BT)
        cache.reserve(cache.length + t)
        q_pos_T = position_ids_BT[0]
        kv_len = cache.length + t
        cache.positions_C[cache.length : kv_len] = q_pos_T
        masks: dict[int | None, torch.Tensor | None] = {}
        out = StageOutput(hidden_BTD)
        if first in anchors:
            out.anchors[first] = hidden_BTD
        groups = None  # tree nodes through linear-attention layers: (first, end, parents) per depth
        if tree_mask_TN is not None and cache.linear is not None:
            groups = node_groups(tree_mask_TN)
        cache.begin(t, first_node=None if groups is None else groups[0][0])
        for layer in range(first, last):
            window = self.windows[layer]
            if self.layer_types[layer] == LINEAR_LAYER_TYPE:
                hidden_BTD = run_linear_layer(
                    self.layers[layer], hidden_BTD, cache, groups, position_ids_BT, position_embeddings
                )
                if layer + 1 in anchors:
                    out.anchors[layer + 1] = hidden_BTD
                continue
            if window not in masks and tree_mask_TN is not None:
                masks[window] = tree_attention_mask(
                    q_pos_T, cache.positions_C[:kv_len], tree_mask_TN, window, self.attn_impl, hidden_BTD.dtype
                )
            elif window not in masks:
                masks[window] = attention_mask(q_pos_T, kv_len, window, self.attn_impl, hidden_BTD.dtype, contiguous)
            hidden_BTD = self.layers[layer](
                hidden_BTD,
                attention_mask=masks[window],
                position_ids=position_ids_BT,
                use_cache=True,
                position_embeddings=position_embeddings,
                **{cache_keyword(self.layers[layer]): cache},
            )
            if layer + 1 in anchors:
                out.anchors[layer + 1] = hidden_BTD
        cache.advance(t, tree=groups is not None)
        out.hidden_BTD = hidden_BTD
        return out

    @staticmethod
    def _check_tree_mask(tree_mask_TN: torch.Tensor, t: int, kv_len: int, contiguous: bool) -> None:
        if contiguous:
            raise SpdInputError("run_stage: a tree mask needs explicit position_ids_BT (committed length + depth)")
        if tree_mask_TN.dtype != torch.bool or tree_mask_TN.dim() != 2:
            raise SpdInputError(
                f"run_stage: tree_mask_TN must be a 2-D bool tensor, got {tree_mask_TN.dtype} "
                f"of shape {tuple(tree_mask_TN.shape)}"
            )
        if tree_mask_TN.shape[0] != t or not t <= tree_mask_TN.shape[1] <= kv_len:
            raise SpdInputError(
                f"run_stage: tree_mask_TN must have shape (T, N) with T = {t} new nodes and "
                f"{t} <= N <= {kv_len} (the keys after appending), got {tuple(tree_mask_TN.shape)}"
            )

    def forward_stages(
        self, input_ids_BT: torch.Tensor, caches: list[StageKVCache], anchors: tuple[int, ...] | list[int] = ()
    ) -> StageOutput:
        """Run new tokens through every stage in turn (prefill, or one AR step); returns H^L and anchors."""
        hidden_BTD = self.embed(input_ids_BT)
        start = caches[0].length
        position_ids_BT = torch.arange(start, start + input_ids_BT.shape[1], device=hidden_BTD.device)[None]
        rope = self.rope(hidden_BTD, position_ids_BT)
        collected: dict[int, torch.Tensor] = {}
        if 0 in anchors:
            collected[0] = hidden_BTD
        for s, cache in enumerate(caches):
            if cache.length != start:
                raise RuntimeError(f"stage {s} holds {cache.length} tokens but stage 0 holds {start}")
            out = self.run_stage(s, hidden_BTD, cache, None, anchors, rope)
            collected.update(out.anchors)
            hidden_BTD = out.hidden_BTD
        return StageOutput(hidden_BTD, collected)

    def hidden_states(
        self, input_ids_BN: torch.Tensor, anchors: tuple[int, ...] | list[int]
    ) -> dict[int, torch.Tensor]:
        """A cache-free causal forward of whole (right-padded) sequences returning ``{l: H^l}`` for ``anchors``.

        This is the teacher pass of training: one forward captures every anchor the head needs plus H^L.
        """
        hidden_BND = self.embed(input_ids_BN)
        n = input_ids_BN.shape[1]
        position_ids_BN = torch.arange(n, device=hidden_BND.device)[None]
        rope = self.rope(hidden_BND, position_ids_BN)
        masks: dict[int | None, torch.Tensor | None] = {}
        out = {0: hidden_BND} if 0 in anchors else {}
        for layer in range(max(anchors)):
            window = self.windows[layer]
            if self.layer_types[layer] == LINEAR_LAYER_TYPE:
                # Right padding never reaches earlier positions of a causal recurrence: no mask needed.
                hidden_BND = self.layers[layer](
                    hidden_BND, attention_mask=None, position_ids=position_ids_BN, position_embeddings=rope
                )
                if layer + 1 in anchors:
                    out[layer + 1] = hidden_BND
                continue
            if window not in masks:
                masks[window] = attention_mask(position_ids_BN[0], n, window, self.attn_impl, hidden_BND.dtype, True)
            hidden_BND = self.layers[layer](
                hidden_BND, attention_mask=masks[window], position_ids=position_ids_BN, position_embeddings=rope
            )
            if layer + 1 in anchors:
                out[layer + 1] = hidden_BND
        return out

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Target logits from final hidden states H^L: ``lm_head(norm(H^L))``."""
        return self.lm_head(self.norm(hidden_BTD))

    @property
    def norm_eps(self) -> float:
        """The final norm's epsilon (``eps`` or ``variance_epsilon`` by model family)."""
        return float(getattr(self.norm, "eps", None) or getattr(self.norm, "variance_epsilon", 0.0))

    @torch.no_grad()
    def norm_scale(self) -> torch.Tensor:
        """The final norm's per-channel scale ``g`` in ``norm(x) = g * x / rms(x)``, whatever the convention
        (``w`` for Llama/Qwen3, ``1 + w`` for Qwen3.5/Qwen3-Next): read off the norm applied to a unit vector."""
        ones_1D = torch.ones(1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        eps = self.norm_eps
        return (self.norm(ones_1D)[0].double() * (1.0 + eps) ** 0.5).to(self.dtype)  # rms(ones) = 1, up to eps
