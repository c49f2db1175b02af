"""Loading a head: one front door for our heads and the SPD authors' published formats, and the pipeline cut a
head implies.

A head is named by a directory or hub id of ours (:class:`~spd.heads.speculator.Speculator`), a converted authors'
directory, an authors' ``.pt`` file or an ``hf://OWNER/REPO[@REVISION]/FILE.pt`` reference
(:mod:`spd.heads.published`); everything that loads a head goes through here, so no model module knows a file
format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpdInputError, first_line
from ..paths import check_model_source
from ..reading import SAVED, check_model_files, read_json
from .config import SpeculatorConfig, depth_problem, misfit
from .published.authors_file import AuthorsCheckpoint, is_authors_file, load_authors_file
from .speculator import Speculator


def load_speculator_config(name_or_path: str, revision: str | None = None) -> SpeculatorConfig:
    """A head's config alone (no weights), with one clear sentence for a wrong path, hub id or non-head directory."""
    source = str(name_or_path)
    check_model_source(source, "speculator", revision)
    config_file = Path(source).expanduser() / "config.json"
    if config_file.exists():
        model_type = read_json(config_file, "speculator's config", SAVED).get("model_type")
        if model_type != SpeculatorConfig.model_type:
            raise SpdInputError(
                f"'{source}' holds a '{model_type}' model, not an SPD speculation head "
                f"(model_type '{SpeculatorConfig.model_type}'); expected a directory written by "
                "train/distill.py (e.g. <output_dir>/final)"
            )
    try:
        # transformers annotates revision as str, but None is its default (the main branch).
        return SpeculatorConfig.from_pretrained(source, revision=revision)  # type: ignore[arg-type]
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load a speculation head from '{source}': {first_line(exc)}") from None


@dataclass
class HeadSource:
    """A head as named, its format told once and its config read once: ours (a :class:`SpeculatorConfig`) or the SPD
    authors' (their checkpoint, read when first asked for, its tensors mapped rather than read until the head is
    built)."""

    name: str
    revision: str | None
    config: SpeculatorConfig | None = None  # ours; None: the authors'
    _checkpoint: AuthorsCheckpoint | None = None

    @property
    def authors(self) -> bool:
        return self.config is None

    @property
    def checkpoint(self) -> AuthorsCheckpoint:
        """The authors' head file (an AuthorsCheckpoint), read once."""
        if self._checkpoint is None:
            self._checkpoint = load_authors_file(self.name, self.revision)
        return self._checkpoint

    @property
    def n_stages(self) -> int:
        """The n it was trained for."""
        if self.config is None:
            return int(self.checkpoint.config["num_stages"])
        return self.config.n_stages

    @property
    def boundaries(self) -> list[int] | None:
        """The cut it was trained for (None for the authors' heads: they cut equally)."""
        return None if self.config is None else list(self.config.boundaries)


def read_head(name_or_path: str | HeadSource, revision: str | None = None) -> HeadSource:
    """A head's format and config (no weights), told and read once for everything a load asks of it."""
    if isinstance(name_or_path, HeadSource):
        return name_or_path
    if is_authors_file(name_or_path):
        return HeadSource(str(name_or_path), revision)
    return HeadSource(str(name_or_path), revision, config=load_speculator_config(name_or_path, revision))


def pipeline_cut(
    stages: int | None,
    boundaries: list[int] | None,
    speculator: str | HeadSource | None = None,
    revision: str | None = None,
    target: str | None = None,
    target_revision: str | None = None,
) -> tuple[int | None, list[int] | None]:
    """``(n_stages, boundaries)`` for :class:`~spd.target.staging.StagedModel`: explicit boundaries, else the head's cut
    (when ``stages`` is not given or agrees with it), else ``stages`` stages (default 1; cut by
    :func:`~spd.target.cut.split_layers`: equal where they divide the layers, else the larger stages first).

    With ``target`` the head's cut is checked against the target's depth first, so a head trained for another
    target is refused as such rather than as a bad cut.
    """
    if boundaries is not None:
        return stages, list(boundaries)
    if speculator:
        head = read_head(speculator, revision)
        if head.boundaries is None:
            return stages or head.n_stages, None
        if stages is None or stages == head.n_stages:
            if target is not None:
                from ..target.cut import target_num_layers

                num_layers = target_num_layers(target, target_revision)
                if head.boundaries[-1] != num_layers:
                    raise misfit([depth_problem(head.boundaries[-1], num_layers)])
            return None, head.boundaries
    return stages or 1, None


def load_speculator(
    name_or_path: str | HeadSource,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    target=None,
):
    """A speculation head with one clear sentence for a wrong path, hub id or non-head directory.

    Our heads: a directory or hub id (``Speculator.from_pretrained``). The SPD authors' released heads: a
    ``.pt`` file or an ``hf://OWNER/REPO[@REVISION]/FILE.pt`` reference (:mod:`spd.heads.published`); those use
    the target's norm, embedding and rotary embedding, so they need ``target`` (a
    :class:`spd.target.staging.StagedModel`) and take its dtype and device. ``name_or_path`` may be a
    :class:`HeadSource` already read (:func:`read_head`): nothing is read twice.
    """
    head = read_head(name_or_path, revision)
    if head.authors:
        if target is None:
            raise SpdInputError(
                f"'{head.name}' is an SPD authors' head file; it is attached to its target when "
                "loaded: pass target=StagedModel (the engines and spd-generate do)"
            )
        from .published.authors_head import AuthorsHead

        return AuthorsHead(head.checkpoint, target)
    from safetensors import SafetensorError

    check_model_files(head.name, "speculator", weights=True)
    try:
        # transformers annotates revision as str, but None is its default (the main branch).
        loaded = Speculator.from_pretrained(
            head.name,
            config=head.config,
            revision=head.revision,  # type: ignore[arg-type]
            dtype=dtype,
        )
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise SpdInputError(f"could not load a speculation head from '{head.name}': {first_line(exc)}") from None
    # PreTrainedModel.to's decorator hides nn.Module.to's signature from the type checker.
    return loaded.to(device).eval()  # type: ignore[arg-type]
