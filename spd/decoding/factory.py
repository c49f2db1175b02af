"""The one place a decoding mode becomes an engine: ``spd-generate``, ``spd-serve``, the runtime's rank 0 and the
benchmarks all call :func:`load_pipeline` (load and build) or :func:`build_engine` (build from loaded parts).

``ar``, ``pp``, ``spd`` and ``tree`` are :class:`~spd.decoding.engine.Engine`: a chain (``ar``, ``pp``, ``spd``: the
mode picks the proposer) or a tree with the head of width W or a draft model; ``sd`` is serial
drafting (:class:`~spd.decoding.sd.SpeculativeDecoder`) with a head trained with variant=eagle or a draft model.
``stages``, a stage back-end, replaces the single-process one (the runtime's :class:`~spd.runtime.remote.RemoteStages`).
"""

from __future__ import annotations

from ..errors import SpdInputError
from ..target.staging import StagedModel
from .loader import PipelineCut, PipelineParts, load_parts
from .modes import MODES
from .proposers import Draft
from .spec import DecodingSpec


def build_engine(spec: DecodingSpec, staged: StagedModel, head, tokenizer, draft: Draft | None = None, stages=None):
    """The engine for ``spec.mode`` over loaded parts: ``staged``, ``head`` (a loaded head or None) and ``draft`` (a
    loaded draft model or None)."""
    if spec.mode not in MODES:
        raise SpdInputError(f"--mode '{spec.mode}' is not a decoding mode; expected one of {', '.join(MODES)}")
    if spec.mode == "sd":
        if stages is not None:
            raise SpdInputError(
                "--mode sd runs the whole target in one process; it has no pipeline stages to "
                "distribute (use --mode spd, pp or tree)"
            )
        from .sd import sd_engine

        return sd_engine(staged, tokenizer, spec.draft_steps, head=head, draft=draft)
    from .engine import Engine

    return Engine.build(spec, staged, head, tokenizer, draft, stages)


def load_pipeline(
    spec: DecodingSpec,
    tokenizer=None,
    cut: PipelineCut | None = None,
    staged: StagedModel | None = None,
    stages=None,
) -> PipelineParts:
    """Resolve the cut, load the target (unless ``staged`` is given) and the head or draft model, and build the
    engine of ``spec.mode`` (:func:`spd.decoding.loader.load_parts`, then :func:`build_engine`)."""
    parts = load_parts(spec, tokenizer, cut, staged)
    parts.engine = build_engine(spec, parts.staged, parts.head, tokenizer, parts.draft, stages)
    return parts
