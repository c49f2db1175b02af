"""The one place a decoding mode becomes an engine: ``spd-generate``, ``spd-serve``, the runtime's rank 0 and the
benchmark all call :func:`build_engine`.

``ar``, ``pp``, ``spd`` and ``tree`` are :class:`~spd.decoding.engine.Engine`: a chain (``ar``, ``pp``, ``spd``: the
mode picks the proposer) or a tree with the head of width W or a draft model; ``sd`` is serial
drafting (:class:`~spd.decoding.sd.SpeculativeDecoder`) with a head trained with variant=eagle or a draft model.
``stages`` replaces the single-process stages (the runtime's :class:`~spd.runtime.remote.RemoteStages`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..errors import SpdInputError

MODES = ("ar", "pp", "spd", "tree", "sd")


@dataclass
class DecodingSpec:
    """A mode and the settings of its token source (the CLI's and the server's flags of the same names)."""

    mode: str = "spd"
    draft_model: str | None = None  # tree / sd: a small causal LM sharing the target's tokenizer
    draft_revision: str | None = None
    draft_steps: int = 4  # sd: m
    tree_width: int | str = 4  # tree: W, or "auto"
    tree_children: int = 4  # tree: K
    tree_candidates: str = "auto"  # tree at T > 0: sampled (auto) or top-k
    tree_max_width: int = 8  # tree with W = auto

    @classmethod
    def of(cls, settings, **overrides) -> DecodingSpec:
        """From any object with these attribute names (the CLI's parsed flags, the server's PipelineSpec)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        return cls(**{**values, **overrides})


def build_engine(spec: DecodingSpec, staged, head, tokenizer, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", stages=None):
    """The engine for ``spec.mode`` over ``staged`` with ``head`` (a loaded head or None)."""
    if spec.mode not in MODES:
        raise SpdInputError(f"--mode '{spec.mode}' is not a decoding mode; expected one of {', '.join(MODES)}")
    if spec.mode == "sd":
        if stages is not None:
            raise SpdInputError("--mode sd runs the whole target in one process; it has no pipeline stages to "
                                "distribute (use --mode spd, pp or tree)")
        from .sd import build_sd_engine

        return build_sd_engine(staged, tokenizer, spec.draft_model, spec.draft_revision, spec.draft_steps, dtype,
                               device, head=head)
    from .engine import Engine, tree_proposer

    if spec.mode == "tree":
        proposer = tree_proposer(staged, head, tokenizer, spec.draft_model, spec.draft_revision, spec.tree_children,
                                 dtype, device)
        return Engine.tree(staged, proposer, spec.tree_width, tokenizer, stages, spec.tree_candidates,
                           spec.tree_max_width)
    return Engine.chain(staged, head, tokenizer, stages=stages)
