"""The SPD authors' released heads (versions 10 and 11) as modules, with the decode schedule they were trained for.

Written from their code (github.com/yuyijiong/speculative_pipeline_decoding: v10 = ``pipeline_model.py`` at
commit 0c068eb, v11 = commit 186f366) and tested against outputs of that code (tests/fixtures/authors). The
differences from our own head (:mod:`spd.heads.speculator`) and from docs/method.md §3 are listed in docs/method.md.

Both versions build one *row* per position from target hidden states ``H^k`` (k = 0: embedding, k >= 1:
output of layer k-1, pre-norm) and run a small tower of Qwen3-style decoder layers over the rows; the
output of the newest row goes through the **target's** final norm and the head's ``lm_head`` (over a draft
vocabulary when ``draft_token_ids`` is set: row r of ``lm_head`` is token ``draft_token_ids[r]``).

- v10: a depth-d row (d >= 1) is ``stage_projs[n-d](concat(H^k, k in shallow[n-d]))``, the newest row
  ``g0_proj(H^0)``. Only the newest row is a query stream; the others are memory rows whose keys/values at
  layer j come from ``P_j o ... o P_0(row)`` (``fixed_stage_per_layer_projs[j][n-s]``, chosen by the row's
  *slot* s in the call, composed across layers).
- v11: a depth-d row is ``aggr_projs[t](concat(H^{b[0]}, .., H^{b[t]}))`` with
  ``t = max{i : b[i] <= min(L, d * L/n)}`` (``b`` = ``aggr_feature_bound``); the tower is an ordinary
  decoder over the rows (every row is query, key and value). On Qwen3.5 bases its layers are Hugging
  Face's gated ``Qwen3_5DecoderLayer`` forced to full attention.

The schedule (their ``_generate_single_chain``): each step the rows are the positions ``P-n+1 .. P`` of the
newest token ``P`` at nominal depth ``P - p`` (the newest at depth 0), preceded by the row of the token that
completed stage n in the previous step (the *evicted* row, depth n) when there is one. The head's KV cache is
cut to the first row's position and every row's keys/values are appended, so a position keeps the keys and
values of the last step it was a row in. ``use_deepest`` (forced by ``trained_with_use_deepest``) lets a row
take the deepest depth whose anchors its token already has (committed tokens: depth n; capped at n-1 while
an evicted row is present). The prefill feeds positions ``0 .. s0-n`` at depth n.

``authors_prefill`` (default True) reproduces two details of their prefill exactly: prompt tokens read
``H^L`` after the final norm (their prefill takes Hugging Face's ``hidden_states[L]``, which is post-norm;
decode tokens read the raw ``H^L`` the heads were trained on), and v10's stage ids when the prefill has n or
n+1 rows (their ``_infer_stage_ids`` then takes it for a decode call). Set it to False for the raw state.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import SpdInputError
from ...target.kv_cache import StageKVCache
from ...target.sdpa import decode_kernels
from ...target.staging import StagedModel, cache_keyword
from ..interface import InFlightToken, SpeculationHead
from .authors_config import config_for, spec_layer_config
from .authors_file import AuthorsCheckpoint


class AuthorsCache:
    """The head's per-layer K/V (positions before the current rows), anchors of committed positions that can
    still be rows, and the evicted row's position."""

    def __init__(self, kv: StageKVCache):
        self.kv = kv
        self.snaps: dict[int, dict[int, torch.Tensor]] = {}  # position -> {k: H^k (1, D)}
        self.evicted: int | None = None

    @property
    def length(self) -> int:
        return self.kv.length

    def truncate(self, length: int) -> None:
        """A flush: keep rows before ``length``; the next step has no evicted row (as in their code)."""
        self.kv.truncate(length)
        self.evicted = None
        for p in [p for p in self.snaps if p >= length]:
            del self.snaps[p]


