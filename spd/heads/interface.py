"""The interface between a speculation head and the decoding engine: the calls the engine makes on a head
(:class:`SpeculationHead`) and the tokens in flight it hands over (:class:`InFlightToken`), docs/method.md §3.

Our heads (:class:`spd.heads.speculator.Speculator`) and the SPD authors' (:class:`spd.heads.published.authors_head.
AuthorsHead`) implement it, each over a cache of its own and on its own schedule; the generic head proposer
(:class:`spd.decoding.proposers.head.HeadProposer`) drives either through it, in this order:

1. once, ``needed_anchors()`` and ``prefill_anchors()``: the hidden-state indices ``l`` of ``H^l`` the stages hand
   over for tokens in flight and for the prompt's positions;
2. when a request starts, ``new_cache(capacity=...)``, then ``prefill_memory(cache, anchors)`` with the prompt's
   ``prefill_anchors`` (``H^l`` (1, T, D) each);
3. every step, for each bottom node of the tree, ``propose_logits(cache, inflight)`` (or ``propose_logits_many``
   for many nodes and requests in one call): the logits after the newest token in flight, from the tokens in flight
   (the node's root path, oldest first) at their current depths;
4. after the stages ran, ``retire(cache, tokens)`` with the tokens alone on their level: those that reached the depth
   the head keeps enter its cache;
5. on a miss, ``cache.truncate(committed)``: rows after the committed tokens are dropped.

Shape suffixes: D hidden, T prompt positions, V the target's vocabulary, B queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch


@dataclass
class InFlightToken:
    """A token in flight as the head sees it: its position in the sequence, the depth it has reached (the stages it
    has completed) and its anchors, ``H^l`` (1, D) for every ``l`` of the head's ``needed_anchors``."""

    position: int
    depth: int
    anchors: dict[int, torch.Tensor]


class HeadConfig(Protocol):
    """What the engine reads of a head's config: the target and pipeline it was trained for, and its schedule."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def n_stages(self) -> int: ...

    @property
    def boundaries(self) -> list[int]: ...

    @property
    def target_num_layers(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def schedule(self) -> str: ...

    @property
    def max_depth(self) -> int: ...

    @property
    def offset(self) -> int: ...


class HeadCache(Protocol):
    """A head's memory of one request: the positions it holds, and their rollback."""

    @property
    def length(self) -> int: ...

    def truncate(self, length: int) -> None:
        """Keep the rows of positions before ``length``."""


CacheT = TypeVar("CacheT", bound=HeadCache)


class SpeculationHead(Protocol[CacheT]):
    """A speculation head as the engine drives it (see the module docstring), over caches of type ``CacheT``."""

    @property
    def config(self) -> HeadConfig: ...

    def needed_anchors(self) -> list[int]:
        """Every hidden-state index the head reads of a token in flight."""

    def prefill_anchors(self) -> list[int]:
        """Hidden-state indices the prefill must return for every prompt position."""

    def new_cache(self, batch_size: int = 1, capacity: int = 256) -> CacheT:
        """An empty cache of ``capacity`` positions."""

    def prefill_memory(self, cache: CacheT, anchors: dict[int, torch.Tensor]) -> None:
        """The prompt's positions enter ``cache`` (``anchors``: ``H^l`` (1, T, D) of ``prefill_anchors``)."""

    def retire(self, cache: CacheT, tokens: Sequence[InFlightToken]) -> None:
        """``tokens`` just ran a stage: those that reached the depth the head keeps enter ``cache``."""

    def propose_logits(self, cache: CacheT, inflight: Sequence[InFlightToken]) -> torch.Tensor:
        """Logits (1, V) of the token after the newest of ``inflight`` (oldest first)."""

    def propose_logits_many(
        self, caches: Sequence[CacheT], inflights: Sequence[Sequence[InFlightToken]]
    ) -> torch.Tensor:
        """:meth:`propose_logits` of many queries at once, ``inflights[i]`` over ``caches[i]``: logits (B, V)."""
