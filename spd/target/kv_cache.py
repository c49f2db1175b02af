"""The KV cache of one pipeline stage (docs/method.md, "KV caches and rollback").

Preallocated key/value buffers for the stage's attention layers only, a committed length, O(1) truncation after
a flush, and compaction after a token tree is pruned; on hybrid targets it carries the linear-attention layers'
state too (:class:`spd.target.linear_state.LinearStateRing`).

Shapes are named with suffixes: L the stage's attention layers, B batch, Hk key/value heads, C cache capacity,
Dh head dim, T new tokens.
"""

from __future__ import annotations

import torch

from .linear_state import LinearStateRing, NoPastRecording


class StageKVCache(NoPastRecording):
    """Cache of one stage's layers: preallocated KV buffers, a committed length, O(1) truncation; on hybrid
    targets also the linear-attention layers' state (:class:`spd.target.linear_state.LinearStateRing`).

    It implements the ``update(key, value, layer_idx)`` call that Hugging Face attention modules
    make on their cache (``cache``, formerly ``past_key_values``), and the conv/recurrent-state calls of linear-attention layers.
    All layers of one stage write at the same offset; the stage wrapper calls :meth:`begin` before and
    :meth:`advance` after each stage call.
    """

    def __init__(
        self,
        layer_ids: list[int],
        kv_heads: int,
        head_dim: int,
        batch_size: int = 1,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        linear: LinearStateRing | None = None,
    ):
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        self.linear = linear  # None: no linear-attention layers in this stage
        self.length = 0  # tokens held by every layer of this stage
        self._shape = (batch_size, kv_heads, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self.keys_LBHkCDh = self._alloc(capacity)
        self.values_LBHkCDh = self._alloc(capacity)
        # Position id of each cached row; tree nodes sit at committed length + depth, not at their row.
        self.positions_C = torch.zeros(capacity, dtype=torch.long, device=self._device)
        self.base: int | None = None  # the first row in a shared pool (spd.target.kv_pool); None: buffers of its own

    @classmethod
    def over(
        cls,
        layer_ids: list[int],
        keys_LBHkCDh: torch.Tensor,
        values_LBHkCDh: torch.Tensor,
        positions_C: torch.Tensor,
        base: int,
    ) -> StageKVCache:
        """An empty cache whose buffers are the given views (rows ``base..`` of a :class:`spd.target.kv_pool.KVPool`);
        it never grows (:meth:`reserve` refuses)."""
        cache = cls.__new__(cls)
        cache.slot = {layer: i for i, layer in enumerate(layer_ids)}
        cache.linear, cache.length, cache.base = None, 0, base
        cache._shape = (keys_LBHkCDh.shape[1], keys_LBHkCDh.shape[2], keys_LBHkCDh.shape[4])
        cache._dtype, cache._device = keys_LBHkCDh.dtype, keys_LBHkCDh.device
        cache.keys_LBHkCDh, cache.values_LBHkCDh, cache.positions_C = keys_LBHkCDh, values_LBHkCDh, positions_C
        return cache

    def _alloc(self, capacity: int) -> torch.Tensor:
        b, h, d = self._shape
        return torch.zeros(len(self.slot), b, h, capacity, d, dtype=self._dtype, device=self._device)

    @property
    def capacity(self) -> int:
        return self.keys_LBHkCDh.shape[3]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` tokens (grows geometrically, keeps the contents)."""
        if length <= self.capacity:
            return
        if self.base is not None:
            raise RuntimeError(f"a pooled KV cache of {self.capacity} rows cannot hold {length}")
        new_capacity = max(length, 2 * self.capacity)
        for name in ("keys_LBHkCDh", "values_LBHkCDh"):
            old = getattr(self, name)
            new = self._alloc(new_capacity)
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)
        positions_C = torch.zeros(new_capacity, dtype=torch.long, device=self._device)
        positions_C[: self.length] = self.positions_C[: self.length]
        self.positions_C = positions_C

    def update(self, key_BHkTDh: torch.Tensor, value_BHkTDh: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new keys/values of ``layer_idx`` after the committed ones; return all of them."""
        i = self.slot[layer_idx]
        end = self.length + key_BHkTDh.shape[2]
        self.keys_LBHkCDh[i, :, :, self.length : end] = key_BHkTDh
        self.values_LBHkCDh[i, :, :, self.length : end] = value_BHkTDh
        return self.keys_LBHkCDh[i, :, :, :end], self.values_LBHkCDh[i, :, :, :end]

    def begin(self, n_tokens: int, first_node: int | None = None) -> None:
        """A stage call on ``n_tokens`` new tokens starts (tree nodes from ``first_node`` on, when given)."""
        if self.linear is not None:
            if first_node is None:
                self.linear.begin(n_tokens)
            else:
                self.linear.begin_nodes(first_node, n_tokens)

    def advance(self, n_tokens: int, tree: bool = False) -> None:
        self.length += n_tokens
        if self.linear is not None:
            if tree:
                self.linear.end_nodes(self.length - self.linear.length)
            else:
                self.linear.advance(n_tokens)

    def truncate(self, length: int) -> None:
        """Forget every token at position >= ``length`` (rollback after a flush)."""
        if length < 0:
            raise ValueError(f"cannot truncate a KV cache to a negative length ({length})")
        if self.linear is not None:
            self.linear.truncate(length)
        self.length = min(self.length, length)

    # Linear-attention layers call these on their ``cache_params`` (see spd.target.linear_state).
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.linear.get_conv_state(layer_idx, state_idx)

    def update_conv_state(self, inputs_BCT: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.linear.update_conv_state(inputs_BCT, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.linear.get_recurrent_state(layer_idx, state_idx)

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self.linear.update_recurrent_state(state, layer_idx, state_idx, **kwargs)

    def keep(self, start: int, indices: torch.Tensor | list[int]) -> None:
        """Keep rows ``start + indices`` (in that order) at rows ``start, start+1, ...``; drop the other rows >= start.

        This compacts a pruned tree's KV right after the committed rows ``[0, start)``; ``indices`` are
        offsets from ``start`` (tree indices when ``start`` is the root's row).
        """
        indices = torch.as_tensor(indices, dtype=torch.long).flatten()
        held = self.length - start
        if not 0 <= start <= self.length:
            raise ValueError(f"keep: start {start} is outside the cache's {self.length} rows")
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < held):
            raise ValueError(
                f"keep: indices must lie in [0, {held}) (the rows after start {start}), got {indices.tolist()}"
            )
        end = start + indices.numel()
        if not torch.equal(indices, torch.arange(indices.numel(), device=indices.device)):  # (a prefix stays put)
            rows = (start + indices).to(self._device)
            # Advanced indexing copies the selected rows first, so an in-place compaction is safe.
            self.keys_LBHkCDh[:, :, :, start:end] = self.keys_LBHkCDh[:, :, :, rows]
            self.values_LBHkCDh[:, :, :, start:end] = self.values_LBHkCDh[:, :, :, rows]
            self.positions_C[start:end] = self.positions_C[rows]
        self.length = end
        if self.linear is not None:  # the root (row start - 1) is committed; the kept nodes' states follow their rows
            if start != self.linear.length + 1:
                raise RuntimeError(
                    f"keep: a stage with linear-attention layers prunes a tree whose root is row "
                    f"{self.linear.length}, not row {start - 1}"
                )
            self.linear.keep(indices)
