"""Recurrent state of a stage's linear-attention layers (hybrid targets such as Qwen3.5), with rollback.

A linear-attention layer (Gated DeltaNet) carries a convolution state (the last ``K`` inputs of its
causal depthwise conv) and a recurrent state (one ``Dk x Dv`` matrix per value head). Unlike a KV
cache, neither can be cut back to an earlier length: the state after ``c`` tokens is gone once the
layer has run token ``c``. A pipeline flush (docs/method.md §5) needs exactly that state.

Rollback design: a **ring of states indexed by length**. Slot ``length % R`` holds the state after
``length`` tokens; running ``T`` tokens from length ``l`` writes the new state into slot
``(l + T) % R`` and leaves slot ``l % R`` untouched, so the states at the last ``R`` lengths stay
available and rolling back is moving an integer. This costs no copy beyond what the layer writes
anyway: the recurrent state is produced out of place by the kernel and stored once (a snapshot ring
beside a single live state would copy it a second time per token); the convolution state, which
Hugging Face's one-token kernel updates in place, is copied once into the new slot first (``K``
columns, a few KB). In the chain engine a stage is at most ``n - 1`` tokens past the committed
prefix when a flush arrives, so ``R = n + 1`` slots suffice (memory: ``R`` recurrent states per
linear layer; Qwen3.5-9B, fp32 states: 2 MiB per layer per slot).

A multi-token call (prefill) stores only the state after its last token; the lengths inside it are
committed and never rolled back to.

**Token trees** (docs/method.md §6): a tree node's state is its parent's state advanced by the node's token,
and siblings share a parent, so the states of the nodes after the committed prefix form a tree, not a
sequence. Beside the ring (which keeps the committed prefix's state, the *base*), the stage keeps one conv and
one recurrent state per tree node it has run, indexed like its KV rows (node ``i`` = row ``base + i``, the
root ``0``). A level of ``T`` nodes runs through a linear layer as a batch of ``T`` one-token sequences: each
starts from its parent's state (the base for the root), gathered into the level's own slots, and the
one-token kernels write the nodes' new states there (:meth:`select_nodes`); no loop over nodes. A prune
commits the root (its state joins the ring as the state at ``base + 1``) and keeps the surviving subtree's
states with the index set of the KV prune (:meth:`keep`); a miss commits the root and drops the others
(:meth:`truncate` to ``base + 1``). Memory per stage: one conv state (``C x K``) and one recurrent state
(``H x Dk x Dv``) per linear layer per tree node in flight, at most ``n * W + 1`` nodes (Qwen3.5-4B, fp32:
1 MiB per layer per node), grown geometrically as the tree grows.

The class implements the calls Hugging Face's ``Qwen3_5GatedDeltaNet`` (and ``Qwen3NextGatedDeltaNet``)
make on their ``cache_params``: ``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``is_recording_past``.

Shapes: R ring slots, B batch, C conv channels, K conv kernel, H value heads, Dk/Dv head dims, N tree nodes
held, T nodes of the call.
"""

from __future__ import annotations

import torch


