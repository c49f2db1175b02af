"""The generic head proposer: any head through its engine calls (:class:`spd.heads.interface.SpeculationHead`), one
query per bottom node: the SPD authors' heads at any width, and our heads' output-state and PPSD schedules (chains
only).

Shape suffixes: L nodes of the bottom level, V vocabulary.
"""

from __future__ import annotations

import torch

from ...errors import SpdInputError
from ...heads.config import check_compatible
from ...heads.draft_vocab import check_draft_vocab
from ...heads.interface import HeadCache, InFlightToken, SpeculationHead
from ...heads.speculator import Speculator
from ...target.staging import StagedModel
from ..tree import Level, TokenTree
from .spd_head import path_rows


class HeadProposer:
    """Proposer (c): any head through its engine calls (:class:`spd.heads.interface.SpeculationHead`), one query per
    bottom node: the SPD authors' released heads
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

    batches = True  # (Proposer: optional capabilities)
    pooled = False

    def __init__(
        self, head: SpeculationHead, staged: StagedModel, children: int = 4, mode: str = "tree", tokenizer=None
    ):
        """``mode`` names the CLI mode in the errors of the fit checks; ``tokenizer`` (optional) is checked against a
        draft vocabulary's."""
        cfg = head.config
        check_compatible(cfg, staged, mode=mode)
        if isinstance(head, Speculator):
            check_draft_vocab(head, staged.vocab_size, tokenizer)
        self.head = head
        self.schedule = cfg.schedule
        # A head that keeps rows before they leave stage n caches rows of tokens still in flight: chains only.
        self.chain_only = self.schedule != "input" or cfg.max_depth != cfg.n_stages
        self.ids = None  # its logits are spread over the target's vocabulary (-inf outside a draft vocabulary)
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.children = min(children, cfg.vocab_size)
        self.needed_anchors = tuple(head.needed_anchors())
        self.prefill_anchors = tuple(head.prefill_anchors())
        self.num_layers = cfg.num_layers
        self.cache: HeadCache | None = None  # the request's, from start()
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
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposers.propose_many`)."""
        return id(self.head)

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose proposers share one head (``items``: their
        :class:`~spd.decoding.driver.Propose` work): every bottom node of every request in one
        ``propose_logits_many`` call of the head. Each request's ``(L, V)``, equal to its own :meth:`expand` up to
        fp32 rounding."""
        caches, paths, sizes = [], [], []
        for item in items:
            nodes = item.proposer._paths(item.tree, item.context, item.levels)
            caches += [item.proposer.cache] * len(nodes)
            paths += nodes
            sizes.append(len(nodes))
        logits_BV = items[0].proposer.head.propose_logits_many(caches, paths)
        return list(torch.log_softmax(logits_BV.float(), dim=-1).split(sizes))

    def _paths(self, tree: TokenTree, context: list[int], levels: list[Level]) -> list[list[InFlightToken]]:
        """Each bottom node's tokens in flight, root first (``position``, ``depth``, ``anchors`` (1, D) each): the
        ``inflight`` argument of the head's ``propose_logits``."""
        if self.committed != len(context):
            raise RuntimeError("the head and the committed tokens are out of step")
        picks = [pick_L.tolist() for pick_L in path_rows(tree, levels)]
        # levels[i] holds the nodes i levels below the root (at committed + i)
        return [
            [
                InFlightToken(
                    position=self.committed + i,
                    depth=level.depth,
                    anchors={a: h[pick[node] : pick[node] + 1] for a, h in level.anchors.items()},
                )
                for i, (level, pick) in enumerate(zip(levels, picks))
            ]
            for node in range(len(picks[0]))
        ]

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Rows that reached the depth the head keeps join its cache (one-node levels: a deeper level's nodes never
        reach it before they are alone on their level)."""
        tokens = [
            InFlightToken(
                position=committed + int(tree.depths_N[level.start]),
                depth=level.depth,
                anchors={a: h[:1] for a, h in level.anchors.items()},
            )
            for level in levels
            if level.size == 1
        ]
        self.head.retire(self.cache, tokens)

    def commit_root(self, root: Level) -> None:
        """The root left stage n (the head saw it in :meth:`advanced`)."""
        self.committed += 1

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: a tree's head caches committed rows only, and a chain's hit keeps every node."""

    def reset(self, committed: int) -> None:
        """Miss: rows after the committed ones are dropped (for the authors' heads: as their chain's flush, the next
        query has no evicted row)."""
        assert self.cache is not None, "start() comes first"
        self.cache.truncate(committed)
