"""Converting the SPD authors' head files to our directory layout and back (``spd-convert``).

Our layout for an authors' head is a directory with ``config.json`` (``model_type: spd_authors_head``, their
config under ``authors_config``, draft vocabulary included) and ``model.safetensors`` (their tensors under their
names, in their dtype): loadable everywhere a head is (``--speculator DIR``), pushable to a hub repo, and
readable without unpickling. ``to_authors_file`` writes their ``torch.save({"state_dict", "config"})`` layout
back; a round trip reproduces every tensor and config value bit for bit.

Our own heads (``spd.heads.speculator``) are written in their v10 layout where the architecture allows it
(:func:`head_to_authors_file`): one decoder layer (their query row's keys/values come from its running stream,
ours from its fixed memory row, which agree only in the first layer), q/k norms, no per-depth memory
projections (theirs compose across layers), the target's attention shape and a full-width rotary embedding.
Their tower reads the target's final norm where ours has its own: the ratio of the two scales is folded into
the LM head (exact up to rounding). Anything else is refused with one sentence.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...errors import SpdInputError, first_line
from ...files import atomic_file, fsync_path, rename_dir, replace_dir, replace_file, temp_dir_beside
from .authors_file import DIR_MODEL_TYPE, load_authors_file, read_directory

DIR_FILES = ("config.json", "model.safetensors")  # everything to_directory writes, and all a directory of ours holds


def is_converted_directory(path: Path) -> bool:
    """Whether ``path`` is exactly a directory :func:`to_directory` wrote: its two files and nothing else."""
    try:
        if sorted(p.name for p in path.iterdir()) != sorted(DIR_FILES):
            return False
        return json.loads((path / "config.json").read_text()).get("model_type") == DIR_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def check_output_directory(out_dir: str | Path, force: bool = False) -> str:
    """How ``out_dir`` may be written ("new", "ours", "empty", "force"), or one sentence why it may not."""
    out = Path(out_dir).expanduser()
    if not out.exists() and not out.is_symlink():
        return "new"
    if not out.is_dir():
        # Replacing a file with a directory would delete a file we did not write, --force or not.
        raise SpdInputError(
            f"the output '{out_dir}' exists and is not a directory; expected a new or converted head directory"
        )
    if is_converted_directory(out):
        return "ours"
    if not any(out.iterdir()):
        return "empty"
    if not force:
        raise SpdInputError(
            f"the output directory '{out_dir}' already holds files that spd-convert did not write; "
            f"pass a new directory, or --force to write {' and '.join(DIR_FILES)} beside them"
        )
    return "force"


def check_output_file(out_file: str | Path, force: bool = False) -> None:
    """Refuse an existing ``.pt`` output (we cannot tell their files from ours) unless ``force``; never a directory."""
    out = Path(out_file).expanduser()
    if out.is_dir():
        raise SpdInputError(f"the output '{out_file}' is a directory; expected the path of a .pt file to write")
    if out.exists() and not force:
        raise SpdInputError(f"the output file '{out_file}' already exists; pass another path, or --force to replace it")


def _temp_dir_beside(out: Path) -> Path:
    """A new, uniquely named directory in ``out``'s parent (same file system: the final renames are atomic)."""
    try:
        out.resolve().parent.mkdir(parents=True, exist_ok=True)
        return temp_dir_beside(out.resolve())
    except OSError as exc:
        raise SpdInputError(f"cannot write beside '{out}' ({first_line(exc)})") from None


def _remove_converted(old: Path) -> None:
    """Remove a directory :func:`to_directory` wrote: its two files, then the directory (an OSError if it holds
    anything else by now)."""
    for name in DIR_FILES:
        (old / name).unlink(missing_ok=True)
    old.rmdir()