class LinearStateRing:
    """Conv and recurrent states of one stage's linear-attention layers at its last ``depth`` lengths."""

    def __init__(self, layer_ids: list[int], depth: int):
        if depth < 1:
            raise ValueError(f"a linear-state ring needs at least one slot, got {depth}")
        self.slot = {layer: i for i, layer in enumerate(layer_ids)}
        self.depth = depth
        self.length = 0  # tokens the stage has run
        self._pending = 0  # tokens of the call in progress (set by :meth:`begin`)
        self.conv_RBCK: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.recurrent_RBHDkDv: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._held = [-1] * depth  # the length whose state each slot holds (-1: none)
        # Tree nodes after the base (the committed prefix, ``length`` tokens): their states by tree index.
        self.nodes = 0
        self.node_conv_NCK: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.node_recurrent_NHDkDv: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._call: tuple[int, int, torch.Tensor] | None = None  # tree call: (first, end, parents_T)

    @property
    def layers(self) -> list[int]:
        return list(self.slot)

    # ---------------------------------------------------------------------------- stage protocol
    def begin(self, n_tokens: int) -> None:
        """A call on ``n_tokens`` new tokens starts (the states it writes go to length ``length + n_tokens``)."""
        if self.nodes:
            raise RuntimeError(f"a stage holding {self.nodes} tree nodes was asked to run tokens as a chain; commit "
                               "or drop the tree first")
        self._pending = n_tokens

    def advance(self, n_tokens: int) -> None:
        """The call finished: the stage now holds ``length + n_tokens`` tokens."""
        self.length += n_tokens
        self._held[self.length % self.depth] = self.length
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Restore the state after ``length`` tokens (rollback); it must be one of the last ``depth`` lengths.

        With tree nodes held: ``base + 1`` commits the root and drops the other nodes (a miss), ``<= base`` drops
        them all, ``>= base + nodes`` keeps everything; a length inside the tree has no single state."""
        if self.nodes:
            if length == self.length + 1:
                self._commit_root()
                self.nodes = 0
                return
            if length >= self.length + self.nodes:
                return
            if length > self.length:
                raise RuntimeError(f"cannot cut a stage's tree of {self.nodes} nodes after {self.length} committed "
                                   f"tokens back to {length} tokens: only the root ({self.length + 1}) or the "
                                   "committed prefix has a single linear-attention state")
            self.nodes = 0
        if length >= self.length:
            return
        if length > 0 and self._held[length % self.depth] != length:
            raise RuntimeError(
                f"cannot roll the linear-attention state back from {self.length} to {length} tokens: the ring keeps "
                f"the last {self.depth} lengths only"
            )
        self.length = length

    def can_truncate(self, length: int) -> bool:
        if self.nodes and length > self.length:
            return length == self.length + 1 or length >= self.length + self.nodes
        return length >= self.length or length == 0 or self._held[length % self.depth] == length

    # ------------------------------------------------------------------------------- tree nodes
    def begin_nodes(self, first: int) -> None:
        """A tree call starts at node ``first`` (= the nodes held: levels arrive in BFS order)."""
        if first != self.nodes:
            raise RuntimeError(f"a tree call starting at node {first} reached a stage holding {self.nodes} nodes")
        if self.length == 0:
            raise RuntimeError("a tree call needs a committed prefix (run the prompt first)")

    def select_nodes(self, first: int, end: int, parents_T: torch.Tensor) -> None:
        """The next linear-layer call runs nodes ``[first, end)``, whose parents (``-1``: the base) have run (held
        before this stage call, or in an earlier run of it)."""
        if first < self.nodes or (parents_T.numel() and int(parents_T.max()) >= first):
            raise RuntimeError(f"tree nodes [{first}, {end}) need their parents' states first (held: {self.nodes})")
        self._call = (first, end, parents_T)

    def end_nodes(self, end: int) -> None:
        """The tree call finished: nodes ``[0, end)`` are held."""
        self.nodes, self._call = end, None

    def keep(self, indices: torch.Tensor) -> None:
        """Prune: the root is committed (its state joins the ring) and nodes ``1 + indices`` become nodes
        ``0, 1, ...`` (the KV prune's index set: ``indices`` are offsets from the row after the root)."""
        if not self.nodes:
            raise RuntimeError("a prune reached a stage that holds no tree nodes")
        self._commit_root()
        old_N = (torch.as_tensor(indices, dtype=torch.long).flatten() + 1)
        for states in (self.node_conv_NCK, self.node_recurrent_NHDkDv):
            for i, buf in enumerate(states):
                if buf is not None:
                    buf[: old_N.numel()] = buf[old_N.to(buf.device)]  # advanced indexing copies first
        self.nodes = old_N.numel()

    def _commit_root(self) -> None:
        """Node 0 (the root, now committed) becomes the state after ``length + 1`` tokens."""
        slot = (self.length + 1) % self.depth
        for ring, nodes in ((self.conv_RBCK, self.node_conv_NCK), (self.recurrent_RBHDkDv, self.node_recurrent_NHDkDv)):
            for i, buf in enumerate(nodes):
                if buf is not None:
                    ring[i][slot, 0].copy_(buf[0])
        self.length += 1
        self._held[slot] = self.length

    def _node_buffer(self, states: list, i: int, like: torch.Tensor, end: int) -> torch.Tensor:
        """Layer ``i``'s node states with room for ``end`` nodes (grown geometrically, contents kept)."""
        buf = states[i]
        if buf is None or buf.shape[0] < end:
            new = torch.zeros(max(end, 8, 2 * (buf.shape[0] if buf is not None else 0)), *like.shape,
                              dtype=like.dtype, device=like.device)
            if buf is not None:
                new[: self.nodes] = buf[: self.nodes]
            states[i] = buf = new
        return buf

    def _gather(self, states: list, ring: list, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s node buffer and the call's nodes' parent states ``(T, ...)`` (the base for the root)."""
        first, end, parents_T = self._call
        base = ring[i][self.length % self.depth, 0]
        buf = self._node_buffer(states, i, base, end)
        parents_T = parents_T.to(base.device)
        from_base_T = parents_T < 0
        if bool(from_base_T.all()):
            return buf, base.expand(end - first, *base.shape)
        picked = buf[parents_T.clamp(min=0)]
        if bool(from_base_T.any()):
            picked[from_base_T] = base
        return buf, picked

    # ------------------------------------------------------------------- Hugging Face cache calls
    def _slots(self) -> tuple[int, int]:
        return self.length % self.depth, (self.length + self._pending) % self.depth

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The conv state to continue from; None before the first token (the layer then zero-pads).

        The returned tensor is the *new* slot, holding a copy of the current state: the one-token kernel
        updates it in place, which leaves the current length's state intact for a rollback.
        """
        if self.length == 0:
            return None
        if self._call is not None:  # tree nodes: each continues from its parent's state, in its own slot
            first, end, _ = self._call
            buf, parents_TCK = self._gather(self.node_conv_NCK, self.conv_RBCK, self.slot[layer_idx])
            buf[first:end] = parents_TCK
            return buf[first:end]
        conv_RBCK = self.conv_RBCK[self.slot[layer_idx]]
        old, new = self._slots()
        if new != old:
            conv_RBCK[new].copy_(conv_RBCK[old])
        return conv_RBCK[new]

    def update_conv_state(self, inputs_BCT: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Store the last K conv inputs after this call; return the previous state followed by the new inputs."""
        if self._call is not None:
            raise RuntimeError("tree nodes run through a linear-attention layer one token each (a batch of nodes)")
        i = self.slot[layer_idx]
        if self.conv_RBCK[i] is None:
            b, c, _ = inputs_BCT.shape
            k = conv_kernel_size or inputs_BCT.shape[-1]
            self.conv_RBCK[i] = torch.zeros(self.depth, b, c, k, dtype=inputs_BCT.dtype, device=inputs_BCT.device)
        conv_RBCK = self.conv_RBCK[i]
        old, new = self._slots()
        k = conv_RBCK.shape[-1]
        if self.length == 0:
            full_BCT = inputs_BCT
            padded_BCT = torch.nn.functional.pad(inputs_BCT, (max(0, k - inputs_BCT.shape[-1]), 0))
        else:
            full_BCT = torch.cat([conv_RBCK[old], inputs_BCT], dim=-1)
            padded_BCT = full_BCT
        conv_RBCK[new].copy_(padded_BCT[..., -k:])
        return full_BCT

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The recurrent state after ``length`` tokens (read only by the kernels); None before the first token."""
        if self.length == 0:
            return None
        if self._call is not None:
            return self._gather(self.node_recurrent_NHDkDv, self.recurrent_RBHDkDv, self.slot[layer_idx])[1]
        return self.recurrent_RBHDkDv[self.slot[layer_idx]][self.length % self.depth]

    def update_recurrent_state(self, state_BHDkDv: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the state after this call in its own slot (tree nodes: in the nodes' slots)."""
        i = self.slot[layer_idx]
        if self._call is not None:
            first, end, _ = self._call
            buf = self._node_buffer(self.node_recurrent_NHDkDv, i, state_BHDkDv[0], end)
            buf[first:end] = state_BHDkDv
            return buf[first:end]
        if self.recurrent_RBHDkDv[i] is None:
            self.recurrent_RBHDkDv[i] = torch.zeros(self.depth, *state_BHDkDv.shape, dtype=state_BHDkDv.dtype,
                                                    device=state_BHDkDv.device)
        ring = self.recurrent_RBHDkDv[i]
        ring[self._slots()[1]].copy_(state_BHDkDv)
        return ring[self._slots()[1]]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False
