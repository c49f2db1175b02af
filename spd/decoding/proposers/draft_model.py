"""The draft-model proposer: a small causal LM with the target's tokenizer, its own KV cache over committed tokens and
tree nodes, pruned with the tree (the training-free SpecPipe/PipeDec mode; docs/method.md §6).

Shape suffixes: T nodes of one level, N tree nodes, L nodes of the bottom level, X the vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...errors import SpdInputError
from ...target.kv_cache import StageKVCache
from ...target.kv_pool import KVPool, Region
from ...target.ragged import run_ragged
from ...target.segments import Segment
from ...target.staging import StagedModel
from ...target.tokenizer import load_target_tokenizer
from ..tree import Level, TokenTree


def check_same_vocabulary(target: StagedModel, draft: StagedModel, target_tokenizer=None, draft_tokenizer=None) -> int:
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
                f"{len(t_vocab)} tokens); the tree mode needs a draft model with the target's tokenizer"
            )
        if draft.vocab_size != target.vocab_size and len(t_vocab) <= min(draft.vocab_size, target.vocab_size):
            return min(draft.vocab_size, target.vocab_size)
    if draft.vocab_size != target.vocab_size:
        raise SpdInputError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens but the target's has {target.vocab_size}; "
            "the tree mode needs a draft model with the target's tokenizer and vocabulary"
        )
    return target.vocab_size


class Draft(NamedTuple):
    """A loaded draft model: a 1-stage StagedModel and its tokenizer (None: a model-only directory, whose vocabulary
    size is then the only thing :func:`check_same_vocabulary` can compare)."""

    model: StagedModel
    tokenizer: object | None


def load_draft_model(draft: str, revision: str | None, dtype: torch.dtype, device: str | torch.device) -> Draft:
    """A draft model (directory or hub id) and its tokenizer, if it has one."""
    staged = StagedModel.from_pretrained(draft, n_stages=1, revision=revision, dtype=dtype, device=device)
    try:
        return Draft(staged, load_target_tokenizer(draft, revision))
    except SpdInputError:
        return Draft(staged, None)


class DraftModelProposer:
    """Proposer (a): a small causal LM (one 1-stage :class:`StagedModel`) proposing tree levels, no training.

    Its KV cache holds the committed tokens and the tree nodes it has run (BFS prefix), like a target
    stage; it runs each node once and keeps the node's output, so that a bottom level
    left shallow by a prune is expanded again without recomputation (its log-probabilities per node, N x V
    floats: at most ``n * W + 1`` rows). Committed tokens it never ran
    (a root committed before it was expanded) are run first, as a plain causal chunk.

    In a batched pipeline (:mod:`spd.decoding.batch`) each request's copy keeps its draft cache in a region of one
    pool (:meth:`new_pool`, :meth:`use_pool`), so that :meth:`expand_many` runs the draft for every request in one
    ragged call (:func:`spd.target.ragged.run_ragged`) and one LM-head call.
    """

    chain_only = False  # it has tree semantics
    batches = True  # (Proposer: optional capabilities)
    pooled = True
    needed_anchors: tuple[int, ...] = ()
    prefill_anchors: tuple[int, ...] = ()
    ids = None  # its outputs are target token ids
    schedule = "none"
    num_layers = 0  # not a head: the step cost model assumes the draft is hidden behind a stage

    def __init__(
        self, draft: StagedModel, target: StagedModel, children: int = 4, target_tokenizer=None, draft_tokenizer=None
    ):
        if children < 1:
            raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
        self.vocab = check_same_vocabulary(target, draft, target_tokenizer, draft_tokenizer)
        self.draft = draft
        self.children = min(children, self.vocab)
        self.cache: StageKVCache | None = None
        self.pool: KVPool | None = None  # a batched pipeline's pool of draft KV, shared by its requests' copies
        self.region: Region | None = None  # this request's rows of it
        self._empty()

    def _kv(self) -> StageKVCache:
        """This request's draft KV cache (:meth:`start` makes it)."""
        assert self.cache is not None, "the draft's cache comes with start()"
        return self.cache

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
        """Requests whose keys are equal are asked together (:func:`spd.decoding.proposers.propose_many`)."""
        return None if self.pool is None else id(self.pool)

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """Prefill the draft's cache with the prompt."""
        if self.pool is None:
            self.cache = self.draft.new_caches(capacity=capacity)[0]
        else:
            assert self.region is not None  # use_pool gives the pool and the region together
            self.cache = self.pool.cache(0, self.region)
        self._empty()
        self.draft.forward_stages(torch.tensor([prompt_ids], device=self.draft.device), [self.cache])

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """The draft's log-probabilities after each bottom node, ``(L, X)``; ``context`` = committed tokens."""
        draft, cache = self.draft, self._kv()
        missed = self._missed(context)
        if missed is not None:
            draft.run_stage(0, missed.hidden_1TD, cache)
        nodes = self._new_nodes(tree, len(context))
        if nodes is not None:
            assert nodes.positions_T is not None  # tree nodes come with their positions (_new_nodes)
            out = draft.run_stage(0, nodes.hidden_1TD, cache, nodes.positions_T[None], tree_mask_TN=nodes.tree_mask_TN)
            self._took(draft.logits(out.hidden_BTD[0]))
        return self.logprobs_NX[tree.bottom_level().to(self.logprobs_NX.device)]

    @staticmethod
    def expand_many(items) -> list[torch.Tensor]:
        """:meth:`expand` for many requests whose draft caches share one pool (``items``: their
        :class:`~spd.decoding.driver.Propose` work): one ragged call over the committed tokens some have not run,
        one over every request's new tree nodes, one LM-head call. Each request's ``(L, X)``, equal to its own
        :meth:`expand` up to fp32 rounding."""
        first = items[0].proposer
        draft, pool = first.draft, first.pool
        missed = [m for m in (item.proposer._missed(item.context) for item in items) if m is not None]
        if missed:
            run_ragged(pool, 0, missed)
        owners, segments = [], []
        for item in items:
            nodes = item.proposer._new_nodes(item.tree, len(item.context))
            if nodes is not None:
                owners.append(item.proposer)
                segments.append(nodes)
        if segments:
            held = [source.cache.length for source in owners]
            try:
                outs = run_ragged(pool, 0, segments)
                logits_SV = draft.logits(torch.cat([out.hidden_BTD[0] for out in outs]))
            except Exception:  # the nodes' rows go, so that each request asked alone runs them again
                for source, length in zip(owners, held):
                    source.cache.truncate(length)
                raise
            for source, logits_TV in zip(owners, logits_SV.split([seg.size for seg in segments])):
                source._took(logits_TV)
        return [
            item.proposer.logprobs_NX[item.tree.bottom_level().to(item.proposer.logprobs_NX.device)] for item in items
        ]

    def _missed(self, context: list[int]) -> Segment | None:
        """The committed tokens the draft has not run (a root committed before it was expanded), or None."""
        cache = self._kv()
        if cache.length >= len(context):
            return None
        ids_1T = torch.tensor([context[cache.length :]], device=self.draft.device)
        return Segment(cache, self.draft.embed(ids_1T))

    def _new_nodes(self, tree: TokenTree, committed: int) -> Segment | None:
        """The tree's nodes the draft has not run (after the ``committed`` tokens), or None."""
        cache = self._kv()
        held = cache.length - committed
        if held >= len(tree):
            return None
        ids_1T = tree.tokens_N[held:][None].to(self.draft.device)
        positions_T = tree.positions(committed)[held:].to(self.draft.device)
        return Segment(cache, self.draft.embed(ids_1T), positions_T, tree.mask()[held:])

    def _took(self, logits_TV: torch.Tensor) -> None:
        """The draft's logits after the new nodes: their log-probabilities join the held ones."""
        logprobs_TX = torch.log_softmax(logits_TV.float()[:, : self.vocab], dim=-1)
        self.logprobs_NX = torch.cat([self.logprobs_NX, logprobs_TX])

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """Nothing to do: the draft reads no target state."""

    def commit_root(self, root: Level) -> None:
        """Nothing to do: the root's row becomes committed in :meth:`prune` / :meth:`reset`."""

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """The root (row ``committed``) is committed and the tree keeps the subtree ``kept`` (old indices)."""
        cache = self._kv()
        if cache.length > committed:  # the draft ran the root (else it catches up in expand)
            StagedModel.prune_tree([cache], committed, kept)
        self.logprobs_NX = self.logprobs_NX[kept[kept < self.logprobs_NX.shape[0]].to(self.logprobs_NX.device)]

    def reset(self, committed: int) -> None:
        """Miss: drop the tree; the cache keeps at most the ``committed`` committed rows."""
        self._kv().truncate(committed)
        self._empty()
