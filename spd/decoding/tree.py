"""The token tree (docs/method.md §6): a dynamic BFS-ordered tree of speculated tokens, and how it grows.

Node 0 is the *root*: a known token whose next-token distribution the target has not produced yet
(its KV sits right after the committed tokens). Every other node is a speculated continuation of its
parent. Nodes are stored in BFS order: by depth, and within a level grouped by parent (parents in BFS
order, siblings in candidate order). The ancestor mask ``M`` (lower triangular, unit diagonal) has
``M[i, j]`` true iff ``j`` is ``i`` or an ancestor of ``i``; its rows are the tree part of the attention
mask, and its column ``c`` is the subtree of ``c``.

A step of tree decoding:
1. :func:`grow_top_k` (top-K candidates, :meth:`TokenTree.append_level`) or :func:`grow_sampled`
   (children drawn from the source's ``q``, :meth:`TokenTree.child_counts` and
   :meth:`TokenTree.append_children`) grows the tree by one level from the proposer's distributions;
2. the target's stages run the new nodes with ``mask()`` rows and ``positions(committed)``
   (:meth:`spd.target.staging.StagedModel.run_stage` with ``tree_mask_TN``);
3. once the target's distribution ``p`` after the root is known, a verification rule
   (:mod:`spd.decoding.verify`) picks the next token; if it is a child ``c`` of the root, :meth:`TokenTree.prune_to_child` keeps the subtree
   of ``c`` and returns the kept old indices, with which callers prune KV caches
   (:meth:`spd.target.staging.StagedModel.prune_tree`), mask rows and in-flight activations; otherwise the
   tree is discarded and :meth:`TokenTree.reset` reseeds it from the new token.

Shape suffixes: N tree nodes, L nodes of the current bottom level, K candidates per node, V vocabulary.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import torch

from ..errors import SpdInputError
from .sampling import SamplingParams, warped_probs

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as a float32 tensor would hold it (a sum or difference of two fp32 values rounded so
    is the fp32 operation's result)."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # beyond fp32's range
        return math.copysign(math.inf, x)


_CHAIN_PARTS: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_CHAIN_PARTS_MAX = 256  # chains up to this many nodes share their constant parts


def _chain_parts(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The depths, parents and ancestor mask of a chain of ``n`` nodes (``arange(n)``, ``arange(n) - 1``, the lower
    triangle): what every chain of that length has, made once and shared (trees never write these in place)."""
    parts = _CHAIN_PARTS.get(n)
    if parts is None:
        depths_N = torch.arange(n)
        parts = (depths_N, depths_N - 1, torch.ones(n, n, dtype=torch.bool).tril())
        if n <= _CHAIN_PARTS_MAX:
            _CHAIN_PARTS[n] = parts
    return parts