class AuthorsHead(nn.Module):
    """An authors' v10 or v11 head attached to a staged target (see the module docstring)."""

    def __init__(
        self,
        checkpoint: AuthorsCheckpoint,
        staged: StagedModel,
        use_deepest: bool | None = None,
        authors_prefill: bool = True,
    ):
        super().__init__()
        raw, source = checkpoint.config, checkpoint.source
        self.config = cfg = config_for(checkpoint, staged, use_deepest, authors_prefill)
        n, d = cfg.n_stages, cfg.hidden_size
        layer_cfg, gated = spec_layer_config(staged, cfg.num_layers, raw, cfg.version)
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        if gated:
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

            self.spec_layers = nn.ModuleList(Qwen3_5DecoderLayer(layer_cfg, j) for j in range(cfg.num_layers))
        else:
            self.spec_layers = nn.ModuleList(Qwen3DecoderLayer(layer_cfg, j) for j in range(cfg.num_layers))
        self._gated = gated
        if cfg.version == 10:
            assert cfg.shallow is not None  # config_for reads it for version 10
            self.stage_projs = nn.ModuleList(nn.Linear(len(a) * d, d, bias=False) for a in cfg.shallow)
            self.g0_proj = nn.Linear(d, d, bias=False)
            self.fixed_stage_per_layer_projs = nn.ModuleList(
                nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n)) for _ in range(cfg.num_layers)
            )
        else:
            assert cfg.bound is not None  # config_for reads it for version 11
            self.aggr_projs = nn.ModuleList(nn.Linear((i + 1) * d, d, bias=False) for i in range(len(cfg.bound)))
        vocab_out = len(cfg.draft_token_ids) if cfg.draft_token_ids is not None else cfg.vocab_size
        self.lm_head = nn.Linear(d, vocab_out, bias=False)
        self.to(dtype=staged.dtype, device=staged.device)
        _load_state(self, checkpoint.state_dict, source, staged.dtype)
        if cfg.draft_token_ids is not None:
            self.register_buffer(
                "draft_ids", torch.tensor(cfg.draft_token_ids, dtype=torch.long, device=staged.device), persistent=False
            )
        else:
            self.draft_ids = None
        # The target's final norm and rotary embedding are used, not stored (as in their code).
        self._target = [staged]  # a list: not a submodule (its weights are the target's)
        self.rotary = copy.deepcopy(staged.rotary_emb)
        self._rope = importlib.import_module(type(staged.model).__module__).apply_rotary_pos_emb
        self.layer_cfg = layer_cfg
        self.eval()

    # ------------------------------------------------------------- engine calls (spd.heads.interface)
    def needed_anchors(self) -> list[int]:
        """Every hidden-state index a row can read (all of them are kept for a token while it is in flight)."""
        cfg = self.config
        if cfg.version == 10:
            assert cfg.shallow is not None  # config_for reads it for version 10
            return sorted({0, *(k for a in cfg.shallow for k in a)})
        assert cfg.bound is not None  # config_for reads it for version 11
        return sorted(set(cfg.bound))

    def prefill_anchors(self) -> list[int]:
        """Hidden-state indices the prefill must return for every prompt position: all of them."""
        return self.needed_anchors()

    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> AuthorsCache:
        """An empty cache of ``capacity`` positions for ``batch_size`` sequences."""
        p = self.lm_head.weight
        kv = StageKVCache(
            list(range(self.config.num_layers)),
            self.layer_cfg.num_key_value_heads,
            self.layer_cfg.head_dim,
            batch_size,
            capacity,
            p.dtype,
            p.device,
        )
        return AuthorsCache(kv)

    def prefill_memory(self, cache: AuthorsCache, anchors: dict[int, torch.Tensor]) -> None:
        """Seed the cache from the prompt: rows ``0 .. s0-n`` at depth n; keep the anchors of the rest."""
        cfg = self.config
        n, big_l = cfg.n_stages, cfg.target_num_layers
        anchors = dict(anchors)
        if cfg.authors_prefill and big_l in anchors:
            anchors[big_l] = self._target[0].norm(anchors[big_l])  # their prefill reads post-norm H^L
        s0 = anchors[0].shape[1]
        for p in range(max(0, s0 - n), s0):
            cache.snaps[p] = {k: h[:, p] for k, h in anchors.items()}
        count = s0 - n + 1
        if count <= 0:
            return
        rows_1RD = self._row({k: h[:, :count] for k, h in anchors.items()}, n)
        slots = [n] * count
        if cfg.version == 10 and cfg.authors_prefill and count in (n, n + 1):
            slots = list(range(count - 1, -1, -1))  # their _infer_stage_ids takes it for a decode call
        self._tower(cache, rows_1RD, 0, slots)

    def retire(self, cache: AuthorsCache, tokens: Sequence[InFlightToken]) -> None:
        """Tokens that completed stage n: their anchors are kept, the newest becomes the evicted row."""
        for token in tokens:
            if token.depth == self.config.n_stages:
                cache.snaps[token.position] = dict(token.anchors)
                cache.evicted = token.position

    def propose_logits(self, cache: AuthorsCache, inflight: Sequence[InFlightToken]) -> torch.Tensor:
        """Full-vocabulary logits (1, V) of the head's next token after the newest in-flight token."""
        rows_1RD, first, slots = self._window(cache, inflight)
        return self.logits(self._tower(cache, rows_1RD, first, slots))

    def propose_logits_many(
        self, caches: Sequence[AuthorsCache], inflights: Sequence[Sequence[InFlightToken]]
    ) -> torch.Tensor:
        """:meth:`propose_logits` of many queries at once, ``inflights[i]`` over ``caches[i]`` (a cache may serve
        several queries, the nodes of one request's tree: its keys and values are then those of the last of them,
        as when they are asked one after another): one tower call over every query's rows, left-padded to the
        longest, each attending its own cache. Logits ``(B, V)``, equal to each query's own up to fp32 rounding."""
        windows = [self._window(cache, inflight) for cache, inflight in zip(caches, inflights)]
        return self.logits(self._tower_many(caches, *map(list, zip(*windows))))

    def _window(self, cache: AuthorsCache, inflight: Sequence[InFlightToken]) -> tuple[torch.Tensor, int, list[int]]:
        """The rows of one query (their schedule, see the module docstring) as ``(1, R, D)``, the first row's
        position and each row's slot; the cache is cut to the first row's position."""
        cfg = self.config
        n = cfg.n_stages
        newest = inflight[-1].position
        by_pos = {s.position: s for s in inflight}
        rows, positions, slots = [], [], []
        evicted = cache.evicted is not None and cache.evicted == newest - n
        if evicted:
            snap = cache.snaps[newest - n]
            rows.append(self._row(snap, self._choose(snap, n, n)))
            positions.append(newest - n)
            slots.append(n)
        cap = n - 1 if evicted else n
        for p in range(max(0, newest - n + 1), newest + 1):
            snap = by_pos[p].anchors if p in by_pos else cache.snaps[p]
            nominal = newest - p
            depth = 0 if nominal == 0 else self._choose(snap, nominal, cap)
            rows.append(self._row(snap, depth))
            positions.append(p)
            slots.append(nominal)
        # A flush can send the window back to newest - 2n + 3 (its exiting token was the oldest in flight).
        for p in [p for p in cache.snaps if p < newest - 2 * n]:
            del cache.snaps[p]
        cache.kv.truncate(positions[0])
        return torch.cat(rows, dim=1), positions[0], slots

    def logits(self, hidden_1D: torch.Tensor) -> torch.Tensor:
        """``lm_head(target_norm(x))`` spread over the full vocabulary (-inf outside a draft vocabulary)."""
        draft_1Vd = self.lm_head(self._target[0].norm(hidden_1D))
        if self.draft_ids is None:
            return draft_1Vd
        full_1V = draft_1Vd.new_full((draft_1Vd.shape[0], self.config.vocab_size), float("-inf"))
        full_1V[:, self.draft_ids] = draft_1Vd
        return full_1V

    # ------------------------------------------------------------------------------- training forward
    @torch.no_grad()
    def train_logits(self, hidden: dict[int, torch.Tensor], fill: int) -> torch.Tensor:
        """Their training forward for one sequence (batch 1) and simulated fill ``a``: full-vocabulary logits
        (1, S, V), position t predicting token t+1. ``hidden`` maps k -> H^k (1, S, D) (raw, pre-norm).

        v10: the query at t sees position T at distance k = t - T as a depth-k row (g_n content once k >= a,
        the slot's projection either way), depth n beyond the window. v11: every row (type i, position T) is a
        query; the expanded layout of their trainer is built with its mask and run through the layers.
        """
        cfg = self.config
        n, s_len = cfg.n_stages, hidden[0].shape[1]
        out = []
        if cfg.version == 10:
            for t in range(s_len):
                rows, slots = [], []
                for position in range(t + 1):
                    k = t - position
                    depth = 0 if k == 0 else (n if k >= fill or k >= n else k)
                    rows.append(self._row({a: h[:, position] for a, h in hidden.items()}, depth))
                    slots.append(min(k, n))
                cache = self.new_cache(capacity=t + 1)
                out.append(self._tower(cache, torch.cat(rows, dim=1), 0, slots))
            return self.logits(torch.stack(out, dim=1)[0]).unsqueeze(0)
        assert cfg.bound is not None  # config_for reads it for version 11
        m = len(cfg.bound)
        types = list(range(m - 1, -1, -1))  # block b holds aggregation type m-1-b
        rows_1MD = torch.cat(
            [self.aggr_projs[i](torch.cat([hidden[a] for a in cfg.bound[: i + 1]], dim=-1)) for i in types], dim=1
        )
        # A type no depth maps to gets n + 1 (their aggr_to_min_depth): it then reads the deepest type.
        min_depth = [min([d for d in range(n + 1) if cfg.aggr_type(d) == i] or [n + 1]) for i in range(m)]
        pos = torch.arange(s_len)
        t_q, t_k = pos.repeat(m)[:, None], pos.repeat(m)[None, :]
        type_q = torch.tensor(types).repeat_interleave(s_len)[:, None]
        type_k = torch.tensor(types).repeat_interleave(s_len)[None, :]
        dq = torch.tensor(min_depth)[type_q]
        distance = t_q - t_k
        want = torch.tensor([cfg.aggr_type(d) for d in range(n + 1)])[(dq + distance.clamp(min=0)).clamp(max=n)]
        if fill < n:
            want = torch.where(distance >= fill, torch.full_like(want, m - 1), want)
        mask_11MM = ((distance >= 0) & (type_k == want))[None, None].to(rows_1MD.device)
        pos_1M = pos.repeat(m)[None].to(rows_1MD.device)
        cos, sin = self.rotary(rows_1MD, pos_1M)
        x = self._decoder(rows_1MD, cos, sin, pos_1M, self.new_cache(capacity=m * s_len).kv, mask_11MM)
        return self.logits(x[0, (m - 1) * s_len :]).unsqueeze(0)

    # ---------------------------------------------------------------------------------------- pieces
    def _choose(self, snap: dict, nominal: int, cap: int) -> int:
        """The depth a row takes: nominal, or with use_deepest the deepest (<= cap) whose anchors it has."""
        cfg = self.config
        hi = min(cap, cfg.n_stages) if cfg.use_deepest else nominal
        lowest = 1 if cfg.version == 10 else 0
        for depth in range(hi, lowest - 1, -1):
            if all(k in snap for k in cfg.depth_anchors(depth)):
                return depth
        return nominal

    def _row(self, snap: dict[int, torch.Tensor], depth: int) -> torch.Tensor:
        """The row(s) of one depth from anchors (..., D) -> (..., D), with a row axis added for a single row."""
        cfg = self.config
        feats = torch.cat([snap[k] for k in cfg.depth_anchors(depth)], dim=-1)
        if cfg.version == 10:
            proj = self.g0_proj if depth == 0 else self.stage_projs[cfg.n_stages - depth]
        else:
            proj = self.aggr_projs[cfg.aggr_type(depth)]
        out = proj(feats)
        return out[:, None] if out.dim() == 2 else out

    def _tower(self, cache: AuthorsCache, rows_1RD: torch.Tensor, first: int, slots: list[int]) -> torch.Tensor:
        """Run the tower on rows at positions ``first ..`` after the cached ones; the last row's output (1, D)."""
        return self._tower_many([cache], [rows_1RD], [first], [slots])

    def _tower_many(
        self, caches: Sequence[AuthorsCache], rows: list[torch.Tensor], firsts: list[int], slots: list[list[int]]
    ) -> torch.Tensor:
        """:meth:`_tower` for B queries in one call: query ``b``'s rows ``(1, R_b, D)`` at positions ``firsts[b] ..``
        after ``caches[b]``'s rows, left-padded to the longest (so every query's newest row is the last); each
        cache gets its query's keys and values. The last row's output of each, ``(B, D)``. One query runs as
        before batching, on its own cache."""
        for cache, first in zip(caches, firsts):
            if cache.kv.length != first:
                raise RuntimeError(
                    f"authors head: rows start at position {first} but the cache holds {cache.kv.length}"
                )
        sizes = [r.shape[1] for r in rows]
        width = max(sizes)
        dev = rows[0].device
        rows_BRD = rows[0].new_zeros(len(rows), width, rows[0].shape[2])
        pos_BR = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        slots_BR = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: padding
        for b, (r_1RD, first, size) in enumerate(zip(rows, firsts, sizes)):
            rows_BRD[b, width - size :] = r_1RD[0]
            pos_BR[b, width - size :] = torch.arange(first, first + size, device=dev)
            slots_BR[b, width - size :] = torch.tensor(slots[b])
        cos, sin = self.rotary(rows_BRD, pos_BR)
        for cache, first, size in zip(caches, firsts, sizes):
            cache.kv.reserve(first + size)
        keys = max(first + size for first, size in zip(firsts, sizes))
        # A row sees the keys up to its own position (a padding row, at position 0, sees key 0 only).
        mask_B1RK = (torch.arange(keys, device=dev)[None, None, :] <= pos_BR[:, :, None])[:, None]
        kv = caches[0].kv if len(caches) == 1 else _PaddedKV([c.kv for c in caches], sizes, keys)
        if self.config.version == 10:
            out = self._tower_v10(kv, rows_BRD, cos, sin, pos_BR, mask_B1RK, slots_BR)
        else:
            out = self._decoder(rows_BRD, cos, sin, pos_BR, kv, mask_B1RK)
        for cache in {id(c): c for c in caches}.values():  # a cache serving several queries advances once
            cache.kv.advance(sizes[caches.index(cache)])
        return out[:, -1]

    def _decoder(self, x_1RD, cos, sin, pos_1R, kv: StageKVCache | _PaddedKV, mask_11RK) -> torch.Tensor:
        """v11: every row through every layer (keys/values appended after ``kv``'s rows)."""
        for j, layer in enumerate(self.spec_layers):
            if self._gated:
                x_1RD = layer(
                    x_1RD,
                    attention_mask=mask_11RK,
                    position_ids=pos_1R,
                    use_cache=True,
                    position_embeddings=(cos, sin),
                    **{cache_keyword(layer): kv},
                )
            else:
                x_1RD = self._layer(layer, j, x_1RD, cos, sin, kv, mask_11RK, list(range(x_1RD.shape[1])))
        return x_1RD

    def _tower_v10(self, kv, rows_BRD, cos, sin, pos_BR, mask_B1RK, slots_BR):
        """v10: the query rows (slot 0: the newest row of every query, or none in a prefill) through the layers; the
        memory rows (slot s > 0) enter layer j as ``P_j(..(P_0(row)))``, padding rows (slot -1) as they are."""
        n = self.config.n_stages
        query_cols = [i for i in range(slots_BR.shape[1]) if bool((slots_BR[:, i] == 0).all())]
        if any(bool((slots_BR[:, i] == 0).any()) for i in range(slots_BR.shape[1]) if i not in query_cols):
            raise RuntimeError("authors head: the queries of one tower call must be the same rows of every query")
        groups = {s: (slots_BR == s).to(rows_BRD.device) for s in sorted(set(slots_BR[slots_BR > 0].tolist()))}
        mem_BRD = rows_BRD
        query_BQD = rows_BRD[:, query_cols]
        for j, layer in enumerate(self.spec_layers):
            # The per-layer projections compose: layer j sees P_j(..(P_0(row))) (their in-place update).
            mem_BRD = mem_BRD.clone()
            for s, members_BR in groups.items():
                mem_BRD[members_BR] = self.fixed_stage_per_layer_projs[j][n - s](mem_BRD[members_BR])
            x_BRD = mem_BRD.clone()
            x_BRD[:, query_cols] = query_BQD
            query_BQD = self._layer(layer, j, x_BRD, cos, sin, kv, mask_B1RK, query_cols)
        return query_BQD if query_cols else rows_BRD[:, -1:]

    def _layer(self, layer, j: int, x_1RD, cos, sin, kv: StageKVCache | _PaddedKV, mask_11RK, out_rows: list[int]):
        """A Qwen3-parts decoder layer over all rows (keys/values appended to ``kv``), outputs of ``out_rows``."""
        attn = layer.self_attn
        b, r, _ = x_1RD.shape
        hd = attn.head_dim
        h = layer.input_layernorm(x_1RD)
        q = attn.q_norm(attn.q_proj(h).view(b, r, -1, hd)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(b, r, -1, hd)).transpose(1, 2)
        v = attn.v_proj(h).view(b, r, -1, hd).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        k_all, v_all = kv.update(k, v, j)
        if not out_rows:
            return x_1RD[:, :0]
        groups = q.shape[1] // k_all.shape[1]
        k_all, v_all = k_all.repeat_interleave(groups, dim=1), v_all.repeat_interleave(groups, dim=1)
        with decode_kernels(q.device):
            out = F.scaled_dot_product_attention(
                q[:, :, out_rows], k_all, v_all, attn_mask=mask_11RK[:, :, out_rows], scale=attn.scaling
            )
        y = x_1RD[:, out_rows] + attn.o_proj(out.transpose(1, 2).reshape(b, len(out_rows), -1))
        return y + layer.mlp(layer.post_attention_layernorm(y))


