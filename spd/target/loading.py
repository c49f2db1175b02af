"""Loading a target's weights: a Hugging Face causal LM from a directory or a hub id, onto a device this machine has.

Every mistake (a wrong path or hub id, a damaged file, a device torch cannot use) is one sentence naming the input,
not a stack trace from inside transformers or torch.
"""

from __future__ import annotations

import os

import torch

from ..errors import SpdInputError, first_line
from ..paths import check_model_source
from ..reading import check_model_files
from .precision import warn_if_slow


def load_causal_lm(
    name_or_path: str | os.PathLike,
    revision: str | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    **kwargs,
):
    """``AutoModelForCausalLM.from_pretrained`` with a clear error for a wrong path or hub id, or a damaged file."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    source = str(name_or_path)
    check_model_source(source, "model", revision)
    check_model_files(source, "model", weights=True)
    device = check_device(device)
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # "bfloat16" as well as torch.bfloat16
    if isinstance(named, torch.dtype):
        warn_if_slow(named, device, f"'{source}'")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, revision=revision, dtype=dtype, attn_implementation="sdpa", **kwargs
        )
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise SpdInputError(f"could not load a causal LM from '{source}': {first_line(exc)}") from exc
    return model.to(device).eval()


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, or one sentence saying why it cannot be used here (not a device name, no CUDA in
    this torch build or on this machine, a GPU index beyond the GPUs torch sees)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise SpdInputError(f"device '{device}' is not a torch device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise SpdInputError(
                f"device '{device}' needs a CUDA GPU, but this torch ({torch.__version__}) is a build "
                "without CUDA; use --device cpu, or install torch's CUDA build on a GPU machine"
            )
        count = torch.cuda.device_count()
        if count == 0:
            raise SpdInputError(
                f"device '{device}' needs a CUDA GPU, but torch sees none on this machine; use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise SpdInputError(
                f"device '{device}' does not exist: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return device