class _ListBacked:
    """A per-node tensor of a :class:`TokenTree` (``tokens_N`` ...) that a chain may hold as a Python list instead
    (``_tokens`` ...): reading it makes the tensor from the list once; assigning a tensor drops the list."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __set_name__(self, owner: type, name: str) -> None:
        self.tensor_attr, self.list_attr = "_" + name, "_" + name.removesuffix("_N")

    def __get__(self, tree: TokenTree | None, owner: type | None = None):
        if tree is None:
            return self
        attrs = tree.__dict__
        value = attrs[self.tensor_attr]
        if value is None:
            value = attrs[self.tensor_attr] = torch.tensor(attrs[self.list_attr], dtype=self.dtype)
        return value

    def __set__(self, tree: TokenTree, value: torch.Tensor) -> None:
        tree.__dict__[self.tensor_attr], tree.__dict__[self.list_attr] = value, None


class TokenTree:
    """A dynamic token tree in BFS order with per-node token, parent, depth and log-probabilities."""

    def __init__(self, root_token: int):
        self.reset(root_token)

    def reset(self, root_token: int) -> None:
        """Discard the tree and start a new one made of the root ``root_token``."""
        # A chain keeps its tokens and log-probs as lists (below); the tensors are made from them when asked for.
        self._set_chain_lists([int(root_token)], [0.0], [0.0])
        self.parents_N = torch.tensor([-1], dtype=torch.long)  # -1 for the root
        self.depths_N = torch.zeros(1, dtype=torch.long)  # root 0
        self.mask_NN = torch.ones(1, 1, dtype=torch.bool)  # ancestor mask M
        # The bottom node of the source's own greedy path (its best child at every level, from the root or from the
        # best node a prune kept); append_level always keeps its best child. -1: none.
        self.principal = 0
        # Sampled candidates: node -> the distribution q its children were drawn from (see grow_sampled).
        self.drafts: dict[int, torch.Tensor] = {}
        # Every level is one node. A chain (every tree of width 1) keeps its depths, parents and mask as the shared
        # parts of its length (_chain_parts), its tokens, edge and cumulative log-probs as Python lists (fp32 values,
        # as the tensors hold them), and grows and prunes without a tensor operation.
        self._chain = True

    # Per node: token, log-prob of the edge parent -> node (root 0), sum of edge log-probs from the root (root 0).
    # Each is held as a tensor, or (a chain) as a list from which the tensor is made when read; a chain's operations
    # work on the lists (:meth:`_lists`), every other on the tensors (assigning one drops its list).
    tokens_N = _ListBacked(torch.long)
    logprobs_N = _ListBacked(torch.float32)
    cum_logprobs_N = _ListBacked(torch.float32)

    def _set_chain_lists(self, tokens: list[int], logprobs: list[float], cum_logprobs: list[float]) -> None:
        self._tokens, self._logprobs, self._cum_logprobs = tokens, logprobs, cum_logprobs
        self._tokens_N = self._logprobs_N = self._cum_logprobs_N = None

    def _lists(self) -> tuple[list[int], list[float], list[float]]:
        """The chain's lists (made from the tensors where a tree operation left it a chain)."""
        if self._tokens is None or self._logprobs is None or self._cum_logprobs is None:
            self._set_chain_lists(self.tokens_N.tolist(), self.logprobs_N.tolist(), self.cum_logprobs_N.tolist())
        return self._tokens, self._logprobs, self._cum_logprobs

    def token(self, i: int) -> int:
        """The token of node ``i``."""
        return self._tokens[i] if self._tokens is not None else int(self.tokens_N[i])

    def token_ids(self, start: int, end: int) -> torch.Tensor:
        """The tokens of nodes ``start .. end - 1``, shape (end - start,)."""
        if self._tokens is not None and self._tokens_N is None:
            return torch.tensor(self._tokens[start:end], dtype=torch.long)
        return self.tokens_N[start:end]

    def __len__(self) -> int:
        return len(self._tokens) if self._tokens is not None else self._tokens_N.shape[0]

    @property
    def depth(self) -> int:
        """Depth of the deepest level (0 for a lone root)."""
        return len(self) - 1 if self._chain else int(self.depths_N[-1])

    @property
    def is_chain(self) -> bool:
        """Every level is one node (a chain: each node's only child is the next one)."""
        return self._chain

    def bottom_level(self) -> torch.Tensor:
        """Indices of the nodes of the deepest level (a contiguous range, in BFS order)."""
        if self._chain:
            return torch.tensor([len(self) - 1])
        return torch.nonzero(self.depths_N == self.depths_N[-1])[:, 0]

    def children(self, i: int) -> torch.Tensor:
        """Indices of the children of node ``i`` (in BFS order)."""
        if self._chain:
            return torch.tensor([i + 1] if -1 <= i < len(self) - 1 else [], dtype=torch.long)
        return torch.nonzero(self.parents_N == i)[:, 0]

    def child_tokens(self, i: int) -> tuple[torch.Tensor, list[int]]:
        """The children of node ``i`` (as :meth:`children`) and their tokens."""
        if self._chain and self._tokens is not None:
            if -1 <= i < len(self) - 1:
                return torch.tensor([i + 1]), [self._tokens[i + 1]]
            return torch.tensor([], dtype=torch.long), []
        children_C = self.children(i)
        return children_C, self.tokens_N[children_C].tolist()

    def path(self, i: int) -> torch.Tensor:
        """The tokens from the root to node ``i`` (inclusive), shape (depth_i + 1,)."""
        # Ancestors precede their descendants in BFS order, so row i of M lists the path in order.
        return self.tokens_N[self.mask_NN[i]]

    def mask(self) -> torch.Tensor:
        """The ancestor mask ``M`` (N, N), bool: ``M[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``."""
        return self.mask_NN

    def positions(self, offset: int) -> torch.Tensor:
        """Position ids of the nodes: ``offset + depth`` (offset = the root's position), shape (N,)."""
        return offset + self.depths_N

    def append_level(self, tokens_LK: torch.Tensor, logprobs_LK: torch.Tensor, width: int) -> torch.Tensor:
        """Append the ``width`` best of the bottom level's candidate children; return their new indices.

        Row ``l`` of ``tokens_LK`` / ``logprobs_LK`` holds the candidates (token ids and edge log-probs)
        of the ``l``-th node of :meth:`bottom_level`. Candidates are ranked by cumulative log-prob; ties go
        to the earlier parent, then the earlier candidate. Candidates with log-prob -inf are never kept.
        The kept ones are appended grouped by parent, in candidate order within a parent.

        One exception to the ranking: the best candidate of the *principal* node (the bottom of the source's own
        greedy path, :attr:`principal`) is always kept, in place of the worst one otherwise kept. A beam ranked
        by cumulative log-prob alone can drop the source's greedy path a few levels down (a confident branch off
        it overtakes it), and the tree then verifies fewer tokens than the chain of the same source would; with
        it the tree holds the chain's path, so at T = 0 it never falls behind the chain (``W = 1`` is unchanged).
        """
        bottom_L = self.bottom_level()
        tokens_LK = torch.as_tensor(tokens_LK, dtype=torch.long).cpu()
        logprobs_LK = torch.as_tensor(logprobs_LK).float().cpu()
        if tokens_LK.dim() != 2 or tokens_LK.shape[0] != bottom_L.shape[0] or logprobs_LK.shape != tokens_LK.shape:
            raise SpdInputError(
                f"append_level expects candidate tokens and log-probs of shape (L, K) with L = "
                f"{bottom_L.shape[0]} (the bottom level's size), got {tuple(tokens_LK.shape)} and "
                f"{tuple(logprobs_LK.shape)}"
            )
        chosen, forced = self._with_principal(bottom_L, logprobs_LK, self._best(bottom_L, logprobs_LK, width), width)
        k = tokens_LK.shape[1]
        new = self._append(bottom_L, chosen // k, chosen % k, tokens_LK, logprobs_LK)
        self.principal = -1 if forced is None else int(new[int(torch.nonzero(chosen == forced)[0, 0])])
        return new

    def append_child(self, token: int, logprob: float) -> torch.Tensor:
        """Append one child of the last node, which is the principal (a chain grown by one); its new index."""
        n = len(self)
        parent = n - 1
        if self._chain:  # it stays a chain
            tokens, logprobs, cum_logprobs = self._lists()
            edge = _f32(float(logprob))
            tokens.append(int(token))
            logprobs.append(edge)
            cum_logprobs.append(_f32(cum_logprobs[parent] + edge))
            self._tokens_N = self._logprobs_N = self._cum_logprobs_N = None
            self.depths_N, self.parents_N, self.mask_NN = _chain_parts(n + 1)
        else:
            self.tokens_N = torch.cat([self.tokens_N, torch.tensor([int(token)])])
            self.logprobs_N = torch.cat([self.logprobs_N, torch.tensor([float(logprob)])])
            self.cum_logprobs_N = torch.cat([self.cum_logprobs_N, self.cum_logprobs_N[parent:] + float(logprob)])
            self.parents_N = torch.cat([self.parents_N, torch.tensor([parent])])
            self.depths_N = torch.cat([self.depths_N, self.depths_N[parent:] + 1])
            mask_NN = torch.zeros(n + 1, n + 1, dtype=torch.bool)
            mask_NN[:n, :n] = self.mask_NN
            mask_NN[n, :n] = self.mask_NN[parent]
            mask_NN[n, n] = True
            self.mask_NN = mask_NN
        self.principal = n
        return torch.tensor([n])

    def child_counts(self, sorted_logprobs_LK: torch.Tensor, width: int) -> torch.Tensor:
        """How many children each bottom node gets, decided before any is drawn (see :func:`grow_sampled`).

        Row ``l`` holds the bottom node's ``K`` best edge log-probs in descending order (the source's
        top-K, or -inf past its support). Every bottom node keeps its branch alive with one child, in order
        of cumulative log-prob while slots last; the remaining slots go to the best further candidates by
        cumulative log-prob (ties to the earlier parent, then the earlier candidate). Keeping every branch
        alive matters for sampled children: a hit on a sibling whose subtree stopped short of the bottom
        leaves empty levels in the pipeline (measured in docs/benchmarks.md). Shape (L,), int64.
        """
        bottom_L = self.bottom_level()
        sorted_logprobs_LK = torch.as_tensor(sorted_logprobs_LK).float().cpu()
        if sorted_logprobs_LK.dim() != 2 or sorted_logprobs_LK.shape[0] != bottom_L.shape[0]:
            raise SpdInputError(
                f"child_counts expects log-probs of shape (L, K) with L = {bottom_L.shape[0]} (the "
                f"bottom level's size), got {tuple(sorted_logprobs_LK.shape)}"
            )
        if width < 1:
            raise SpdInputError(f"the tree width must be a positive integer, got {width}")
        cum_L = self.cum_logprobs_N[bottom_L]
        first_L = torch.where(torch.isfinite(sorted_logprobs_LK[:, 0]), cum_L, float("-inf"))
        first = torch.sort(first_L, descending=True, stable=True).indices[:width]
        first = first[torch.isfinite(first_L[first])]
        counts_L = torch.zeros(bottom_L.shape[0], dtype=torch.long)
        counts_L[first] = 1
        if width > first.numel():
            further_LK = sorted_logprobs_LK.clone()
            further_LK[:, 0] = float("-inf")  # the first children are given
            more = self._best(bottom_L, further_LK, width - first.numel())
            counts_L += torch.bincount(more // further_LK.shape[1], minlength=bottom_L.shape[0])
        return counts_L

    def append_children(
        self, counts_L: torch.Tensor, tokens_LK: torch.Tensor, logprobs_LK: torch.Tensor
    ) -> torch.Tensor:
        """Append the first ``counts_L[l]`` candidates of each bottom node ``l``, in order; return the new indices."""
        bottom_L = self.bottom_level()
        tokens_LK = torch.as_tensor(tokens_LK, dtype=torch.long).cpu()
        logprobs_LK = torch.as_tensor(logprobs_LK).float().cpu()
        counts_L = torch.as_tensor(counts_L, dtype=torch.long).cpu()
        k = tokens_LK.shape[1] if tokens_LK.dim() == 2 else 0
        if (
            tokens_LK.dim() != 2
            or tokens_LK.shape[0] != bottom_L.shape[0]
            or logprobs_LK.shape != tokens_LK.shape
            or counts_L.shape != bottom_L.shape
            or bool((counts_L < 0).any())
            or bool((counts_L > k).any())
        ):
            raise SpdInputError(
                f"append_children expects counts of shape (L,) in [0, K] and candidates of shape (L, K) with L = "
                f"{bottom_L.shape[0]} (the bottom level's size), got {tuple(counts_L.shape)} and "
                f"{tuple(tokens_LK.shape)}"
            )
        parent_rank = torch.repeat_interleave(torch.arange(bottom_L.shape[0]), counts_L)
        cand = torch.cat([torch.arange(int(c)) for c in counts_L]) if parent_rank.numel() else parent_rank
        self.principal = -1  # sampled children: no greedy path to keep
        return self._append(bottom_L, parent_rank, cand, tokens_LK, logprobs_LK)

    def _best(self, bottom_L: torch.Tensor, logprobs_LK: torch.Tensor, width: int) -> torch.Tensor:
        """Flat (parent rank, candidate) indices of the ``width`` best finite cumulative log-probs, sorted."""
        if width < 1:
            raise SpdInputError(f"the tree width must be a positive integer, got {width}")
        cum = (self.cum_logprobs_N[bottom_L][:, None] + logprobs_LK).flatten()
        # A stable descending sort breaks ties by flat index = (parent rank, candidate rank).
        order = torch.sort(cum, descending=True, stable=True).indices[:width]
        order = order[torch.isfinite(cum[order])]
        return torch.sort(order).values  # back to (parent, candidate) order: BFS order of the new level

    def _with_principal(
        self, bottom_L: torch.Tensor, logprobs_LK: torch.Tensor, chosen: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, int | None]:
        """``chosen`` with the principal node's best candidate in it (in place of the worst chosen one when every
        slot is taken), and that candidate's flat index (None: no principal node, or no finite candidate)."""
        at = torch.nonzero(bottom_L == self.principal)
        if not at.numel():
            return chosen, None
        row = int(at[0, 0])
        best = row * logprobs_LK.shape[1] + int(torch.argmax(logprobs_LK[row]))
        if not bool(torch.isfinite(logprobs_LK.flatten()[best])):
            return chosen, None
        if bool((chosen == best).any()):
            return chosen, best
        if chosen.numel() >= width:
            cum = (self.cum_logprobs_N[bottom_L][:, None] + logprobs_LK).flatten()
            worst = int(torch.argmin(torch.where(chosen == best, float("inf"), cum[chosen])))
            chosen = torch.cat([chosen[:worst], chosen[worst + 1 :]])
        return torch.sort(torch.cat([chosen, torch.tensor([best])])).values, best

    def _append(
        self,
        bottom_L: torch.Tensor,
        parent_rank: torch.Tensor,
        cand: torch.Tensor,
        tokens_LK: torch.Tensor,
        logprobs_LK: torch.Tensor,
    ) -> torch.Tensor:
        """Append candidates ``(parent_rank, cand)`` (grouped by parent, in order) as the new bottom level."""
        parents_T = bottom_L[parent_rank]
        n, t = len(self), parents_T.shape[0]
        self._chain = self._chain and t <= 1
        edge_T = logprobs_LK[parent_rank, cand]
        self.tokens_N = torch.cat([self.tokens_N, tokens_LK[parent_rank, cand]])
        self.parents_N = torch.cat([self.parents_N, parents_T])
        self.depths_N = torch.cat([self.depths_N, self.depths_N[parents_T] + 1])
        self.logprobs_N = torch.cat([self.logprobs_N, edge_T])
        self.cum_logprobs_N = torch.cat([self.cum_logprobs_N, self.cum_logprobs_N[parents_T] + edge_T])
        # New rows: the parent's row plus the node itself; no old node has a new node as ancestor.
        rows_TN = torch.cat([self.mask_NN[parents_T], torch.eye(t, dtype=torch.bool)], dim=1)
        self.mask_NN = torch.cat([torch.cat([self.mask_NN, torch.zeros(n, t, dtype=torch.bool)], 1), rows_TN])
        return torch.arange(n, n + t)

    def prune_to_child(self, child: int) -> torch.Tensor:
        """Keep only the subtree of ``child`` (a child of the root), which becomes the root.

        Returns the kept old indices (sorted: the new BFS order is the old one restricted), the index
        set with which callers prune KV caches, mask rows and in-flight activations: activations of old
        nodes ``idx`` keep the rows ``torch.isin(idx, kept)``, whose new indices are
        ``torch.searchsorted(kept, idx[keep])``. Depths and cumulative log-probs become relative to the
        new root.
        """
        child = int(child)
        if not 0 < child < len(self) or int(self.parents_N[child]) != 0:
            raise SpdInputError(
                f"prune_to_child expects a child of the root (one of {self.children(0).tolist()}), got node {child}"
            )
        if self._chain:  # the chain after the root (child 1): every node moves up by one
            n = len(self)
            tokens, logprobs, cum_logprobs = self._lists()
            first = cum_logprobs[1]
            self._set_chain_lists(tokens[1:], [0.0] + logprobs[2:], [_f32(c - first) for c in cum_logprobs[1:]])
            self.depths_N, self.parents_N, self.mask_NN = _chain_parts(n - 1)
            self.drafts = {i - 1: q for i, q in self.drafts.items() if i >= 1}
            self.principal = self.principal - 1 if self.principal >= 1 else n - 2
            return torch.arange(1, n)
        kept = torch.nonzero(self.mask_NN[:, child])[:, 0]
        new_index = torch.full((len(self),), -1, dtype=torch.long)
        new_index[kept] = torch.arange(kept.shape[0])
        parents = self.parents_N[kept]
        self.parents_N = torch.where(parents >= 0, new_index[parents.clamp(min=0)], -1)  # old root -> -1
        self.tokens_N = self.tokens_N[kept]
        self.depths_N = self.depths_N[kept] - 1
        self.logprobs_N = self.logprobs_N[kept]
        self.logprobs_N[0] = 0.0
        self.cum_logprobs_N = self.cum_logprobs_N[kept] - self.cum_logprobs_N[child]
        self.mask_NN = self.mask_NN[kept][:, kept]
        self.drafts = {int(new_index[i]): q for i, q in self.drafts.items() if new_index[i] >= 0}
        if self.principal >= 0 and new_index[self.principal] >= 0:
            self.principal = int(new_index[self.principal])
        else:  # the hit left the greedy path: it goes on from the best of the deepest kept nodes
            bottom = self.bottom_level()
            self.principal = int(bottom[torch.argmax(self.cum_logprobs_N[bottom])])
        self._chain = len(self) == int(self.depths_N[-1]) + 1
        return kept


@dataclass
class Level:
    """One tree level in flight: a contiguous range of tree indices and what the stages produced so far."""

    start: int  # tree index of the level's first node
    hidden_1TD: torch.Tensor  # input of the next stage (the embeddings at depth 0)
    depth: int = 0  # stages completed
    rank: int = 0  # k-th level after the last (re)seed, capped at n (0: a seed root)
    anchors: dict[int, torch.Tensor] = field(default_factory=dict)  # H^l (T, D) that a head reads
    sent: bool = False  # handed to remote stages already

    @property
    def size(self) -> int:
        return self.hidden_1TD.shape[1]


# ---------------------------------------------------------------------------------- growing the tree
def grow_top_k(
    tree: TokenTree, logprobs_LX: torch.Tensor, ids_X: torch.Tensor | None, width: int, children: int
) -> torch.Tensor:
    """Deterministic candidates: each bottom node's top-``children`` tokens, the ``width`` best kept.

    ``logprobs_LX``: the proposer's log-probabilities after each bottom node (rows in
    :meth:`TokenTree.bottom_level` order) over its own outputs ``X``; ``ids_X`` maps them to target ids
    (None: ``X`` is the target's vocabulary). Verified by :func:`~spd.decoding.verify.verify_greedy` or
    :func:`~spd.decoding.verify.verify_sampled_deterministic`. Returns the new nodes' indices.
    """
    if width == 1 and logprobs_LX.shape[0] == 1 and tree.principal == len(tree) - 1:
        # A chain: the one bottom node's best candidate is the level (what append_level keeps at width 1).
        value, index = torch.max(logprobs_LX[0].float(), dim=-1)
        token = int(index) if ids_X is None else int(ids_X[index])
        return tree.append_child(token, float(value))
    top = torch.topk(logprobs_LX.float(), min(children, logprobs_LX.shape[-1]), dim=-1)
    tokens_LK = top.indices if ids_X is None else ids_X[top.indices]
    return tree.append_level(tokens_LK.cpu(), top.values.cpu(), width)


def grow_sampled(
    tree: TokenTree,
    logprobs_LX: torch.Tensor,
    ids_X: torch.Tensor | None,
    width: int,
    children: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_size: int,
) -> torch.Tensor:
    """Sampled candidates: each bottom node's children drawn from the source's warped ``q``, without replacement.

    ``q`` is the source's distribution warped like the target's (``params``: temperature, top-k,
    top-p). How many children each node gets is fixed first, from the nodes' cumulative log-probs and
    ``q``'s sorted top-``children`` log-probs (:meth:`TokenTree.child_counts`: one child per node while
    the ``width`` slots last, the rest to the best expected scores), so the count never depends on the
    draws; then node ``l``'s
    ``c_l`` children are its first ``c_l`` draws of a sequence without replacement from ``q``
    (Gumbel top-k: the order of the keys ``log q + Gumbel noise`` is a Plackett-Luce sample, i.e.
    draws one after another without replacement; when every node gets at most one child, as in a chain, each
    draw is one ``torch.multinomial`` from ``q``: the same distribution, without a key per token). The parent's
    ``q`` over the target's vocabulary
    (``vocab_size``) is kept in ``tree.drafts`` for :func:`~spd.decoding.verify.verify_sampled_recursive` with
    ``without_replacement``. Node log-probs are ``log q`` of the drawn tokens. Returns the new indices.
    """
    q_LX = warped_probs(logprobs_LX, params)
    logq_LX = torch.log(q_LX)
    k = min(children, logq_LX.shape[-1])
    counts_L = tree.child_counts(torch.topk(logq_LX, k, dim=-1).values, width)
    rows = torch.nonzero(counts_L)[:, 0]
    tokens_LK = torch.zeros(counts_L.shape[0], k, dtype=torch.long)
    logprobs_LK = torch.full((counts_L.shape[0], k), float("-inf"))
    if rows.numel():
        logq_RX = logq_LX[rows.to(logq_LX.device)]
        if int(counts_L.max()) == 1:  # one child per node (a chain): one draw from q each
            drawn_RK = torch.multinomial(q_LX[rows.to(q_LX.device)], 1, generator=generator)
        else:
            dev = generator.device if generator is not None else logq_LX.device
            u_RX = torch.rand((rows.numel(), logq_LX.shape[-1]), generator=generator, dtype=torch.float64, device=dev)
            gumbel_RX = -torch.log(-torch.log(u_RX)).to(logq_LX.device)
            drawn_RK = torch.topk(logq_RX.double() + gumbel_RX, k, dim=-1).indices
        logprobs_LK[rows, : drawn_RK.shape[1]] = logq_RX.gather(-1, drawn_RK).float().cpu()
        tokens_LK[rows, : drawn_RK.shape[1]] = (drawn_RK if ids_X is None else ids_X[drawn_RK]).cpu()
        bottom_L = tree.bottom_level()
        for row in rows.tolist():
            q_V = (
                q_LX[row]
                if ids_X is None and q_LX.shape[-1] == vocab_size
                else torch.zeros(vocab_size, dtype=q_LX.dtype, device=q_LX.device).index_copy_(
                    0, torch.arange(q_LX.shape[-1], device=q_LX.device) if ids_X is None else ids_X, q_LX[row]
                )
            )
            tree.drafts[int(bottom_L[row])] = q_V
    return tree.append_children(counts_L, tokens_LK, logprobs_LK)
