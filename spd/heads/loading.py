"""Loading a head: one front door for our heads and the SPD authors' published formats, and the pipeline cut a
head implies.

A head is named by a directory or hub id of ours (:class:`~spd.heads.speculator.Speculator`), a converted authors'
directory, an authors' ``.pt`` file or an ``hf://OWNER/REPO[@REVISION]/FILE.pt`` reference
(:mod:`spd.heads.published`); everything that loads a head goes through here, so no model module knows a file
format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpdInputError, first_line
from ..paths import check_model_source
from .published.authors_file import is_authors_file, load_authors_file
from .config import SpeculatorConfig
from .speculator import Speculator


def load_speculator_config(name_or_path: str, revision: str | None = None) -> SpeculatorConfig:
    """A head's config alone (no weights), with one clear sentence for a wrong path, hub id or non-head directory."""
    source = str(name_or_path)
    check_model_source(source, "speculator")
    config_file = Path(source).expanduser() / "config.json"
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except (OSError, ValueError) as exc:
            raise SpdInputError(
                f"the speculator config '{config_file}' is not valid JSON ({first_line(exc)})"
            ) from None
        if model_type != SpeculatorConfig.model_type:
            raise SpdInputError(
                f"'{source}' holds a '{model_type}' model, not an SPD speculation head "
                f"(model_type '{SpeculatorConfig.model_type}'); expected a directory written by "
                "train/distill.py (e.g. <output_dir>/final)"
            )
    try:
        return SpeculatorConfig.from_pretrained(source, revision=revision)
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load a speculation head from '{source}': {first_line(exc)}") from None


def speculator_stages(name_or_path: str, revision: str | None = None) -> int:
    """The n a head was trained for: from our config.json, or from an authors' head file (``.pt``/``hf://``)."""
    if is_authors_file(name_or_path):
        return int(load_authors_file(name_or_path, revision).config["num_stages"])
    return load_speculator_config(name_or_path, revision).n_stages


def speculator_boundaries(name_or_path: str, revision: str | None = None) -> list[int] | None:
    """The stage boundaries a head was trained for (None for the authors' heads: they cut equally)."""
    if is_authors_file(name_or_path):
        return None
    return list(load_speculator_config(name_or_path, revision).boundaries)


def pipeline_cut(
    stages: int | None,
    boundaries: list[int] | None,
    speculator: str | None = None,
    revision: str | None = None,
    target: str | None = None,
    target_revision: str | None = None,
) -> tuple[int | None, list[int] | None]:
    """``(n_stages, boundaries)`` for :class:`~spd.target.staging.StagedModel`: explicit boundaries, else the head's cut
    (when ``stages`` is not given or agrees with it), else ``stages`` equal stages (default 1).

    With ``target`` the head's cut is checked against the target's depth first, so a head trained for another
    target is refused as such rather than as a bad cut.
    """
    if boundaries is not None:
        return stages, list(boundaries)
    if speculator:
        head_boundaries = speculator_boundaries(speculator, revision)
        if head_boundaries is None:
            return stages or speculator_stages(speculator, revision), None
        if stages is None or stages == len(head_boundaries) - 1:
            if target is not None:
                from ..target.staging import target_num_layers

                num_layers = target_num_layers(target, target_revision)
                if head_boundaries[-1] != num_layers:
                    raise SpdInputError(
                        f"the speculator does not fit this target: it was trained for a target of "
                        f"{head_boundaries[-1]} layers, and this one has {num_layers}"
                    )
            return None, head_boundaries
    return stages or 1, None


def load_speculator(
    name_or_path: str,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    target=None,
):
    """A speculation head with one clear sentence for a wrong path, hub id or non-head directory.

    Our heads: a directory or hub id (``Speculator.from_pretrained``). The SPD authors' released heads: a
    ``.pt`` file or an ``hf://OWNER/REPO[@REVISION]/FILE.pt`` reference (:mod:`spd.heads.published`); those use
    the target's norm, embedding and rotary embedding, so they need ``target`` (a
    :class:`spd.target.staging.StagedModel`) and take its dtype and device.
    """
    if is_authors_file(name_or_path):
        if target is None:
            raise SpdInputError(
                f"'{name_or_path}' is an SPD authors' head file; it is attached to its target when "
                "loaded: pass target=StagedModel (the engines and spd-generate do)"
            )
        from .published.authors_head import load_authors_head

        return load_authors_head(str(name_or_path), target, revision)
    config = load_speculator_config(name_or_path, revision)
    source = str(name_or_path)
    try:
        head = Speculator.from_pretrained(source, config=config, revision=revision, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load a speculation head from '{source}': {first_line(exc)}") from None
    return head.to(device).eval()
