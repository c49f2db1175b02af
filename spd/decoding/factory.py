"""The one place a decoding mode becomes an engine: ``spd-generate``, ``spd-serve``, the runtime's rank 0 and the
benchmark all call :func:`build_engine`.

``ar``, ``pp``, ``spd`` and ``tree`` are :class:`~spd.decoding.engine.Engine`: a chain (``ar``, ``pp``, ``spd``: the
mode picks the proposer) or a tree with the head of width W or a draft model; ``sd`` is serial
drafting (:class:`~spd.decoding.sd.SpeculativeDecoder`) with a head trained with variant=eagle or a draft model.
``stages`` replaces the single-process stages (the runtime's :class:`~spd.runtime.remote.RemoteStages`).
"""

from __future__ import annotations

import torch

from ..errors import SpdInputError
from .spec import MODES, DecodingSpec


def build_engine(
    spec: DecodingSpec,
    staged,
    head,
    tokenizer,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    stages=None,
):
    """The engine for ``spec.mode`` over ``staged`` with ``head`` (a loaded head or None)."""
    if spec.mode not in MODES:
        raise SpdInputError(f"--mode '{spec.mode}' is not a decoding mode; expected one of {', '.join(MODES)}")
    if spec.mode == "sd":
        if stages is not None:
            raise SpdInputError(
                "--mode sd runs the whole target in one process; it has no pipeline stages to "
                "distribute (use --mode spd, pp or tree)"
            )
        from .sd import build_sd_engine

        return build_sd_engine(
            staged, tokenizer, spec.draft_model, spec.draft_revision, spec.draft_steps, dtype, device, head=head
        )
    from .engine import Engine, tree_proposer

    if spec.mode == "tree":
        proposer = tree_proposer(
            staged, head, tokenizer, spec.draft_model, spec.draft_revision, spec.tree_children, dtype, device
        )
        return Engine.tree(
            staged, proposer, spec.tree_width, tokenizer, stages, spec.tree_candidates, spec.tree_max_width
        )
    return Engine.chain(staged, head, tokenizer, stages=stages)
