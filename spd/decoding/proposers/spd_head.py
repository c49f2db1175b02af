"""The SPD-head proposer: a trained input-state SPD head queried once for all bottom nodes of the tree, each with its
root path at its current depths (docs/method.md §3, §6).

Shape suffixes: N tree nodes, L nodes of the bottom level, K candidates per node, D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch

from ...errors import SpdInputError
from ...heads.config import check_compatible
from ...heads.draft_vocab import check_draft_vocab
from ...heads.memory import CacheView, PooledSpeculatorCache, SpeculatorCache, SpeculatorPool
from ...heads.speculator import Speculator
from ...target.staging import StagedModel
from ..tree import Level, TokenTree


def path_rows(tree: TokenTree, levels: list[Level]) -> list[torch.Tensor]:
    """Per level in flight, the row (within the level) of each bottom node's ancestor in it, ``(L,)`` each: a bottom
    node has exactly one ancestor (or itself) in every level above it."""
    if tree.is_chain:
        return [torch.zeros(1, dtype=torch.long)] * len(levels)
    ancestors_LN = tree.mask()[tree.bottom_level()]
    return [ancestors_LN[:, level.start : level.start + level.size].float().argmax(dim=1) for level in levels]


class SpdHeadProposer:
    """Proposer (b): a trained input-state SPD head with width W (the paper's W = 4).

    For each node of the bottom level the head is queried as in the chain engine, with the node's root
    path as the trailing rows (each at its level's current depth, docs/method.md §3) after the head's cache
    of committed rows; the bottom nodes are one batch. The head's cache only ever holds committed rows
    (the root's row joins it after the root left stage n, before the next query), so pruning and misses need no
    rollback. :meth:`expand_many` queries the proposers of many requests sharing the head in one call.
    Only the SPD configuration (input-state schedule, max depth n) has tree semantics; the output-state
    ablation and PPSD are refused.
    """

    chain_only = False  # it has tree semantics
    batches = True  # (Proposer: optional capabilities)
    pooled = True
    schedule = "input"

    def __init__(self, head: Speculator, staged: StagedModel, children: int = 4, mode: str = "tree", tokenizer=None):
        """``mode`` names the CLI mode in the errors of the fit checks; ``tokenizer`` (optional) is checked against a
        draft vocabulary's."""
        if not isinstance(head, Speculator):
            raise SpdInputError("SpdHeadProposer takes our own heads; the SPD authors' heads are a HeadProposer")
        check_compatible(head.config, staged, mode=mode)
        check_draft_vocab(head, staged.vocab_size, tokenizer)
        cfg = head.config
        if cfg.schedule != "input" or cfg.max_depth != cfg.n_stages:
            raise SpdInputError(
                f"the tree mode needs an SPD head (input-state schedule, max depth n), but this head "
                f"has schedule '{cfg.schedule}' and max depth {cfg.max_depth}; use --mode spd for it"
            )
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
        self.cache: SpeculatorCache | None = None  # the request's, from start()
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
            assert isinstance(self.cache, PooledSpeculatorCache)  # start() took it from the pool
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
        assert cache is not None, "start() comes first"
        if self.pending:
            head.append_memory(cache, head.features(cfg.max_depth, self._pending_rows())[None])
            self.pending = []
        path, query = self._path(tree, context, levels)
        rows = [(depth, head.features(depth, anchors)) for depth, anchors in path]
        query_LD = rows[-1][1] if query is None else head.features(cfg.offset, query)
        view: SpeculatorCache | CacheView = cache
        if query_LD.shape[0] > 1:  # one query per bottom node over the same cached rows
            view = cache.expand(query_LD.shape[0])
        # Over the head's own outputs X (V, or its draft vocabulary: ``ids`` maps them to target ids).
        return torch.log_softmax(head.logits(head.query(view, rows, query_LD)).float(), dim=-1)

    def batch_key(self) -> int:
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposers.propose_many`)."""
        return id(self.head)

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose proposers share one head (``items``: their
        :class:`~spd.decoding.driver.Propose` work), in one head call: the rows of one depth of every request go
        through the head's FC together, then :meth:`Speculator.query_many` and one LM head. Each request's
        ``(L, X)``, equal to its own :meth:`expand` up to fp32 rounding."""
        head = items[0].proposer.head
        cfg = head.config
        waiting = [item.proposer for item in items if item.proposer.pending]
        if waiting:  # the rows committed since each request's last query, all through the head at once
            rows = head.features_many(cfg.max_depth, [source._pending_rows() for source in waiting])
            head.append_memory_many([source.cache for source in waiting], rows)
            for source in waiting:  # cached only now: if anything above raised, each request asked alone has them
                source.pending = []
        paths = [item.proposer._path(item.tree, item.context, item.levels) for item in items]
        trailing = head.trailing_features([path for path, _ in paths])
        queries = [
            rows[-1][1] if query is None else head.features(cfg.offset, query)
            for rows, (_, query) in zip(trailing, paths)
        ]
        out_BD = head.query_many([item.proposer.cache for item in items], trailing, queries)
        logprobs_BX = torch.log_softmax(head.logits(out_BD).float(), dim=-1)
        return list(logprobs_BX.split([query.shape[0] for query in queries]))

    def _path(
        self, tree: TokenTree, context: list[int], levels: list[Level]
    ) -> tuple[list[tuple[int, dict[int, torch.Tensor]]], dict[int, torch.Tensor] | None]:
        """The trailing rows of the bottom nodes' query, root first, as ``(depth, anchors (L, D) each)``; and the
        bottom level's anchors at the query's depth where it already went deeper (a prune left the tree shallow),
        else None (the last row is the query)."""
        cache, anchors_by_depth = self.cache, self.anchors_by_depth
        assert cache is not None, "start() comes first"
        if cache.length + len(self.pending) != len(context):
            raise RuntimeError("speculator cache and committed tokens are out of step")
        path = []
        # A chain's levels are one node each: their anchors are the path's rows as they are (no gather).
        picks = [None] * len(levels) if tree.is_chain else path_rows(tree, levels)
        for level, pick_L in zip(levels, picks):
            depth = min(level.depth, self.max_depth)
            if pick_L is not None:
                pick_L = pick_L.to(level.hidden_1TD.device)
            path.append(
                (
                    depth,
                    {
                        a: level.anchors[a] if pick_L is None else level.anchors[a][pick_L]
                        for a in anchors_by_depth[depth]
                    },
                )
            )
        if path[-1][0] == self.offset:
            return path, None
        return path, {a: levels[-1].anchors[a] for a in anchors_by_depth[self.offset]}

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Nothing to do: the root's row joins the cache after it is committed (:meth:`commit_root`)."""

    def commit_root(self, root: Level) -> None:
        """The root left stage n: its row at full depth joins the head's cache (it is committed either way), before
        the next query (:meth:`expand_many` caches the rows of many requests together)."""
        self.pending.append({a: root.anchors[a] for a in self.prefill_anchors})

    def _pending_rows(self) -> dict[int, torch.Tensor]:
        """The anchors of the committed rows not yet cached, ``(P, D)`` each, oldest first (the caller empties
        ``pending`` once they are in the cache)."""
        pending = self.pending
        if len(pending) == 1:  # one row since the last query (the usual case): nothing to join
            return pending[0]
        return {a: torch.cat([anchors[a] for anchors in pending]) for a in pending[0]}

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: the cache holds committed rows only."""

    def reset(self, committed: int) -> None:
        """Nothing to do: the cache holds committed rows only."""
