"""Converting the SPD authors' head files to our directory layout and back (``spd-convert``).

Our layout for an authors' head is a directory with ``config.json`` (``model_type: spd_authors_head``, their
config under ``authors_config``, draft vocabulary included) and ``model.safetensors`` (their tensors under their
names, in their dtype): loadable everywhere a head is (``--speculator DIR``), pushable to a hub repo, and
readable without unpickling. ``to_authors_file`` writes their ``torch.save({"state_dict", "config"})`` layout
back; a round trip reproduces every tensor and config value bit for bit.

Our own heads (``spd.speculator``) are written in their v10 layout where the architecture allows it
(:func:`head_to_authors_file`): one decoder layer (their query row's keys/values come from its running stream,
ours from its fixed memory row, which agree only in the first layer), q/k norms, no per-depth memory
projections (theirs compose across layers), the target's attention shape and a full-width rotary embedding.
Their tower reads the target's final norm where ours has its own: the ratio of the two scales is folded into
the LM head (exact up to rounding). Anything else is refused with one sentence.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import SpdInputError
from .authors_file import DIR_MODEL_TYPE, AuthorsCheckpoint, load_authors_file, validate


def to_directory(source: str, out_dir: str | Path, revision: str | None = None) -> Path:
    """An authors' head file (path or ``hf://`` reference) -> our directory layout, written atomically."""
    from safetensors.torch import save_file

    checkpoint = load_authors_file(source, revision)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in checkpoint.state_dict.items()}
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": DIR_MODEL_TYPE, "source": str(source), "revision": revision,
              "authors_config": checkpoint.config}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def read_directory(path: Path) -> AuthorsCheckpoint:
    """A directory written by :func:`to_directory` as a validated checkpoint."""
    from safetensors.torch import load_file

    try:
        config = json.loads((path / "config.json").read_text())
        state = load_file(path / "model.safetensors")
    except (OSError, ValueError) as exc:
        raise SpdInputError(f"'{path}' is not a readable converted authors' head ({exc})") from None
    if config.get("model_type") != DIR_MODEL_TYPE or not isinstance(config.get("authors_config"), dict):
        raise SpdInputError(f"'{path}' is not a converted authors' head (model_type '{DIR_MODEL_TYPE}')")
    return validate({"state_dict": state, "config": config["authors_config"]}, str(path))


def to_authors_file(source_dir: str | Path, out_file: str | Path) -> Path:
    """Our directory of an authors' head -> their ``.pt`` layout, written atomically."""
    import torch

    source_dir = Path(source_dir)
    config_file = source_dir / "config.json"
    model_type = None
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except ValueError:
            pass
    if model_type == "spd_speculator":
        raise SpdInputError(f"'{source_dir}' is one of our heads: convert it with head_to_authors_file (it needs "
                            "the target) or spd-convert --target")
    checkpoint = read_directory(source_dir)
    out = Path(out_file)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"state_dict": checkpoint.state_dict, "config": checkpoint.config}, tmp)
    os.replace(tmp, out)
    return out


def head_to_authors_file(head_dir: str | Path, target, out_file: str | Path) -> Path:
    """One of our heads -> their v10 ``.pt`` file, for its target ``target`` (a StagedModel); atomic."""
    import torch

    from ..speculator import check_compatible, load_speculator

    head = load_speculator(str(head_dir))
    cfg, tcfg = head.config, target.config
    check_compatible(cfg, target)
    n, d = cfg.n_stages, cfg.hidden_size
    rotary_dim = target.rotary_emb.inv_freq.numel() * 2
    why = []
    if cfg.num_layers != 1:
        why.append(f"it has {cfg.num_layers} layers (their query row's keys come from its running stream: only one "
                   "layer agrees)")
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
    if why:
        raise SpdInputError(f"the head '{head_dir}' cannot be written in the authors' layout: " + "; ".join(why))
    scale = target.norm_scale().double()
    if bool((scale.abs() < 1e-6).any()):
        raise SpdInputError("the target's final norm has zero scales; the head's own norm cannot be folded into it")
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
    config = {"hidden_size": d, "vocab_size": cfg.vocab_size, "model_type": tcfg.model_type,
              "base_model_path": cfg.target_name_or_path, "draft_vocab_size": cfg.vocab_size, "num_stages": n,
              "num_spec_layers": cfg.num_layers, "version": 10, "trained_with_use_deepest": True,
              "shallow_hidden_layer_indices": [list(cfg.anchors[n - b]) for b in range(n)]}
    out = Path(out_file)
    tmp = out.with_name(out.name + ".tmp")
    torch.save({"state_dict": {k: v.detach().clone().contiguous() for k, v in state.items()}, "config": config},
               tmp)
    os.replace(tmp, out)
    return out
