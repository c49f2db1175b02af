"""The SPD authors' head files: where they are and what is in them, loaded without unpickling code.

A head file is ``torch.save({"state_dict": {name: tensor}, "config": {...}})`` (hub repo
``yuyijiong/speculative_pipeline_decoding``, files ``{Qwen3.5-4B|Qwen3.5-9B}_s{n}_l{Ls}.pt``; branch
``v10`` = the paper's architecture, ``main`` = version 11). It is named by

- a local path (``heads/Qwen3.5-4B_s4_l4.pt``), or
- a hub reference in the ``hf://`` form of ``huggingface_hub``'s file system:
  ``hf://yuyijiong/speculative_pipeline_decoding@v10/Qwen3.5-4B_s4_l4.pt`` (``@revision`` optional:
  a branch, tag or commit, URL-encoded if it contains ``/``; ``--speculator-revision`` also sets it).
  It is fetched with ``hf_hub_download``, so ``HF_HUB_OFFLINE=1`` and the hub cache work as usual.

Files are read with ``torch.load(..., weights_only=True)`` only: a file that needs arbitrary unpickling,
a truncated file, a file of another kind or an unknown ``version`` is refused with one sentence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from ...errors import SpdInputError, first_line

HUB_SCHEME = "hf://"
VERSIONS = (10, 11)
# Config keys every version has, and the ones each version adds.
_COMMON_KEYS = ("hidden_size", "vocab_size", "num_stages", "num_spec_layers", "version")
_VERSION_KEYS = {10: ("shallow_hidden_layer_indices",), 11: ("aggr_feature_bound",)}
FILE_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class AuthorsCheckpoint:
    """A validated head file: its tensors, its config and where it came from."""

    state_dict: dict  # name -> torch.Tensor
    config: dict
    source: str

    @property
    def version(self) -> int:
        return int(self.config["version"])


DIR_MODEL_TYPE = "spd_authors_head"  # config.json model_type of an authors' head converted by spd-convert


def is_authors_file(source: str | Path) -> bool:
    """Whether ``source`` names an authors' head: an ``hf://`` reference, a ``.pt`` file, or a directory that
    ``spd-convert`` wrote from one."""
    text = str(source)
    if text.startswith(HUB_SCHEME):
        return True
    path = Path(text).expanduser()
    if path.is_dir():
        return _dir_model_type(path) == DIR_MODEL_TYPE
    return path.is_file() or (not path.exists() and path.suffix in FILE_SUFFIXES)


def _dir_model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def parse_hub_reference(reference: str) -> tuple[str, str, str | None]:
    """``hf://owner/name[@revision]/path/in/repo.pt`` -> (repo id, file path, revision or None)."""
    rest = reference[len(HUB_SCHEME) :]
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts):
        raise SpdInputError(
            f"the hub reference '{reference}' is malformed; expected "
            "hf://OWNER/REPO[@REVISION]/FILE.pt, e.g. "
            "hf://yuyijiong/speculative_pipeline_decoding@v10/Qwen3.5-4B_s4_l4.pt"
        )
    owner, name = parts[0], parts[1]
    revision = None
    if "@" in name:
        name, revision = name.split("@", 1)
        revision = unquote(revision) or None
    return f"{owner}/{name}", "/".join(parts[2:]), revision


def resolve(source: str | Path, revision: str | None = None) -> Path:
    """The local path of a head file: the path itself, or the hub file downloaded (or found in the cache)."""
    text = str(source)
    if not text.startswith(HUB_SCHEME):
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpdInputError(
                f"the speculator file '{text}' does not exist; expected a .pt file of the SPD "
                "authors or a head directory written by train/distill.py"
            )
        return path
    repo_id, filename, ref_revision = parse_hub_reference(text)
    if ref_revision is not None and revision is not None and ref_revision != revision:
        raise SpdInputError(
            f"the hub reference '{text}' names revision '{ref_revision}' but --speculator-revision "
            f"is '{revision}'; give the revision once"
        )
    from huggingface_hub import hf_hub_download

    from ...paths import hub_problem

    problem = hub_problem(repo_id, ref_revision or revision, filename)
    if problem is not None:
        raise SpdInputError(
            f"could not fetch the speculator '{text}': {problem}; expected a head file the hub has "
            "(with HF_HUB_OFFLINE=1: one in the local hub cache)"
        )
    try:
        return Path(hf_hub_download(repo_id, filename, revision=ref_revision or revision))
    except Exception as exc:  # hub errors come in many classes (offline, 404, auth); all mean "not available"
        raise SpdInputError(
            f"could not fetch '{filename}' from the hub repo '{repo_id}' (revision "
            f"{ref_revision or revision or 'main'}): {first_line(exc)}"
        ) from None


