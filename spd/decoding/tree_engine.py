"""The token-tree engine (docs/method.md §6) and the token sources (:class:`spd.decoding.proposer.Proposer`).

The engine runs the step loop of :mod:`spd.decoding.loop` with a proposer of width ``W`` (``--tree-width``, fixed or
adaptive: :mod:`spd.decoding.tree_width`) and at most ``K`` children per node (``--tree-children``). With
``W = 1`` the tree is a chain: the chain engine (:class:`spd.decoding.engine.PipelineEngine`) is this loop at
width 1.

Three token sources implement the proposer interface (``start``, ``expand`` - log-probabilities ``(L, X)`` over
the source's outputs, which ``ids`` maps to target ids when they are not the target's vocabulary -
``advanced``, ``commit_root``, ``prune``, ``reset``): :class:`DraftModelSource`, a small causal LM with the
target's tokenizer and its own KV cache over committed tokens and tree nodes, pruned with the tree (the
training-free SpecPipe/PipeDec mode); :class:`SpdHeadSource`, a trained input-state SPD head queried once for all
bottom nodes, each with its root path at its current depths; and :class:`HeadSource`, any head through its
engine calls (``prefill_anchors``, ``prefill_memory``, ``retire``, ``propose_logits``), one query per bottom
node: the SPD authors' heads at any width, and our heads' output-state and PPSD schedules (chains only).

Shape suffixes: T nodes of one level, N tree nodes, L nodes of the bottom level, K candidates per node,
D hidden size, V vocabulary; a leading 1 is the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from .request import OneModeEngine
from ..errors import SpdInputError
from .generation import GenerationOutput, OnToken
from .loop import LocalStages, StepLoop, verify_sampled
from .sampling import SamplingParams
from .stats import TreeStats
from ..heads.draft_vocab import check_draft_vocab
from ..heads.config import check_compatible
from ..heads.memory import SpeculatorPool
from ..heads.speculator import Speculator
from ..target.kv_pool import KVPool, Region
from ..target.ragged import Segment, run_ragged
from ..target.staging import StageKVCache, StagedModel, load_target_tokenizer
from .tree import Level, TokenTree
from .tree_width import AdaptiveWidth, FixedWidth, tree_width

CANDIDATES = ("auto", "sampled", "top-k")  # how children are chosen at T > 0 (greedy: always top-k)


def check_same_vocabulary(target: StagedModel, draft: StagedModel, target_tokenizer=None,
                          draft_tokenizer=None) -> int:
    """Refuse a draft model whose token ids mean something else than the target's; return the usable vocabulary.

    With both tokenizers the token-to-id maps must be equal; the models' output sizes may then differ
    only by padding rows beyond the tokenizer (those ids are never proposed).
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            raise SpdInputError(
                f"the draft model's tokenizer ('{getattr(draft_tokenizer, 'name_or_path', '?')}', {len(d_vocab)} "
                f"tokens) differs from the target's ('{getattr(target_tokenizer, 'name_or_path', '?')}', "
                f"{len(t_vocab)} tokens); the tree mode needs a draft model with the target's tokenizer")
        if draft.vocab_size != target.vocab_size and len(t_vocab) <= min(draft.vocab_size, target.vocab_size):
            return min(draft.vocab_size, target.vocab_size)
    if draft.vocab_size != target.vocab_size:
        raise SpdInputError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens but the target's has {target.vocab_size}; "
            "the tree mode needs a draft model with the target's tokenizer and vocabulary")
    return target.vocab_size


def load_draft_model(draft: str, revision: str | None, dtype: torch.dtype,
                     device: str | torch.device) -> tuple[StagedModel, object | None]:
    """A draft model (directory or hub id) as a 1-stage StagedModel, and its tokenizer (None: a model-only
    directory, whose vocabulary size is then the only thing :func:`check_same_vocabulary` can compare)."""
    staged = StagedModel.from_pretrained(draft, n_stages=1, revision=revision, dtype=dtype, device=device)
    try:
        return staged, load_target_tokenizer(draft, revision)
    except SpdInputError:
        return staged, None


# --------------------------------------------------------------------------------------- token sources


