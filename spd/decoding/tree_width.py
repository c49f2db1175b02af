"""How wide the token tree grows: a fixed width ``W``, or one that follows the measured acceptance (``auto``).

A wider tree offers the target more candidates per position (fewer misses, a longer accepted run) but
every node is work for every stage. :class:`AdaptiveWidth` (``--tree-width auto``) keeps ``W`` (and
the children per node, ``K = min(W, --tree-children)``) on the ladder 1, 2, 4, ... up to a maximum,
from what the recent verifications showed:

- *shrink* (halve ``W``) when the later siblings (a hit on a child other than the root's first) won
  less than ``gain_floor`` of the last ``window`` verifications: the extra width is not paying, a
  narrower tree would have accepted as much;
- *grow* (double ``W``) when more than ``miss_ceiling`` of them were misses: there is acceptance to
  win. After a shrink, growing waits ``hold`` windows, doubled each time a growth is undone at once
  (up to 8 windows): a source whose extra candidates never win settles on the narrow tree instead of
  oscillating.

The width changes only between verifications and never depends on a draw that verification still has
to make, so every decoding rule stays lossless. The controller starts each request afresh (at
``min(4, maximum)``), so a request's output for a seed does not depend on earlier requests.
"""

from __future__ import annotations

from ..errors import SpdInputError


def parse_tree_width(value: str | int) -> int | str:
    """``--tree-width``: a positive integer or ``auto``; one clear error otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        width = int(value)
    except (TypeError, ValueError):
        width = 0
    if width < 1:
        raise SpdInputError(f"the tree width must be a positive integer or 'auto', got '{value}'")
    return width


class FixedWidth:
    """``W`` nodes per level and ``K`` children per node, always."""

    adaptive = False

    def __init__(self, width: int, children: int):
        if not isinstance(width, int) or width < 1:
            raise SpdInputError(f"the tree width must be a positive integer or 'auto', got {width!r}")
        self.width = self.max_width = width
        self.children = self.max_children = children

    def reset(self) -> None:
        """A new request."""

    def observe(self, hit_rank: int | None) -> None:
        """A verification: the accepted child's rank among the root's children, or None for a miss."""


class AdaptiveWidth:
    """``W`` on the ladder 1, 2, 4, ... ``max_width``, following the recent verifications (module docstring)."""

    adaptive = True

    def __init__(
        self,
        max_width: int = 8,
        children: int = 4,
        window: int = 16,
        gain_floor: float = 1 / 16,
        miss_ceiling: float = 1 / 8,
    ):
        if max_width < 1 or children < 1 or window < 1:
            raise SpdInputError(
                f"an adaptive tree needs a positive maximum width, children per node and window, got "
                f"{max_width}, {children} and {window}"
            )
        ladder, w = [], 1
        while w < max_width:
            ladder.append(w)
            w *= 2
        self.ladder = ladder + [max_width]
        self.max_width, self.max_children = max_width, children
        self.window, self.gain_floor, self.miss_ceiling = window, gain_floor, miss_ceiling
        self.reset()

    def reset(self) -> None:
        self._step = min(range(len(self.ladder)), key=lambda i: abs(self.ladder[i] - 4))
        self._seen = self._misses = self._gains = 0
        self._hold = 0  # windows to wait before the next growth
        self._backoff = 1
        self._grew = False  # the last change was a growth, not yet confirmed by a window at the new width

    @property
    def width(self) -> int:
        return self.ladder[self._step]

    @property
    def children(self) -> int:
        return min(self.width, self.max_children)

    def observe(self, hit_rank: int | None) -> None:
        self._seen += 1
        self._misses += hit_rank is None
        self._gains += hit_rank is not None and hit_rank > 0
        if self._seen < self.window:
            return
        gain, miss = self._gains / self._seen, self._misses / self._seen
        self._seen = self._misses = self._gains = 0
        hold, self._hold = self._hold, max(0, self._hold - 1)
        if self._step > 0 and gain < self.gain_floor:
            if self._grew:  # the last growth did not pay: wait longer before the next one
                self._backoff = min(8, self._backoff * 2)
            self._step -= 1
            self._hold, self._grew = self._backoff, False
        elif miss > self.miss_ceiling and self._step < len(self.ladder) - 1:
            if hold == 0:
                self._step += 1
                self._grew = True
        else:
            if self._grew:
                self._backoff = 1  # the growth paid
            self._grew = False


class SharedWidth:
    """A request's width policy in a batch with a node budget per step (``BatchedPipeline(tree_nodes=N)``): its own
    policy's width, at most ``cap``, which the batch sets before every step to the request's share of the budget
    (``N`` over the requests in flight). The cap changes only between steps, so between verifications, and follows
    how many requests are in flight, never a draw of this request: every decoding rule stays lossless. A sampled
    request's output for a seed then depends on the load (its distribution does not)."""

    def __init__(self, inner: FixedWidth | AdaptiveWidth):
        self.inner, self.cap = inner, inner.max_width
        self.adaptive = inner.adaptive
        self.max_width, self.max_children = inner.max_width, inner.max_children

    @property
    def width(self) -> int:
        return min(self.inner.width, self.cap)

    @property
    def children(self) -> int:
        return self.inner.children

    def reset(self) -> None:
        self.inner.reset()

    def observe(self, hit_rank: int | None) -> None:
        self.inner.observe(hit_rank)


# A request's width policy, as the step loop reads it.
WidthPolicy = FixedWidth | AdaptiveWidth | SharedWidth


def tree_width(width: int | str, children: int, max_width: int = 8) -> FixedWidth | AdaptiveWidth:
    """The width policy for ``--tree-width`` (an integer or ``auto``) and ``--tree-children``."""
    width = parse_tree_width(width)
    if children < 1:
        raise SpdInputError(f"the number of tree children must be a positive integer, got {children}")
    if isinstance(width, str):  # "auto", the only text parse_tree_width returns
        return AdaptiveWidth(max_width, children)
    return FixedWidth(width, children)