def to_directory(source: str, out_dir: str | Path, revision: str | None = None, force: bool = False) -> Path:
    """An authors' head file (path or ``hf://`` reference) -> our directory layout, written atomically."""
    from safetensors.torch import save_file

    how = check_output_directory(out_dir, force)
    checkpoint = load_authors_file(source, revision)
    out = Path(out_dir).expanduser()
    tmp = _temp_dir_beside(out)
    try:
        tensors = {k: v.contiguous() for k, v in checkpoint.state_dict.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {
            "model_type": DIR_MODEL_TYPE,
            "source": str(source),
            "revision": revision,
            "authors_config": checkpoint.config,
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in DIR_FILES:
            fsync_path(tmp / name)
        # Checked again now that the (slow) work is done: what was there then may have changed.
        how = check_output_directory(out_dir, force)
        if how == "new":
            rename_dir(tmp, out)  # fails rather than replaces if something appeared at out meanwhile
        elif how == "ours" and not out.is_symlink():
            # Swap whole directories, so a reader sees the old head or the new one, never a mix; the old one
            # held only our two files (checked above), and goes back in place if the swap fails.
            replace_dir(tmp, out, discard=_remove_converted)
        else:  # an empty directory, or --force: our files replace their namesakes, nothing else is removed
            for name in DIR_FILES:
                replace_file(tmp / name, out / name)
            tmp.rmdir()
    except OSError as exc:
        raise SpdInputError(f"could not write '{out_dir}' ({first_line(exc)})") from None
    finally:
        if tmp.exists():  # a failure on the way: the temporary directory is ours alone
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_file_atomic(obj, out_file: str | Path, force: bool) -> Path:
    """``torch.save`` to a unique temporary file beside ``out_file``, fsync, rename over it
    (:func:`spd.files.atomic_file`); cleaned up on failure."""
    import torch

    check_output_file(out_file, force)
    out = Path(out_file).expanduser()
    writing = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out, "wb") as f:
            writing = True
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the slow part done before the check, not between the check and the rename
            check_output_file(out_file, force)
    except OSError as exc:
        if not writing:
            raise SpdInputError(f"cannot write beside '{out_file}' ({first_line(exc)})") from None
        raise SpdInputError(f"could not write '{out_file}' ({first_line(exc)})") from None
    return out


def to_authors_file(source_dir: str | Path, out_file: str | Path, force: bool = False) -> Path:
    """Our directory of an authors' head -> their ``.pt`` layout, written atomically (an existing file only with
    ``force``)."""
    check_output_file(out_file, force)
    source_dir = Path(source_dir)
    config_file = source_dir / "config.json"
    model_type = None
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except ValueError:
            pass
    if model_type == "spd_speculator":
        raise SpdInputError(
            f"'{source_dir}' is one of our heads: convert it with head_to_authors_file (it needs "
            "the target) or spd-convert --target"
        )
    checkpoint = read_directory(source_dir)
    return _save_file_atomic({"state_dict": checkpoint.state_dict, "config": checkpoint.config}, out_file, force)


def head_to_authors_file(head_dir: str | Path, target, out_file: str | Path, force: bool = False) -> Path:
    """One of our heads -> their v10 ``.pt`` file, for its target ``target`` (a StagedModel); atomic."""
    from ..config import check_compatible
    from ..loading import load_speculator

    check_output_file(out_file, force)
    head = load_speculator(str(head_dir))
    cfg, tcfg = head.config, target.config
    check_compatible(cfg, target)
    n, d = cfg.n_stages, cfg.hidden_size
    why = _v10_problems(cfg, target)
    if why:
        raise SpdInputError(f"the head '{head_dir}' cannot be written in the authors' layout: " + "; ".join(why))
    scale = target.norm_scale().double()
    if bool((scale.abs() < 1e-6).any()):
        raise SpdInputError("the target's final norm has zero scales; the head's own norm cannot be folded into it")
    state = _v10_state(head, scale)
    config = {
        "hidden_size": d,
        "vocab_size": cfg.vocab_size,
        "model_type": tcfg.model_type,
        "base_model_path": cfg.target_name_or_path,
        "draft_vocab_size": cfg.vocab_size,
        "num_stages": n,
        "num_spec_layers": cfg.num_layers,
        "version": 10,
        "trained_with_use_deepest": True,
        "shallow_hidden_layer_indices": [list(cfg.anchors[n - b]) for b in range(n)],
    }
    return _save_file_atomic(
        {"state_dict": {k: v.detach().clone().contiguous() for k, v in state.items()}, "config": config},
        out_file,
        force,
    )


def _v10_problems(cfg, target) -> list[str]:
    """Why one of our heads (config ``cfg``) cannot be written in their v10 layout for ``target``: none if it can."""
    n, tcfg = cfg.n_stages, target.config
    rotary_dim = target.rotary_emb.inv_freq.numel() * 2
    why = []
    if cfg.num_layers != 1:
        why.append(
            f"it has {cfg.num_layers} layers (their query row's keys come from its running stream: only one "
            "layer agrees)"
        )
    if cfg.memory_proj:
        why.append("it has per-depth memory projections (theirs compose across layers)")
    if not cfg.qk_norm:
        why.append("it has no q/k norms (their layers always apply them)")
    if cfg.schedule != "input" or cfg.max_depth != n or cfg.anchors[0] != [0]:
        why.append("it is not an input-state SPD head with g^0 = FC(H^0)")
    shape = (tcfg.num_attention_heads, target.kv_heads, target.head_dim, tcfg.intermediate_size)
    if (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) != shape:
        why.append("its attention/MLP shape differs from the target's (their layers take the target's)")
    if rotary_dim != cfg.head_dim:
        why.append("the target's rotary embedding covers only part of each head (ours covers all of it)")
    return why


def _v10_state(head, scale):
    """The head's tensors under their v10 names: identity per-layer projections, and the ratio of our norm's scales
    to the target's (``scale``) folded into the LM head."""
    import torch

    cfg = head.config
    n, d = cfg.n_stages, cfg.hidden_size
    state = {f"stage_projs.{b}.weight": head.fc[str(n - b)].weight for b in range(n)}
    state["g0_proj.weight"] = head.fc["0"].weight
    eye = torch.eye(d, dtype=head.lm_head.weight.dtype)
    for j, layer in enumerate(head.layers):
        for i in range(n):
            state[f"fixed_stage_per_layer_projs.{j}.{i}.weight"] = eye
        pre = f"spec_layers.{j}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            state[pre + f"self_attn.{name}.weight"] = getattr(layer, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[pre + f"mlp.{name}.weight"] = getattr(layer, name).weight
        state[pre + "input_layernorm.weight"] = layer.input_layernorm.weight
        state[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    # lm_head(ours_norm(x)) = lm_head(diag(w / g) target_norm(x)) for equal epsilons.
    folded = head.lm_head.weight.double() * (head.norm.weight.double() / scale)[None, :]
    state["lm_head.weight"] = folded.to(head.lm_head.weight.dtype)
    return state