class _PaddedKV:
    """Many queries' tower caches as one batch for the layers' ``update(key, value, layer_idx)`` call: query ``b``'s
    new rows (the last ``sizes[b]`` of the call's left-padded rows) are written into its own cache, and every query's
    keys and values come back in one tensor padded to ``keys`` positions (the mask hides the padding)."""

    def __init__(self, kvs: list[StageKVCache], sizes: list[int], keys: int):
        self.kvs, self.sizes, self.keys = kvs, sizes, keys

    def update(self, key_BHkRDh: torch.Tensor, value_BHkRDh: torch.Tensor, layer_idx: int, *args, **kwargs):
        b, h, _, d = key_BHkRDh.shape
        keys_BHkKDh = key_BHkRDh.new_zeros(b, h, self.keys, d)
        values_BHkKDh = value_BHkRDh.new_zeros(b, h, self.keys, d)
        for i, (kv, size) in enumerate(zip(self.kvs, self.sizes)):
            k, v = kv.update(key_BHkRDh[i : i + 1, :, -size:], value_BHkRDh[i : i + 1, :, -size:], layer_idx)
            keys_BHkKDh[i, :, : k.shape[2]] = k[0]  # copied now: another query of the same cache may write next
            values_BHkKDh[i, :, : v.shape[2]] = v[0]
        return keys_BHkKDh, values_BHkKDh


def _load_state(head: AuthorsHead, state_dict: dict[str, torch.Tensor], source: str, dtype: torch.dtype) -> None:
    """Load their tensors strictly; a missing, unexpected or misshapen tensor is one sentence."""
    own = head.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise SpdInputError(
            f"the head '{source}' does not match its version's layout: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    for key, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise SpdInputError(
                f"the head '{source}' has '{key}' of shape {tuple(tensor.shape)}, but this target "
                f"needs {tuple(own[key].shape)}"
            )
    head.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()})


def load_authors_head(
    source: str,
    staged: StagedModel,
    revision: str | None = None,
    use_deepest: bool | None = None,
    authors_prefill: bool = True,
) -> AuthorsHead:
    """An authors' head file (path or ``hf://`` reference) attached to ``staged``."""
    from .authors_file import load_authors_file

    return AuthorsHead(load_authors_file(source, revision), staged, use_deepest, authors_prefill)


if TYPE_CHECKING:  # the type checker holds the head to the engine's interface
    _engine_calls: type[SpeculationHead[AuthorsCache]] = AuthorsHead
