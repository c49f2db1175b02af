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

The class implements the calls Hugging Face's ``Qwen3_5GatedDeltaNet`` (and ``Qwen3NextGatedDeltaNet``)
make on their ``cache_params``: ``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``is_recording_past``.

Shapes: R ring slots, B batch, C conv channels, K conv kernel, H value heads, Dk/Dv head dims.
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

    @property
    def layers(self) -> list[int]:
        return list(self.slot)

    # ---------------------------------------------------------------------------- stage protocol
    def begin(self, n_tokens: int) -> None:
        """A call on ``n_tokens`` new tokens starts (the states it writes go to length ``length + n_tokens``)."""
        self._pending = n_tokens

    def advance(self, n_tokens: int) -> None:
        """The call finished: the stage now holds ``length + n_tokens`` tokens."""
        self.length += n_tokens
        self._held[self.length % self.depth] = self.length
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Restore the state after ``length`` tokens (rollback); it must be one of the last ``depth`` lengths."""
        if length >= self.length:
            return
        if length > 0 and self._held[length % self.depth] != length:
            raise RuntimeError(
                f"cannot roll the linear-attention state back from {self.length} to {length} tokens: the ring keeps "
                f"the last {self.depth} lengths only"
            )
        self.length = length

    def can_truncate(self, length: int) -> bool:
        return length >= self.length or length == 0 or self._held[length % self.depth] == length

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
        conv_RBCK = self.conv_RBCK[self.slot[layer_idx]]
        old, new = self._slots()
        if new != old:
            conv_RBCK[new].copy_(conv_RBCK[old])
        return conv_RBCK[new]

    def update_conv_state(self, inputs_BCT: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Store the last K conv inputs after this call; return the previous state followed by the new inputs."""
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
        return self.recurrent_RBHDkDv[self.slot[layer_idx]][self.length % self.depth]

    def update_recurrent_state(self, state_BHDkDv: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the state after this call in its own slot."""
        i = self.slot[layer_idx]
        if self.recurrent_RBHDkDv[i] is None:
            self.recurrent_RBHDkDv[i] = torch.zeros(self.depth, *state_BHDkDv.shape, dtype=state_BHDkDv.dtype,
                                                    device=state_BHDkDv.device)
        ring = self.recurrent_RBHDkDv[i]
        ring[self._slots()[1]].copy_(state_BHDkDv)
        return ring[self._slots()[1]]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False
