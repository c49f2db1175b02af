"""Attention masks of a stage call (docs/method.md, "KV caches and rollback" and §6).

A query at absolute position ``p`` sees keys at positions ``<= p`` (and ``> p - window`` on sliding-window layers);
a tree node sees the committed keys and, of the tree, only its ancestors. Masks come in the attention backend's
format (boolean for sdpa, additive for eager), or None where sdpa's own default is exact. The tree's ancestor
mask also gives the runs of nodes, one per depth, that linear-attention layers take (:func:`node_groups`).

Shapes are named with suffixes: T queries (new tokens or tree nodes), K keys, N tree nodes in the cache.
"""

from __future__ import annotations

import torch


def node_groups(tree_mask_TN: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """The tree nodes of a stage call (the last ``T`` of the ``N`` nodes in ``tree_mask_TN``'s columns, BFS order) as
    runs ``(first, end, parents_T)`` of nodes whose parents (tree indices; ``-1`` for the root) precede the run:
    one run per depth. A node's parent is its deepest ancestor other than itself."""
    t, n = tree_mask_TN.shape
    first = n - t
    mask_TN = tree_mask_TN.to("cpu").clone()
    mask_TN[torch.arange(t), torch.arange(first, n)] = False  # not its own parent
    index_N = torch.arange(n)
    parents_T = torch.where(mask_TN, index_N, torch.full_like(index_N, -1)).max(dim=1).values
    groups, start = [], 0
    for i in range(1, t + 1):
        if i == t or int(parents_T[i]) >= first + start:  # node i's parent is in the current run: a new run
            groups.append((first + start, first + i, parents_T[start:i]))
            start = i
    return groups


def attention_mask(
    q_pos_T: torch.Tensor, kv_len: int, window: int | None, impl: str, dtype: torch.dtype, contiguous: bool
) -> torch.Tensor | None:
    """The (1, 1, T, K) mask for queries at absolute positions ``q_pos_T`` over keys at positions 0..K-1.

    ``contiguous`` says the queries are the last T keys (positions K-T..K-1). Then, for sdpa, None is
    returned where the backend's default (full for one query, causal for a square block) is already
    exact, so that prefill and decode run the same kernels as ``generate``.
    """
    t = q_pos_T.shape[0]
    if contiguous and impl == "sdpa" and (window is None or kv_len <= window) and (t == 1 or t == kv_len):
        return None
    k_pos_K = torch.arange(kv_len, device=q_pos_T.device)
    return _backend_mask(k_pos_K[None, :] <= q_pos_T[:, None], q_pos_T, k_pos_K, window, impl, dtype)


def tree_attention_mask(
    q_pos_T: torch.Tensor,
    key_pos_K: torch.Tensor,
    tree_mask_TN: torch.Tensor,
    window: int | None,
    impl: str,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The (1, 1, T, K) mask of T tree nodes: the first K - N keys (committed) visible, the last N by ``tree_mask_TN``
    (for sdpa, None for one node that sees every row without a window: a chain's node, as a chain token's call).

    ``key_pos_K`` are the keys' position ids (tree nodes sit at committed length + depth), used for
    sliding windows: along a root-to-node path positions are consecutive, so the window by position is
    the one a plain forward of ``committed + path`` would apply.
    """
    t, n = tree_mask_TN.shape
    if t == 1 and window is None and impl == "sdpa" and tree_mask_TN.device.type == "cpu" and tree_mask_TN.all():
        return None  # (a mask makes SDPA take a slower path on CPU; on CUDA asking would wait for the device)
    k = key_pos_K.shape[0]
    committed_TP = torch.ones(t, k - n, dtype=torch.bool, device=tree_mask_TN.device)
    allowed_TK = torch.cat([committed_TP, tree_mask_TN], dim=1)
    return _backend_mask(allowed_TK, q_pos_T, key_pos_K, window, impl, dtype)


def _backend_mask(
    allowed_TK: torch.Tensor,
    q_pos_T: torch.Tensor,
    key_pos_K: torch.Tensor,
    window: int | None,
    impl: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Apply a sliding window by position to a (T, K) visibility mask; return it as the backend expects it
    ((1, 1, T, K): boolean for sdpa, additive for eager)."""
    if window is not None:
        allowed_TK = allowed_TK & (q_pos_T[:, None] - key_pos_K[None, :] < window)
    if impl == "sdpa":
        return allowed_TK[None, None]
    zero = torch.zeros((), dtype=dtype, device=q_pos_T.device)
    return torch.where(allowed_TK, zero, torch.finfo(dtype).min)[None, None]