class DraftModelSource:
    """Token source (a): a small causal LM (one 1-stage :class:`StagedModel`) proposing tree levels, no training.

    Its KV cache holds the committed tokens and the tree nodes it has run (BFS prefix), like a target
    stage; it runs each node once and keeps the node's output, so that a bottom level
    left shallow by a prune is expanded again without recomputation (its log-probabilities per node, N x V
    floats: at most ``n * W + 1`` rows). Committed tokens it never ran
    (a root committed before it was expanded) are run first, as a plain causal chunk.

    In a batched pipeline (:mod:`spd.decoding.batch`) each request's copy keeps its draft cache in a region of one
    pool (:meth:`new_pool`, :meth:`use_pool`), so that :meth:`expand_many` runs the draft for every request in one
    ragged call (:func:`spd.target.ragged.run_ragged`) and one LM-head call.
    """

    needed_anchors: tuple[int, ...] = ()
    prefill_anchors: tuple[int, ...] = ()
    ids = None  # its outputs are target token ids
    schedule = "none"
    num_layers = 0  # not a head: the step cost model assumes the draft is hidden behind a stage

    def __init__(self, draft: StagedModel, target: StagedModel, children: int = 4, target_tokenizer=None,
                 draft_tokenizer=None):
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.vocab = check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
        self.draft = draft
        self.children = min(children, self.vocab)
        self.cache: StageKVCache | None = None
        self.pool: KVPool | None = None  # a batched pipeline's pool of draft KV, shared by its requests' copies
        self.region: Region | None = None  # this request's rows of it
        self._empty()

    def _empty(self) -> None:
        # Log-probabilities after each tree node run so far (rows = tree indices 0..held-1).
        self.logprobs_NX = torch.zeros(0, self.vocab, device=self.draft.device)

    def new_pool(self, rows: int, slots: int) -> KVPool:
        """A pool of ``rows`` rows of draft KV for a batched pipeline whose requests' regions span as many rows (and
        who are at most ``slots``)."""
        return KVPool(self.draft, rows)

    def use_pool(self, pool: KVPool, region: Region) -> None:
        """This request's draft cache will be ``region`` of ``pool`` (before :meth:`start`)."""
        self.pool, self.region = pool, region

    def leave_pool(self) -> None:
        """The request ended: nothing to give back (its region is the target pool's, given back with it)."""

    def batch_key(self) -> int | None:
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposer.propose_many`)."""
        return None if self.pool is None else id(self.pool)

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Prefill the draft's cache with the prompt."""
        self.cache = (self.draft.new_caches(capacity=capacity)[0] if self.pool is None
                      else self.pool.cache(0, self.region))
        self._empty()
        self.draft.forward_stages(torch.tensor([prompt_ids], device=self.draft.device), [self.cache])

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The draft's log-probabilities after each bottom node, ``(L, X)``; ``context`` = committed tokens."""
        draft, cache = self.draft, self.cache
        missed = self._missed(context)
        if missed is not None:
            draft.run_stage(0, missed.hidden_1TD, cache)
        nodes = self._new_nodes(tree, len(context))
        if nodes is not None:
            out = draft.run_stage(0, nodes.hidden_1TD, cache, nodes.positions_T[None], tree_mask_TN=nodes.tree_mask_TN)
            self._took(draft.logits(out.hidden_BTD[0]))
        return self.logprobs_NX[tree.bottom_level().to(self.logprobs_NX.device)]

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose draft caches share one pool (``items``: their
        :class:`~spd.decoding.loop.Propose` work): one ragged call over the committed tokens some have not run,
        one over every request's new tree nodes, one LM-head call. Each request's ``(L, X)``, equal to its own
        :meth:`expand` up to fp32 rounding."""
        first = items[0].source
        draft, pool = first.draft, first.pool
        missed = [m for m in (item.source._missed(item.context) for item in items) if m is not None]
        if missed:
            run_ragged(pool, 0, missed)
        owners, segments = [], []
        for item in items:
            nodes = item.source._new_nodes(item.tree, len(item.context))
            if nodes is not None:
                owners.append(item.source)
                segments.append(nodes)
        if segments:
            outs = run_ragged(pool, 0, segments)
            logits_SV = draft.logits(torch.cat([out.hidden_BTD[0] for out in outs]))
            for source, logits_TV in zip(owners, logits_SV.split([seg.size for seg in segments])):
                source._took(logits_TV)
        return [item.source.logprobs_NX[item.tree.bottom_level().to(item.source.logprobs_NX.device)]
                for item in items]

    def _missed(self, context: list[int]) -> Segment | None:
        """The committed tokens the draft has not run (a root committed before it was expanded), or None."""
        if self.cache.length >= len(context):
            return None
        ids_1T = torch.tensor([context[self.cache.length:]], device=self.draft.device)
        return Segment(self.cache, self.draft.embed(ids_1T))

    def _new_nodes(self, tree: TokenTree, committed: int) -> Segment | None:
        """The tree's nodes the draft has not run (after the ``committed`` tokens), or None."""
        held = self.cache.length - committed
        if held >= len(tree):
            return None
        ids_1T = tree.tokens_N[held:][None].to(self.draft.device)
        positions_T = tree.positions(committed)[held:].to(self.draft.device)
        return Segment(self.cache, self.draft.embed(ids_1T), positions_T, tree.mask()[held:])

    def _took(self, logits_TV: torch.Tensor) -> None:
        """The draft's logits after the new nodes: their log-probabilities join the held ones."""
        logprobs_TX = torch.log_softmax(logits_TV.float()[:, :self.vocab], dim=-1)
        self.logprobs_NX = torch.cat([self.logprobs_NX, logprobs_TX])

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Nothing to do: the draft reads no target state."""

    def commit_root(self, root: Level) -> None:
        """Nothing to do: the root's row becomes committed in :meth:`prune` / :meth:`reset`."""

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root (row ``committed``) is committed and the tree keeps the subtree ``kept`` (old indices)."""
        if self.cache.length > committed:  # the draft ran the root (else it catches up in expand)
            StagedModel.prune_tree([self.cache], committed, kept)
        self.logprobs_NX = self.logprobs_NX[kept[kept < self.logprobs_NX.shape[0]].to(self.logprobs_NX.device)]

    def reset(self, committed: int) -> None:
        """Miss: drop the tree; the cache keeps at most the ``committed`` committed rows."""
        self.cache.truncate(committed)
        self._empty()


def path_rows(tree: TokenTree, levels: list[Level]) -> list[torch.Tensor]:
    """Per level in flight, the row (within the level) of each bottom node's ancestor in it, ``(L,)`` each: a bottom
    node has exactly one ancestor (or itself) in every level above it."""
    if tree.is_chain:
        return [torch.zeros(1, dtype=torch.long)] * len(levels)
    ancestors_LN = tree.mask()[tree.bottom_level()]
    return [ancestors_LN[:, level.start:level.start + level.size].float().argmax(dim=1) for level in levels]


class SpdHeadSource:
    """Token source (b): a trained input-state SPD head with width W (the paper's W = 4).

    For each node of the bottom level the head is queried as in the chain engine, with the node's root
    path as the trailing rows (each at its level's current depth, docs/method.md §3) after the head's cache
    of committed rows; the bottom nodes are one batch. The head's cache only ever holds committed rows
    (the root's row joins it after the root left stage n, before the next query), so pruning and misses need no
    rollback. :meth:`expand_many` queries the sources of many requests sharing the head in one call.
    Only the SPD configuration (input-state schedule, max depth n) has tree semantics; the output-state
    ablation and PPSD are refused.
    """

    schedule = "input"

    def __init__(self, head: Speculator, staged: StagedModel, children: int = 4, mode: str = "tree", tokenizer=None):
        """``mode`` names the CLI mode in the errors of the fit checks; ``tokenizer`` (optional) is checked against a
        draft vocabulary's."""
        if not isinstance(head, Speculator):
            raise SpdInputError("SpdHeadSource takes our own heads; the SPD authors' heads are a HeadSource")
        check_compatible(head.config, staged, mode=mode)
        check_draft_vocab(head, staged.vocab_size, tokenizer)
        cfg = head.config
        if cfg.schedule != "input" or cfg.max_depth != cfg.n_stages:
            raise SpdInputError(f"the tree mode needs an SPD head (input-state schedule, max depth n), but this head "
                                f"has schedule '{cfg.schedule}' and max depth {cfg.max_depth}; use --mode spd for it")
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.head = head
        self.vocab = cfg.vocab_size
        self.ids = head.draft_ids  # None, or the target ids of a draft-vocabulary head's outputs
        self.children = min(children, cfg.vocab_size)
        self.needed_anchors = tuple(head.needed_anchors())
        self.prefill_anchors = tuple(cfg.anchors[cfg.max_depth])
        self.num_layers = cfg.num_layers
        # The config's settings read on every query, read once (a config's attributes are slow to read).
        self.max_depth, self.offset, self.anchors_by_depth = cfg.max_depth, cfg.offset, cfg.anchors
        self.cache = None
        self.pool: SpeculatorPool | None = None  # a batched pipeline's memory pool, shared by its requests' copies
        self.pending: list[dict[int, torch.Tensor]] = []  # committed rows' anchors, cached before the next query

    def new_pool(self, rows: int, slots: int) -> SpeculatorPool:
        """The head's memory for a batched pipeline of up to ``slots`` requests (``rows``: the target pool's, unused):
        one slot per request (:class:`~spd.heads.memory.SpeculatorPool`), read by :meth:`expand_many` in place."""
        return self.head.new_pool(slots)

    def use_pool(self, pool: SpeculatorPool, region=None) -> None:
        """This request's head cache will be a slot of ``pool`` (before :meth:`start`)."""
        self.pool = pool

    def leave_pool(self) -> None:
        """The request ended: its slot goes back to the pool."""
        if self.pool is not None and self.cache is not None:
            self.pool.release(self.cache)
        self.cache = None

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Every prompt position enters the head's cache at full depth."""
        head = self.head
        self.cache = head.new_cache(capacity=capacity) if self.pool is None else self.pool.cache(capacity)
        self.pending = []
        head.append_memory(self.cache, head.features(head.config.max_depth, anchors))

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The head's log-probabilities after each bottom node, ``(L, X)``: one batched query over their paths."""
        head, cfg, cache = self.head, self.head.config, self.cache
        if self.pending:
            head.append_memory(cache, head.features(cfg.max_depth, self._take_pending())[None])
        path, query = self._path(tree, context, levels)
        rows = [(depth, head.features(depth, anchors)) for depth, anchors in path]
        query_LD = rows[-1][1] if query is None else head.features(cfg.offset, query)
        view = cache
        if query_LD.shape[0] > 1:  # one query per bottom node over the same cached rows
            b = query_LD.shape[0]
            view = SimpleNamespace(length=cache.length,
                                   keys=[k[:, :, :cache.length].expand(b, -1, -1, -1) for k in cache.keys],
                                   values=[v[:, :, :cache.length].expand(b, -1, -1, -1) for v in cache.values])
        # Over the head's own outputs X (V, or its draft vocabulary: ``ids`` maps them to target ids).
        return torch.log_softmax(head.logits(head.query(view, rows, query_LD)).float(), dim=-1)

    def batch_key(self) -> int:
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposer.propose_many`)."""
        return id(self.head)

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose sources share one head (``items``: their
        :class:`~spd.decoding.loop.Propose` work), in one head call: the rows of one depth of every request go
        through the head's FC together, then :meth:`Speculator.query_many` and one LM head. Each request's
        ``(L, X)``, equal to its own :meth:`expand` up to fp32 rounding."""
        head = items[0].source.head
        cfg = head.config
        waiting = [item.source for item in items if item.source.pending]
        if waiting:  # the rows committed since each request's last query, all through the head at once
            rows = head.features_many(cfg.max_depth, [source._take_pending() for source in waiting])
            head.append_memory_many([source.cache for source in waiting], rows)
        paths = [item.source._path(item.tree, item.context, item.levels) for item in items]
        trailing = head.trailing_features([path for path, _ in paths])
        queries = [rows[-1][1] if query is None else head.features(cfg.offset, query)
                   for rows, (_, query) in zip(trailing, paths)]
        out_BD = head.query_many([item.source.cache for item in items], trailing, queries)
        logprobs_BX = torch.log_softmax(head.logits(out_BD).float(), dim=-1)
        return list(logprobs_BX.split([query.shape[0] for query in queries]))

    def _path(self, tree: TokenTree, context: list[int],
              levels: list[Level]) -> tuple[list[tuple[int, dict[int, torch.Tensor]]], dict[int, torch.Tensor] | None]:
        """The trailing rows of the bottom nodes' query, root first, as ``(depth, anchors (L, D) each)``; and the
        bottom level's anchors at the query's depth where it already went deeper (a prune left the tree shallow),
        else None (the last row is the query)."""
        cache, anchors_by_depth = self.cache, self.anchors_by_depth
        if cache.length + len(self.pending) != len(context):
            raise RuntimeError("speculator cache and committed tokens are out of step")
        path = []
        # A chain's levels are one node each: their anchors are the path's rows as they are (no gather).
        picks = [None] * len(levels) if tree.is_chain else path_rows(tree, levels)
        for level, pick_L in zip(levels, picks):
            depth = min(level.depth, self.max_depth)
            if pick_L is not None:
                pick_L = pick_L.to(level.hidden_1TD.device)
            path.append((depth, {a: level.anchors[a] if pick_L is None else level.anchors[a][pick_L]
                                 for a in anchors_by_depth[depth]}))
        if path[-1][0] == self.offset:
            return path, None
        return path, {a: levels[-1].anchors[a] for a in anchors_by_depth[self.offset]}

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Nothing to do: the root's row joins the cache after it is committed (:meth:`commit_root`)."""

    def commit_root(self, root: Level) -> None:
        """The root left stage n: its row at full depth joins the head's cache (it is committed either way), before
        the next query (:meth:`expand_many` caches the rows of many requests together)."""
        self.pending.append({a: root.anchors[a] for a in self.prefill_anchors})

    def _take_pending(self) -> dict[int, torch.Tensor]:
        """The anchors of the committed rows not yet cached, ``(P, D)`` each, oldest first; none are left after."""
        pending, self.pending = self.pending, []
        if len(pending) == 1:  # one row since the last query (the usual case): nothing to join
            return pending[0]
        return {a: torch.cat([anchors[a] for anchors in pending]) for a in pending[0]}

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: the cache holds committed rows only."""

    def reset(self, committed: int) -> None:
        """Nothing to do: the cache holds committed rows only."""


class HeadSource:
    """Token source (c): any head through its engine calls (``prefill_anchors``, ``prefill_memory``, ``retire``,
    ``propose_logits``), one query per bottom node: the SPD authors' released heads
    (:class:`spd.heads.published.authors_head.AuthorsHead`) at any width, on the decode schedule they were trained
    for, and our heads on the output-state and PPSD schedules (width 1: a chain).

    Each bottom node is queried as a chain would query its newest token: the node's root path are the in-flight
    tokens (each at its level's current depth, at position committed + its depth in the tree) and the positions
    before it come from the head's cache. The head caches a row when it reaches the depth the head keeps
    (:meth:`advanced`): for the authors' heads and SPD heads that is stage ``n``, so the cache holds committed rows
    only; an output-state or PPSD head keeps rows after stage 1 already, so its cache may hold rows of tokens in
    flight, which a miss truncates (their schedules have no tree semantics: width 1 only). For the authors' heads
    the token that left stage n last is the evicted row of the next query (docs/method.md lists their schedule);
    with ``W = 1`` this is their chain, step for step (their tree at T > 0 is not lossless; the tree and its
    verification here are ours). The bottom nodes are queried one after another (their tower has no batch of
    paths); a node's query is the same whichever came before it.
    """

    def __init__(self, head, staged: StagedModel, children: int = 4, mode: str = "tree", tokenizer=None):
        cfg = head.config
        check_compatible(cfg, staged, mode=mode)
        if isinstance(head, Speculator):
            check_draft_vocab(head, staged.vocab_size, tokenizer)
        self.head = head
        self.schedule = getattr(cfg, "schedule", "input")
        # A head that keeps rows before they leave stage n caches rows of tokens still in flight: chains only.
        self.chain_only = self.schedule != "input" or getattr(cfg, "max_depth", cfg.n_stages) != cfg.n_stages
        self.ids = None  # its logits are spread over the target's vocabulary (-inf outside a draft vocabulary)
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.children = min(children, cfg.vocab_size)
        self.needed_anchors = tuple(head.needed_anchors())
        self.prefill_anchors = tuple(head.prefill_anchors())
        self.num_layers = cfg.num_layers
        self.cache = None
        self.committed = 0

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        self.cache = self.head.new_cache(capacity=capacity)
        self.head.prefill_memory(self.cache, anchors)
        self.committed = len(prompt_ids)

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The head's log-probabilities after each bottom node, ``(L, V)``: one query per bottom node."""
        rows = [self.head.propose_logits(self.cache, path) for path in self._paths(tree, context, levels)]
        return torch.log_softmax(torch.cat(rows).float(), dim=-1)

    def batch_key(self) -> int:
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposer.propose_many`)."""
        return id(self.head)

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose sources share one head (``items``: their
        :class:`~spd.decoding.loop.Propose` work): every bottom node of every request in one
        ``propose_logits_many`` call of the head. Each request's ``(L, V)``, equal to its own :meth:`expand` up to
        fp32 rounding."""
        caches, paths, sizes = [], [], []
        for item in items:
            nodes = item.source._paths(item.tree, item.context, item.levels)
            caches += [item.source.cache] * len(nodes)
            paths += nodes
            sizes.append(len(nodes))
        logits_BV = items[0].source.head.propose_logits_many(caches, paths)
        return list(torch.log_softmax(logits_BV.float(), dim=-1).split(sizes))

    def _paths(self, tree: TokenTree, context: list[int], levels: list[Level]) -> list[list[SimpleNamespace]]:
        """Each bottom node's in-flight slots, root first (``position``, ``depth``, ``anchors`` (1, D) each): the
        ``inflight`` argument of the head's ``propose_logits``."""
        if self.committed != len(context):
            raise RuntimeError("the head and the committed tokens are out of step")
        picks = [pick_L.tolist() for pick_L in path_rows(tree, levels)]
        # levels[i] holds the nodes i levels below the root (at committed + i)
        return [[SimpleNamespace(position=self.committed + i, depth=level.depth,
                                 anchors={a: h[pick[node]:pick[node] + 1] for a, h in level.anchors.items()})
                 for i, (level, pick) in enumerate(zip(levels, picks))]
                for node in range(len(picks[0]))]

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Rows that reached the depth the head keeps join its cache (one-node levels: a deeper level's nodes never
        reach it before they are alone on their level)."""
        slots = [SimpleNamespace(position=committed + int(tree.depths_N[level.start]), depth=level.depth,
                                 anchors={a: h[:1] for a, h in level.anchors.items()})
                 for level in levels if level.size == 1]
        self.head.retire(self.cache, slots)

    def commit_root(self, root: Level) -> None:
        """The root left stage n (the head saw it in :meth:`advanced`)."""
        self.committed += 1

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: a tree's head caches committed rows only, and a chain's hit keeps every node."""

    def reset(self, committed: int) -> None:
        """Miss: rows after the committed ones are dropped (for the authors' heads: as their chain's flush, the next
        query has no evicted row)."""
        self.cache.truncate(committed)




class TreeEngine(OneModeEngine):
    """Runs one request at a time through the staged target with a token tree fed by a token source."""

    mode, engine_name = "tree", "the tree engine"

    def __init__(self, staged: StagedModel, source: DraftModelSource | SpdHeadSource | HeadSource,
                 width: int | str | FixedWidth | AdaptiveWidth = 4, tokenizer=None,
                 stages: LocalStages | None = None, candidates: str = "auto", max_width: int = 8):
        """``width``: W, ``"auto"`` (:class:`spd.decoding.tree_width.AdaptiveWidth` up to ``max_width``) or a policy;
        ``candidates``: how children are chosen at T > 0 (``auto`` = ``sampled``; greedy always uses top-k)."""
        if candidates not in CANDIDATES:
            raise SpdInputError(f"unknown tree candidate rule '{candidates}'; expected one of: {', '.join(CANDIDATES)}")
        self.staged, self.source, self.tokenizer, self.candidates = staged, source, tokenizer, candidates
        self.policy = width if isinstance(width, (FixedWidth, AdaptiveWidth)) else \
            tree_width(width, source.children, max_width)
        if getattr(source, "chain_only", False) and self.policy.max_width > 1:
            raise SpdInputError(f"this head's schedule ('{source.schedule}', keeping rows before they leave stage n) "
                                "has no tree semantics; run it with --mode spd (or a tree width of 1)")
        self.width = "auto" if self.policy.adaptive else self.policy.width
        # Where the stages run: this process (default) or other processes (spd.runtime.remote.RemoteStages).
        self.stages = stages if stages is not None else LocalStages(staged)
        self.loop = StepLoop(staged, self.stages, self.policy, candidates)
        self.loop.verify_sampled = self._verify_sampled

    _verify_sampled = staticmethod(verify_sampled)  # how sampled children are verified (a test swaps in a control)

    @classmethod
    def from_pretrained(cls, target: str, draft: str, stages: int = 1, width: int = 4, children: int = 4,
                        revision: str | None = None, draft_revision: str | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        tokenizer: str | None = None, draft_tokenizer=None) -> "TreeEngine":
        """Load a target (cut into ``stages``) and a draft model (directories or hub ids) for the draft tree mode.

        ``draft_tokenizer`` (a loaded tokenizer) defaults to the draft directory's own, when it has one. The
        target's tokenizer is ``tokenizer`` or its own; without one, prompts are token ids.
        """
        staged = StagedModel.from_pretrained(target, n_stages=stages, revision=revision, dtype=dtype, device=device)
        tok = load_target_tokenizer(target, revision, tokenizer)
        draft_staged, own_tokenizer = load_draft_model(draft, draft_revision, dtype, device)
        source = DraftModelSource(draft_staged, staged, children, tok, draft_tokenizer or own_tokenizer)
        return cls(staged, source, width, tok)

    def run(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int, sampling: SamplingParams,
            eos_token_id: int | Sequence[int] | None = None,
            on_token: OnToken | None = None) -> GenerationOutput:
        """One request through the step loop (:mod:`spd.decoding.loop`; no EOS unless given)."""
        source, stats = self.request_parts()
        return self.loop.run(source, input_ids, max_new_tokens, sampling, eos_token_id, on_token, stats)

    def request_parts(self, use_head: bool = True) -> tuple[DraftModelSource | SpdHeadSource | HeadSource, TreeStats]:
        """The proposer and fresh statistics of one request."""
        source, policy = self.source, self.policy
        stats = TreeStats(mode="tree", prompt_tokens=0, schedule=source.schedule,
                          speculator_layers=source.num_layers,
                          source="draft" if isinstance(source, DraftModelSource) else "head", width=self.width,
                          children=policy.max_children,
                          accepted_by_sibling=[0] * max(policy.max_width, policy.max_children))
        return source, stats


LocalTreeStages = LocalStages  # the tree engine's back-end is the one stage back-end

def build_tree_engine(staged: StagedModel, head, tokenizer, draft_model: str | None, draft_revision: str | None,
                      width: int | str, children: int, dtype: torch.dtype, device: str | torch.device,
                      stages=None, candidates: str = "auto", max_width: int = 8) -> TreeEngine:
    """The tree engine with an SPD head of width W, or with a draft model (refused unless it shares the tokenizer).

    ``width`` is W or ``"auto"`` (adaptive up to ``max_width``); ``candidates`` the rule at T > 0 (see
    :class:`TreeEngine`); ``stages`` the stage backend (default: this process; :class:`spd.runtime.remote.RemoteStages`
    across processes).
    """
    if head is not None and not isinstance(head, Speculator):
        source = HeadSource(head, staged, children, tokenizer=tokenizer)
    elif head is not None:
        source = SpdHeadSource(head, staged, children, tokenizer=tokenizer)
    else:
        draft, draft_tokenizer = load_draft_model(draft_model, draft_revision, dtype, device)
        source = DraftModelSource(draft, staged, children, tokenizer, draft_tokenizer)
    return TreeEngine(staged, source, width, tokenizer, stages=stages, candidates=candidates, max_width=max_width)