def load_authors_file(source: str | Path, revision: str | None = None) -> AuthorsCheckpoint:
    """Load and validate an authors' head file (``weights_only=True``; never executes code from the file)."""
    from ...reading import torch_load

    if Path(str(source)).expanduser().is_dir():
        return read_directory(Path(str(source)).expanduser())
    path = resolve(source, revision)
    # A zip-format file is memory-mapped: a caller that only needs the config (read_head, before the target is
    # loaded) reads no tensor data, so looking at a multi-GB head file and then loading it does not read it twice.
    blob = torch_load(path, "speculator file", "a head file of plain tensors (the SPD authors' torch.save format)")
    return validate(blob, str(source))


def validate(blob, source: str) -> AuthorsCheckpoint:
    """Check the structure of a loaded head file; one sentence for what is wrong."""
    if (
        not isinstance(blob, dict)
        or not isinstance(blob.get("state_dict"), dict)
        or not isinstance(blob.get("config"), dict)
    ):
        raise SpdInputError(
            f"'{source}' is not an SPD authors' head file: expected a dict with 'state_dict' and 'config'"
        )
    import torch

    config = blob["config"]
    version = config.get("version")
    if version not in VERSIONS:
        raise SpdInputError(
            f"'{source}' has head version {version!r}; this toolkit reads versions {', '.join(map(str, VERSIONS))}"
        )
    missing = [k for k in (*_COMMON_KEYS, *_VERSION_KEYS[version]) if k not in config]
    if missing:
        raise SpdInputError(f"'{source}' (version {version}) lacks config keys {missing}")
    bad = [k for k, v in blob["state_dict"].items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise SpdInputError(f"'{source}' has state_dict entries that are not named tensors: {bad[:3]}")
    wrong = next(((k, v.dtype) for k, v in blob["state_dict"].items() if not v.is_floating_point()), None)
    if wrong is not None:
        raise SpdInputError(f"'{source}' holds '{wrong[0]}' as {wrong[1]}; expected floating-point tensors")
    _check_config(config, blob["state_dict"], source)
    return AuthorsCheckpoint(dict(blob["state_dict"]), dict(config), source)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_config(config: dict, state_dict: dict, source: str) -> None:
    """Types and ranges of the config values the head is built from, checked before any module is: a value of
    the wrong type or size is one sentence, not a crash or a huge allocation."""
    for key in ("hidden_size", "vocab_size", "num_stages", "num_spec_layers"):
        if not _is_int(config[key]) or config[key] < 1:
            raise SpdInputError(f"'{source}' has config {key} = {config[key]!r}; expected a positive integer")
    for key in ("draft_vocab_size", "spec_intermediate_size_fallback"):
        if key in config and config[key] is not None and (not _is_int(config[key]) or config[key] < 1):
            raise SpdInputError(f"'{source}' has config {key} = {config[key]!r}; expected a positive integer")
    # The tower is built with num_spec_layers layers: it must be the number the file holds tensors for.
    layers = {int(k.split(".")[1]) for k in state_dict if k.startswith("spec_layers.") and k.split(".")[1].isdigit()}
    if layers != set(range(config["num_spec_layers"])):
        raise SpdInputError(
            f"'{source}' has config num_spec_layers = {config['num_spec_layers']} but holds tensors "
            f"for {len(layers)} spec layer(s)"
        )
    if config["version"] == 10:
        shallow = config["shallow_hidden_layer_indices"]
        if not (
            isinstance(shallow, list)
            and all(isinstance(a, list) and a and all(_is_int(k) and k >= 0 for k in a) for a in shallow)
        ):
            raise SpdInputError(
                f"'{source}' has config shallow_hidden_layer_indices that are not lists of layer indices"
            )
    else:
        bound = config["aggr_feature_bound"]
        if not (isinstance(bound, list) and bound and all(_is_int(k) and k >= 0 for k in bound)):
            raise SpdInputError(
                f"'{source}' has config aggr_feature_bound = {bound!r}; expected a list of layer indices"
            )
    draft = config.get("draft_token_ids")
    if draft is not None and not (
        isinstance(draft, list) and all(_is_int(t) and t >= 0 for t in draft) and len(draft) <= config["vocab_size"]
    ):
        raise SpdInputError(
            f"'{source}' has config draft_token_ids that are not a list of at most vocab_size "
            f"({config['vocab_size']}) token ids"
        )
    if "trained_with_use_deepest" in config and not isinstance(config["trained_with_use_deepest"], bool):
        raise SpdInputError(
            f"'{source}' has config trained_with_use_deepest = "
            f"{config['trained_with_use_deepest']!r}; expected true or false"
        )


def read_directory(path: Path) -> AuthorsCheckpoint:
    """A directory written by :func:`to_directory` as a validated checkpoint."""
    from ...reading import SAVED, load_safetensors, read_json

    config = read_json(path / "config.json", "speculator's config", SAVED)
    state = load_safetensors(path / "model.safetensors", "speculator's weights file")
    if config.get("model_type") != DIR_MODEL_TYPE or not isinstance(config.get("authors_config"), dict):
        raise SpdInputError(f"'{path}' is not a converted authors' head (model_type '{DIR_MODEL_TYPE}')")
    return validate({"state_dict": state, "config": config["authors_config"]}, str(path))
