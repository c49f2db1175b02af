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
one recurrent state per tree node it has run, numbered like its KV rows (node ``i`` = row ``base + i``, the
root ``0``) and held in pool slots through a slot table. A level of ``T`` nodes runs through a linear layer as a
batch of ``T`` one-token sequences: each starts from its parent's state (the base for the root; a view where
the parents are one node or consecutive slots, else a gathered copy), and the one-token kernels' new states go
into the nodes' slots (:meth:`select_nodes`); no loop over nodes. A prune commits the root (its state is copied
into the ring as the state at ``base + 1``) and keeps the surviving subtree with the index set of the KV prune,
moving slot numbers, not states (:meth:`keep`); a miss commits the root and frees the rest (:meth:`truncate`
to ``base + 1``). Memory per stage: one conv state (``C x K``) and one recurrent state
(``H x Dk x Dv``) per linear layer per tree node in flight, at most ``n * W + 1`` nodes (Qwen3.5-4B, fp32:
1 MiB per layer per node), grown geometrically as the tree grows.

The class implements the calls Hugging Face's ``Qwen3_5GatedDeltaNet`` (and ``Qwen3NextGatedDeltaNet``)
make on their ``cache_params``: ``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, and those of :class:`NoPastRecording`.

Shapes: R ring slots, B batch, C conv channels, K conv kernel, H value heads, Dk/Dv head dims, P pool slots for
tree nodes, T nodes of the call.
"""

from __future__ import annotations

import torch


class NoPastRecording:
    """The calls of transformers' linear-attention layers that every cache of spd answers the same way: none records
    its past (spd rolls back through its own ring), so no intermediate recurrent state is to be kept, and none needs
    the token count that transformers >= 5.25 keeps after an in-place conv update (spd's caches count in
    ``advance``)."""

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass


class LinearStateRing(NoPastRecording):
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
        # Tree nodes after the base (the committed prefix, ``length`` tokens): node i's states are in pool slot
        # node_slot[i], so a prune moves integers, not states.
        self.nodes = 0
        self.node_slot = torch.zeros(0, dtype=torch.long)
        self.node_conv_PCK: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.node_recurrent_PHDkDv: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._pool_size = 0
        self._free: list[int] = []  # free pool slots (popped from the end)
        self._call: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (slots, parent slots, from base)
        self._conv_TCK: dict[int, torch.Tensor] = {}  # the call's conv states, updated in place by the kernel

    @property
    def layers(self) -> list[int]:
        return list(self.slot)

    # ---------------------------------------------------------------------------- stage protocol
    def begin(self, n_tokens: int) -> None:
        """A call on ``n_tokens`` new tokens starts (the states it writes go to length ``length + n_tokens``)."""
        if self.nodes:
            raise RuntimeError(
                f"a stage holding {self.nodes} tree nodes was asked to run tokens as a chain; commit "
                "or drop the tree first"
            )
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
                self._drop_nodes()
                return
            if length >= self.length + self.nodes:
                return
            if length > self.length:
                raise RuntimeError(
                    f"cannot cut a stage's tree of {self.nodes} nodes after {self.length} committed "
                    f"tokens back to {length} tokens: only the root ({self.length + 1}) or the "
                    "committed prefix has a single linear-attention state"
                )
            self._drop_nodes()
        if length >= self.length:
            return
        if length > 0 and self._held[length % self.depth] != length:
            raise RuntimeError(
                f"cannot roll the linear-attention state back from {self.length} to {length} tokens: the ring keeps "
                f"the last {self.depth} lengths only"
            )
        self.length = length

    # ------------------------------------------------------------------------------- tree nodes
    def begin_nodes(self, first: int, count: int) -> None:
        """A tree call on nodes ``[first, first + count)`` starts (``first`` = the nodes held: BFS order); each
        gets a slot in the node pools."""
        if first != self.nodes:
            raise RuntimeError(f"a tree call starting at node {first} reached a stage holding {self.nodes} nodes")
        if self.length == 0:
            raise RuntimeError("a tree call needs a committed prefix (run the prompt first)")
        while len(self._free) < count:
            self._grow()
        new = torch.tensor([self._free.pop() for _ in range(count)], dtype=torch.long)
        self.node_slot = torch.cat([self.node_slot[: self.nodes], new])

    def select_nodes(self, first: int, end: int, parents_T: torch.Tensor) -> None:
        """The next linear-layer call runs nodes ``[first, end)``, whose parents (``-1``: the base) have run (held
        before this stage call, or in an earlier run of it)."""
        if first < self.nodes or end > self.node_slot.numel() or (parents_T.numel() and int(parents_T.max()) >= first):
            raise RuntimeError(f"tree nodes [{first}, {end}) need their parents' states first (held: {self.nodes})")
        from_base_T = parents_T < 0
        parent_slots_T = torch.where(from_base_T, -1, self.node_slot[parents_T.clamp(min=0)])
        self._call = (self.node_slot[first:end], parent_slots_T, from_base_T)

    def end_nodes(self, end: int) -> None:
        """The tree call finished: nodes ``[0, end)`` are held."""
        self.nodes, self._call = end, None

    def keep(self, indices: torch.Tensor) -> None:
        """Prune: the root is committed (its state joins the ring) and nodes ``1 + indices`` become nodes
        ``0, 1, ...`` (the KV prune's index set: ``indices`` are offsets from the row after the root). Only the
        slot table moves; no state is copied but the root's."""
        if not self.nodes:
            raise RuntimeError("a prune reached a stage that holds no tree nodes")
        self._commit_root()
        kept_N = self.node_slot[torch.as_tensor(indices, dtype=torch.long).flatten() + 1]
        dropped = set(self.node_slot[: self.nodes].tolist()) - set(kept_N.tolist())
        self._free.extend(sorted(dropped, reverse=True))
        self.node_slot, self.nodes = kept_N, kept_N.numel()

    def _drop_nodes(self) -> None:
        self._free.extend(sorted(self.node_slot[: self.nodes].tolist(), reverse=True))
        self.node_slot, self.nodes = self.node_slot[:0], 0

    def _commit_root(self) -> None:
        """Node 0 (the root, now committed) becomes the state after ``length + 1`` tokens."""
        slot, root = (self.length + 1) % self.depth, int(self.node_slot[0])
        for ring, pool in ((self.conv_RBCK, self.node_conv_PCK), (self.recurrent_RBHDkDv, self.node_recurrent_PHDkDv)):
            for i, buf in enumerate(pool):
                if buf is not None:
                    ring[i][slot, 0].copy_(buf[root])
        self.length += 1
        self._held[slot] = self.length

    def _grow(self) -> None:
        """Room for twice as many nodes (at least 8): the pools grow, their contents kept."""
        old = self._pool_size
        self._pool_size = max(8, 2 * old)
        self._free.extend(range(self._pool_size - 1, old - 1, -1))
        for pool in (self.node_conv_PCK, self.node_recurrent_PHDkDv):
            for i, buf in enumerate(pool):
                if buf is not None:
                    new = buf.new_zeros(self._pool_size, *buf.shape[1:])
                    new[:old] = buf
                    pool[i] = new

    def _pool(self, pool: list, i: int, like: torch.Tensor) -> torch.Tensor:
        if pool[i] is None:
            pool[i] = torch.zeros(self._pool_size, *like.shape, dtype=like.dtype, device=like.device)
        return pool[i]

    def _parent_states(self, pool: list, ring: list, i: int) -> torch.Tensor:
        """The call's nodes' parent states ``(T, ...)`` of layer ``i`` (the base for the root): a view where the
        parents are one node or consecutive slots (a chain, W = 1), else a gathered copy."""
        _, parent_slots_T, from_base_T = self._call
        base = ring[i][self.length % self.depth, 0]
        buf = self._pool(pool, i, base)
        t = parent_slots_T.numel()
        if bool(from_base_T.all()):
            return base.expand(t, *base.shape)
        first_slot = int(parent_slots_T[0])
        if not bool(from_base_T.any()):
            if bool((parent_slots_T == first_slot).all()):
                return buf[first_slot].expand(t, *base.shape)
            if bool((parent_slots_T == torch.arange(first_slot, first_slot + t)).all()):
                return buf[first_slot : first_slot + t]
        picked = buf[parent_slots_T.clamp(min=0).to(buf.device)]
        picked[from_base_T.to(buf.device)] = base
        return picked

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
        if self._call is not None:  # tree nodes: each continues from a copy of its parent's state
            i = self.slot[layer_idx]
            conv_TCK = self._parent_states(self.node_conv_PCK, self.conv_RBCK, i).clone()
            self._conv_TCK[i] = conv_TCK  # the kernel updates it in place; stored with the recurrent state
            return conv_TCK
        conv_RBCK = self.conv_RBCK[self.slot[layer_idx]]
        old, new = self._slots()
        if new != old:
            conv_RBCK[new].copy_(conv_RBCK[old])
        return conv_RBCK[new]

    def update_conv_state(
        self,
        inputs_BCT: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
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
            return self._parent_states(self.node_recurrent_PHDkDv, self.recurrent_RBHDkDv, self.slot[layer_idx])
        return self.recurrent_RBHDkDv[self.slot[layer_idx]][self.length % self.depth]

    def update_recurrent_state(
        self, state_BHDkDv: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        """Store the state after this call in its own slot (tree nodes: in the nodes' slots)."""
        i = self.slot[layer_idx]
        if self._call is not None:  # the nodes' new states (the kernel made the conv ones in place) into their slots
            slots_T = self._call[0].to(state_BHDkDv.device)
            self._pool(self.node_recurrent_PHDkDv, i, state_BHDkDv[0])[slots_T] = state_BHDkDv
            conv_TCK = self._conv_TCK.pop(i)
            self._pool(self.node_conv_PCK, i, conv_TCK[0])[slots_T] = conv_TCK
            return state_BHDkDv
        if self.recurrent_RBHDkDv[i] is None:
            self.recurrent_RBHDkDv[i] = torch.zeros(
                self.depth, *state_BHDkDv.shape, dtype=state_BHDkDv.dtype, device=state_BHDkDv.device
            )
        ring = self.recurrent_RBHDkDv[i]
        ring[self._slots()[1]].copy_(state_BHDkDv)
        return ring[self._slots()[1]]


class StackedStates(NoPastRecording):
    """The linear-attention states of several stage caches (one per request of a ragged call, :mod:`spd.target.ragged`)
    as one batch, for a layer call in which each member runs one-token sequences from its own states: a chain's next
    token (``count`` 1), or the nodes of one depth of a tree (``count`` nodes; :meth:`LinearStateRing.select_nodes`
    done). The layer sees the members' states stacked along the batch; its new states go back to each member's ring,
    exactly where the member's own call would have put them. Every member must hold a committed prefix (a first
    token runs on its own: its layer call takes the multi-token path)."""

    def __init__(self, members: list, counts: list[int]):
        self.members, self.counts = members, counts
        self._conv: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # layer -> (stacked, members' tensors)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        parts = [member.get_conv_state(layer_idx) for member in self.members]
        if any(part is None for part in parts):
            raise RuntimeError("a stacked linear-attention call needs every member's committed state")
        stacked = torch.cat(parts)  # the one-token kernel updates it in place; copied back in update_recurrent_state
        self._conv[layer_idx] = (stacked, parts)
        return stacked

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return torch.cat([member.get_recurrent_state(layer_idx) for member in self.members])

    def update_conv_state(self, *args, **kwargs):
        raise RuntimeError("a stacked linear-attention call runs one token per sequence")

    def update_recurrent_state(
        self, state_BHDkDv: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        stacked, parts = self._conv.pop(layer_idx)
        offset = 0
        for member, part, count in zip(self.members, parts, self.counts):
            part.copy_(stacked[offset : offset + count])  # the member's conv state after the token, where it reads it
            member.update_recurrent_state(state_BHDkDv[offset : offset + count], layer_idx)
            offset += count
        return state_BHDkDv
