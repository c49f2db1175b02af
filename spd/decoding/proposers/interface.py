"""The one interface of a proposer: :class:`Proposer`, what the step loop (:mod:`spd.decoding.loop`) asks of it.

A proposer grows the token tree by one level per step (docs/method.md §5-6). Three implement it in
:mod:`spd.decoding.proposers`: :class:`~spd.decoding.proposers.SpdHeadProposer` (our SPD heads, any width, one
batched query over the bottom nodes), :class:`~spd.decoding.proposers.HeadProposer` (any head through the
head's engine calls, one query per bottom node: the SPD authors' heads at any width, and our heads on the
output-state and PPSD schedules, which are chains) and :class:`~spd.decoding.proposers.DraftModelProposer` (a small
causal LM), and a fourth, :class:`~spd.decoding.proposers.SerialHeadProposer` (our
head trained with variant=eagle). The standard pipeline (``pp``) runs the same loop with no proposer. Serial
drafting (:mod:`spd.decoding.sd`) drives the draft model and the serial head through this interface too: it expands
a chain while the target is idle, then commits the rows the target kept (``commit_root``) and resets.

A batched driver asks the proposers of many requests at once (:func:`propose_many`): proposers whose class
``batches`` and whose ``batch_key()`` is the same are asked in one call
(:class:`~spd.decoding.proposers.SpdHeadProposer`: one head; :class:`~spd.decoding.proposers.DraftModelProposer`:
one draft model). Such a proposer may keep its request's cache in a pool shared by the batch's requests, which the
batched driver makes once from the first proposer's ``new_pool(rows, slots)``, gives each request with ``use_pool``
when it admits it, and takes back with ``leave_pool`` when the request ends: a draft model's KV in the rows of the
request's region of the target's pool, an SPD head's memory in a slot of one buffer
(:class:`~spd.heads.memory.SpeculatorPool`), so that the joint call reads every request's rows in place.

Shape suffixes: L nodes of the tree's bottom level, X the proposer's outputs (the target's vocabulary, or a
draft vocabulary that ``ids`` maps to target ids).
"""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

import torch

from ...target.kv_pool import Region
from ..tree import Level, TokenTree


@runtime_checkable
class Proposer(Protocol):
    """A proposer of the step loop.

    ``schedule`` says when it reads the pipeline's state: ``"input"`` at the start of a step, concurrently with the
    stages (SPD), ``"output"`` after the stages ran (the output-state ablation, PPSD: serial with them), ``"none"``
    (a draft model, which reads no target state), ``"serial"`` (only the rows the target ran and kept: serial
    drafting). ``needed_anchors`` are the hidden-state indices ``l`` of ``H^l``
    it reads of tokens in flight, ``prefill_anchors`` those of the prompt's positions; ``ids`` maps its outputs to
    target ids (None: they are target ids); ``children`` caps the candidates per node; ``num_layers`` is its
    depth for the step cost model (0: hidden behind a stage); ``chain_only`` marks a schedule with no tree semantics
    (width 1 only).

    Two optional capabilities are declared by class attributes, never probed: ``batches`` (True: the class has
    ``batch_key()`` and a static ``expand_many(items)`` that answers many requests' queries in one call, see
    :func:`propose_many`) and ``pooled`` (True: it has ``new_pool(rows, slots)``, ``use_pool(pool, region)`` and
    ``leave_pool()``, and keeps a request's cache in a pool of the batch's).
    """

    schedule: str
    needed_anchors: tuple[int, ...]
    prefill_anchors: tuple[int, ...]
    children: int
    num_layers: int
    chain_only: bool
    batches: bool
    pooled: bool

    @property
    def ids(self) -> torch.Tensor | None:
        """The target ids of the proposer's outputs (None: they are target ids). Read-only, so that a proposer whose
        outputs are always target ids may declare ``ids = None``."""

    def start(self, prompt_ids: list[int], anchors: dict[int, torch.Tensor], capacity: int) -> None:
        """A request starts: the prompt's ids and its ``prefill_anchors`` (``H^l`` (1, T, D) each)."""

    def expand(self, tree: TokenTree, context: list[int], levels: list[Level]) -> torch.Tensor:
        """Log-probabilities ``(L, X)`` after each bottom node of ``tree`` (``context``: the committed tokens before
        the root; ``levels``: the tree's levels in flight, root level first, at their current depths)."""

    def advanced(self, levels: list[Level], tree: TokenTree, committed: int) -> None:
        """``levels`` just ran one more stage (their anchors and depths are new); ``committed`` tokens precede the
        root."""

    def commit_root(self, root: Level) -> None:
        """The root's level left stage ``n``: the root is committed."""

    def prune(self, committed: int, kept: torch.Tensor) -> None:
        """A hit: the tree keeps the subtree ``kept`` (old tree indices) of the accepted child, the new root."""

    def reset(self, committed: int) -> None:
        """A miss (or nothing proposed): the tree is gone; ``committed`` tokens are final."""


class PooledProposer(Proposer, Protocol):
    """A proposer that declares ``pooled = True``: it keeps its request's cache in a pool of the batch's."""

    def new_pool(self, rows: int, slots: int) -> object:
        """A pool for ``slots`` requests whose regions of the target's pool span ``rows`` rows."""

    def use_pool(self, pool: Any, region: Region) -> None:
        """This request's cache lives in ``pool`` (one made by ``new_pool`` of the same class) for ``region``."""

    def leave_pool(self) -> None:
        """The request ended: its part of the pool goes back."""


def propose_many(items: list) -> list[torch.Tensor]:
    """The answers to many requests' proposer queries (:class:`spd.decoding.driver.Propose`), in their order: the
    proposers that can be asked together (a class that ``batches``, the same ``batch_key()``) in one call per
    group; the others, and a group of one, each alone (so a batch of one asks exactly as a single request does)."""
    answers: list[torch.Tensor | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        key = item.proposer.batch_key() if type(item.proposer).batches else None
        groups.setdefault((type(item.proposer), key) if key is not None else (None, i), []).append(i)
    for (kind, _), indices in groups.items():
        if len(indices) == 1:
            answers[indices[0]] = items[indices[0]].answer()
            continue
        for i, answer in zip(indices, kind.expand_many([items[i] for i in indices])):
            answers[i] = answer
    return cast(list[torch.Tensor], answers)  # every item was asked: each slot holds its answer
