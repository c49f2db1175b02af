"""Loading one rank's part of the target: only its stage's decoder layers (rank 0: embedding, final norm and LM
head)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from ..errors import SpdInputError, first_line
from ..reading import FLOATING, SAVED
from ..target.staging import StagedModel


def load_partial(
    source: str,
    n_stages: int,
    role: int,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    boundaries: list[int] | None = None,
) -> StagedModel:
    """A StagedModel whose parameters exist only for ``role``: 0 = embedding, final norm and LM head (the
    driver), ``s >= 1`` = the decoder layers of stage ``s`` (1-based). Everything else stays on the meta
    device (no memory), so a stage holds about 1/n of the target's layers."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _read_config(source, revision)
    checkpoint = Checkpoint(source, revision, None if getattr(config, "quantization_config", None) else FLOATING)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    staged = StagedModel(model, n_stages=n_stages, boundaries=boundaries)
    base = model.base_model
    if role == 0:
        modules = {"embed": base.embed_tokens, "norm": base.norm, "head": model.get_output_embeddings()}
    else:
        modules = {f"layer{i}": staged.layers[i] for i in staged.stage_layers(role - 1)}
    tied = getattr(config, "tie_word_embeddings", False)
    _load_modules(model, list(modules.values()), checkpoint, tied, dtype, device)
    if tied and role == 0:
        model.get_output_embeddings().weight = base.embed_tokens.weight
    rotary = base.rotary_emb
    with torch.device(device):
        base.rotary_emb = type(rotary)(config=model.config.get_text_config())
    staged.rotary_emb = base.rotary_emb
    if role == 0:
        # As from_pretrained does: the EOS default (spd.decoding.generation.default_eos) reads the generation config.
        try:
            model.generation_config = GenerationConfig.from_pretrained(source, revision=revision)
        except OSError:
            pass  # no generation_config.json: the one derived from config.json stays
    model.eval()
    return staged


def _read_config(source: str, revision: str | None):
    """The target's config, read once its source is checked."""
    from transformers import AutoConfig

    from ..paths import check_model_source
    from ..reading import check_model_files

    check_model_source(source, "target", revision)
    check_model_files(source, "target")  # config.json; each safetensors file is checked when first opened
    try:
        return AutoConfig.from_pretrained(source, revision=revision)
    except (OSError, ValueError, KeyError) as exc:
        raise SpdInputError(f"could not load safetensors weights of '{source}': {first_line(exc)}") from None


