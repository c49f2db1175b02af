"""Proposer (d): our head trained with ``variant=eagle``, the serial drafter of ``--mode sd`` (the paper's EAGLE-3 row).

A :class:`~spd.decoding.proposers.Proposer` on the *serial* schedule (docs/method.md §2): no pipeline, the whole target
is one stage. Every row the target has run enters the head's memory with the target's features at full depth (low,
middle and last layer); the rows the target has not run, the newest committed token (the tree's root) and the head's
own drafts, are the trailing rows at depth 0 (``g^0``: the token's embedding in the target through ``FC_0``), the
j-th draft seeing j of them, as in training. Serial drafting (:mod:`spd.decoding.sd`) grows a chain with
:meth:`SerialHeadProposer.expand` while the target is idle, then hands each row the target verified and kept to
:meth:`SerialHeadProposer.commit_root`.

Shape suffixes: T rows, D hidden, V the target's vocabulary.
"""

from __future__ import annotations

from typing import cast

import torch

from ...errors import SpdInputError
from ...heads.config import SpeculatorConfig, check_compatible
from ...heads.draft_vocab import check_draft_vocab
from ...heads.memory import SpeculatorCache
from ...heads.speculator import Speculator
from ...target.staging import StagedModel
from ..tree import Level, TokenTree


class SerialHeadProposer:
    """Our head trained with variant=eagle, drafting a chain from the target's cached rows and the tokens it has
    not run (see the module docstring). Its cache holds only rows the target ran and kept, so a rejection needs no
    rollback."""

    chain_only = False  # it has tree semantics
    batches = False  # (Proposer: optional capabilities)
    pooled = False
    schedule = "serial"
    needed_anchors: tuple[int, ...] = ()  # tokens in flight enter through their embeddings, not the target's states
    ids = None  # its log-probabilities are over the target's vocabulary (-inf outside a draft vocabulary)
    children = 1  # a chain

    def __init__(self, head: torch.nn.Module, target: StagedModel):
        if not isinstance(head, Speculator):
            raise SpdInputError(
                "--mode sd takes our heads trained with variant=eagle; the SPD authors' heads run in --mode spd"
            )
        check_compatible(cast(SpeculatorConfig, head.config), target, mode="sd")  # a Speculator's own config
        check_draft_vocab(head, target.vocab_size)
        self.head, self.target, self.num_layers = head, target, head.config.num_layers
        self.prefill_anchors = tuple(head.prefill_anchors())
        self._dtype = next(head.parameters()).dtype  # the target's states are cast to it
        self.cache: SpeculatorCache | None = None

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Every prompt position enters the head's cache at full depth."""
        self.cache = self.head.new_cache(capacity=capacity)
        self.head.prefill_memory(self.cache, {a: h.to(self._dtype) for a, h in anchors.items()})

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The head's log-probabilities after the chain's bottom node, ``(1, V)``: the committed tokens the target
        has not run and the root path, at depth 0, after the cached rows (``levels`` is empty: nothing is in
        flight in the target)."""
        if not tree.is_chain:
            raise RuntimeError("the serial head drafts chains only")
        cache = self.cache
        assert cache is not None  # start made it
        tokens = context[cache.length :] + tree.path(len(tree) - 1).tolist()
        embedding_TD = self.target.embed(torch.tensor([tokens], device=self.target.device))[0].to(self._dtype)
        rows_TD = self.head.features(0, {0: embedding_TD})
        trailing = [(0, rows_TD[i : i + 1]) for i in range(len(tokens))]
        return torch.log_softmax(self.head.vocab_logits(self.head.query(cache, trailing, rows_TD[-1:])).float(), dim=-1)

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Nothing to do: the head reads no state of tokens in flight."""

    def commit_root(self, root: Level) -> None:
        """The target ran and kept the row of ``root`` (its anchors ``H^l`` (1, D)): it joins the cache at full
        depth."""
        depth = self.head.config.max_depth
        assert self.cache is not None  # start made it
        self.head.append_memory(
            self.cache,
            self.head.features(depth, {a: root.anchors[a].to(self._dtype) for a in self.head.config.anchors[depth]})[
                None
            ],
        )

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """Nothing to do: the cache holds kept rows only."""

    def reset(self, committed: int) -> None:
        """Nothing to do: the cache holds kept rows only."""
