"""Assembling a pipeline, once: the cut resolved, the target, and the head or draft model loaded.

Every program (spd-generate, spd-serve, the distributed runtime's ranks, the benchmarks) and
:meth:`spd.decoding.engine.Engine.from_pretrained` come here, so a rule about cuts or heads is written once and gives
every caller the same message. :func:`resolve_cut` reads the head's config once and decides the stage count and the
boundaries, checking that the head fits the target before anything is loaded; :func:`load_parts` loads the target (or
takes one already loaded: rank 0's part of the distributed runtime, a benchmark's one model under many cuts), the head
and the draft model; :func:`spd.decoding.factory.load_pipeline` adds the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads.config import cut_problem, depth_problem, equal_cut_problem, misfit
from ..heads.loading import HeadSource, load_speculator, pipeline_cut, read_head
from ..reading import check_model_files
from ..target.cut import cut_flag, split_layers, target_num_layers
from ..target.staging import StagedModel
from .proposers import Draft, load_draft_model
from .spec import DecodingSpec


@dataclass(frozen=True)
class PipelineCut:
    """Where the target is cut: ``n_stages`` stages, at ``boundaries`` (``[0, b1, ..., L]``; None: equal), for the
    head read once (None: no head)."""

    n_stages: int
    boundaries: list[int] | None
    head: HeadSource | None = None

    def over(self, model: torch.nn.Module) -> StagedModel:
        """A causal LM already loaded, cut here."""
        return StagedModel(model, n_stages=self.n_stages, boundaries=self.boundaries)


@dataclass
class PipelineParts:
    """What a load gives: the settings, the cut, the target, its tokenizer, the head or draft model and (from
    :func:`spd.decoding.factory.load_pipeline`) the engine."""

    spec: DecodingSpec
    cut: PipelineCut
    staged: StagedModel
    tokenizer: object | None
    head: torch.nn.Module | None = None
    draft: Draft | None = None
    engine: object | None = None


def resolve_cut(spec: DecodingSpec) -> PipelineCut:
    """The pipeline's stage count and boundaries (``--boundaries``, else the head's cut, else ``--stages`` N cut as
    evenly as the layers allow, default 1), the head's config read once, and a head made for another target or
    pipeline refused, all before any weights load."""
    spec.check_sources()
    # The local config and weights, each named if damaged, before anything loads (a hub id's files arrive whole;
    # the tokenizer's files are checked where they are read, spd.target.tokenizer.load_tokenizer).
    assert spec.target is not None  # check_sources refused a missing target
    check_model_files(spec.target, "target", weights=True)
    if spec.draft_model is not None:
        check_model_files(spec.draft_model, "draft model", weights=True)
    head = read_head(spec.speculator, spec.speculator_revision) if spec.speculator is not None else None
    n_stages, boundaries = pipeline_cut(spec.stages, spec.boundaries, head, None, spec.target, spec.revision)
    # Given, the head's or N stages (equal where N divides the layers, else the larger stages first): one rule,
    # split_layers, so that a stage process of the distributed runtime derives the same cut from the same flags.
    boundaries = split_layers(target_num_layers(spec.target, spec.revision), n_stages, boundaries)
    if head is not None:
        check_fit(head, boundaries, spec)
    return PipelineCut(len(boundaries) - 1, boundaries, head)


def check_fit(head: HeadSource, boundaries: list[int], spec: DecodingSpec, asked: str | None = None) -> None:
    """Refuse a head made for another pipeline before anything loads, naming the head's cut and the one asked for
    (``asked``: who chose it; default: the flag that did), a head the authors cut equally first for a target whose
    layers its n does not divide."""
    num_layers = boundaries[-1]
    if head.authors:  # their heads cut equally, into the n they were trained for
        problem = equal_cut_problem(head.n_stages, num_layers)
        head_boundaries = (
            boundaries if len(boundaries) - 1 == head.n_stages else split_layers(num_layers, head.n_stages)
        )
    else:
        trained = head.boundaries
        assert trained is not None  # ours: the cut it was trained for
        problem = depth_problem(trained[-1], num_layers) if trained[-1] != num_layers else None
        head_boundaries = trained
    if problem is None and head_boundaries != boundaries:
        asked = asked or (
            f"{cut_flag(boundaries)} asks for" if spec.boundaries is not None else f"--stages {spec.stages} asks for"
        )
        problem = cut_problem(head_boundaries, boundaries, asked)
    if problem is not None:
        raise misfit([problem])


def load_parts(
    spec: DecodingSpec,
    tokenizer=None,
    cut: PipelineCut | None = None,
    staged: StagedModel | None = None,
) -> PipelineParts:
    """Load the target cut as :func:`resolve_cut` says (unless ``staged`` is given, already cut), the head attached
    to it and the draft model, in ``spec``'s dtype and device; ``tokenizer`` (loaded by the caller, None for token-id
    prompts) travels with them."""
    cut = cut or resolve_cut(spec)
    dtype = getattr(torch, spec.dtype)
    if staged is None:
        assert spec.target is not None  # resolve_cut checked the sources
        staged = StagedModel.from_pretrained(
            spec.target,
            n_stages=cut.n_stages,
            boundaries=cut.boundaries,
            revision=spec.revision,
            dtype=dtype,
            device=spec.device,
        )
    head = None
    if cut.head is not None:
        head = load_speculator(cut.head, dtype=dtype, device=spec.device, target=staged)
    draft = None
    if spec.draft_model is not None:
        draft = load_draft_model(spec.draft_model, spec.draft_revision, dtype, spec.device)
    return PipelineParts(spec, cut, staged, tokenizer, head, draft)


def load_head(source: str, spec: DecodingSpec, staged: StagedModel) -> torch.nn.Module:
    """A head named once the pipeline runs (a server's new head version): read once, refused as :func:`resolve_cut`
    refuses the starting head if made for another target or cut than ``staged``'s, and loaded onto it in ``spec``'s
    dtype and device."""
    head = read_head(source)
    check_fit(head, list(staged.boundaries), spec, asked="the server's pipeline has")
    return load_speculator(head, dtype=getattr(torch, spec.dtype), device=spec.device, target=staged)