def _load_modules(
    model: torch.nn.Module,
    modules: list[torch.nn.Module],
    checkpoint: Checkpoint,
    tied: bool,
    dtype: torch.dtype,
    device: str | torch.device,
) -> None:
    """Give ``modules`` (of ``model``, built on the meta device) memory on ``device`` and their parameters from
    ``checkpoint``, each one's shape checked against the config's; the other modules stay on the meta device."""
    from safetensors import safe_open

    source, files = checkpoint.source, checkpoint.weight_map
    module_names = {id(m): name for name, m in model.named_modules()}
    handles: dict[str, object] = {}

    def read(key: str) -> torch.Tensor:
        path = checkpoint.path(key)
        if path not in handles:
            handles[path] = safe_open(path, framework="pt", device="cpu")
        return handles[path].get_tensor(key)

    for module in modules:
        module.to_empty(device=device)  # only the kept modules get memory
        prefix = module_names[id(module)]
        for local, param in module.named_parameters():
            name = f"{prefix}.{local}"
            tensor = _read_tensor(name, files, read, tied, param.shape[0] if param.dim() == 3 else 0)
            if tensor is None:
                raise SpdInputError(f"the checkpoint '{source}' has no tensor '{name}'")
            if tuple(tensor.shape) != tuple(param.shape):
                raise SpdInputError(
                    f"the checkpoint '{source}' holds '{name}' with shape {tuple(tensor.shape)}, but "
                    f"its config.json makes it {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(dtype))


def _read_tensor(name: str, files: dict[str, str], read, tied: bool, experts: int) -> torch.Tensor | None:
    """The tensor for parameter ``name`` from the checkpoint (``read(key)``), or None when it holds none.

    Besides the plain name: the multimodal layout (Qwen3.5) stores the text decoder under
    ``model.language_model``; a tied LM head is the embedding; and mixture-of-experts layers, whose experts
    transformers holds fused (``experts.gate_up_proj`` (E, 2I, D), ``experts.down_proj`` (E, D, I)), are stored by
    most checkpoints one expert at a time (``experts.<e>.gate_proj.weight`` ...): stacked here as transformers'
    own loading does (its conversion mapping for qwen2_moe, qwen3_moe, qwen3_next: the experts stacked, then gate
    and up concatenated)."""
    for candidate in (name, name.replace("model.", "model.language_model.", 1)):
        if candidate in files:
            return read(candidate)
        for fused, parts in (("experts.gate_up_proj", ("gate_proj", "up_proj")), ("experts.down_proj", ("down_proj",))):
            if not candidate.endswith(fused) or not experts:
                continue
            base = candidate[: -len(fused)] + "experts."
            keys = [[f"{base}{e}.{part}.weight" for e in range(experts)] for part in parts]
            if all(k in files for group in keys for k in group):
                return torch.cat([torch.stack([read(k) for k in group]) for group in keys], dim=1)
    if tied and name.endswith("lm_head.weight"):
        key = next((k for k in files if k.endswith("embed_tokens.weight")), None)
        return read(key) if key is not None else None
    return None


class Checkpoint:
    """The target's safetensors checkpoint (one file, or shards listed in an index): which file holds each
    tensor, with a shard's file fetched or found only when one of its tensors is read, so that a machine needs
    only the shards that hold its own stages' layers."""

    def __init__(self, source: str, revision: str | None = None, dtypes: Collection[str] | None = FLOATING):
        from ..reading import read_json, safetensors_header

        self.source, self.revision = source, revision
        self.dtypes = dtypes  # what its tensors may be (reading.FLOATING; None: any, for a quantised target)
        self._paths: dict[str, str] = {}
        try:
            index = self._file("model.safetensors.index.json", required=False)
            if index is not None:
                weight_map = read_json(index, "target's weights index", SAVED).get("weight_map")
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise SpdInputError(
                        f"the target's weights index '{index}' has no weight_map of tensor names to shard files; "
                        f"expected {SAVED}"
                    )
                self.index_text = Path(index).read_text(encoding="utf-8")
                self.weight_map: dict[str, str] = dict(weight_map)
            else:
                self.index_text = None
                single = self._file("model.safetensors")
                header = safetensors_header(single, "target's weights file", self.dtypes)
                self.weight_map = {name: "model.safetensors" for name in header}
                self._paths["model.safetensors"] = single
        except SpdInputError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise SpdInputError(f"could not load safetensors weights of '{source}': {first_line(exc)}") from None

    def _file(self, name: str, required: bool = True) -> str | None:
        """The local path of the checkpoint's file ``name``: in the directory as it is (its checks name a file that is
        missing or a directory), or fetched into the hub cache; None for a missing file that is not ``required``."""
        from transformers.utils import cached_file

        directory = Path(self.source).expanduser()
        if directory.is_dir():
            return str(directory / name) if required or (directory / name).exists() else None
        return cached_file(self.source, name, revision=self.revision, _raise_exceptions_for_missing_entries=required)

    @property
    def sharded(self) -> bool:
        return self.index_text is not None

    def path(self, name: str) -> str:
        """The local path of the file holding tensor ``name`` (fetched from the hub cache on first use)."""
        from ..reading import safetensors_header

        file = self.weight_map[name]
        if file not in self._paths:
            try:
                path = self._file(file, required=False)
                if path is None:
                    raise FileNotFoundError(f"no file '{file}'")
            except (OSError, ValueError) as exc:
                raise SpdInputError(
                    f"the checkpoint '{self.source}' lacks the shard '{file}' that holds '{name}' "
                    f"({first_line(exc)}); every machine needs the shards of its own stages' "
                    "layers (and rank 0's: embedding, final norm, LM head)"
                ) from None
            safetensors_header(path, "target's weights shard", self.dtypes)
            self._paths[file] = path
        return self._paths[file]


def materialized_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters that hold data (meta tensors excluded)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")
