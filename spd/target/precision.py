"""Whether this CPU computes a half-precision dtype natively, and the warning where it does not.

On a CPU without AVX512-BF16 or AMX (most AMD EPYC before Zen 4, Intel before Cooper Lake) PyTorch computes
bfloat16 by converting to float32 and back, so a bf16 model runs several times slower than in float32 rather
than faster. Measured on a 2-core AMD EPYC with AVX2 only: SmolLM2-135M-Instruct answered at 28 tokens/s in
bfloat16 (batch 128) against 65 tokens/s in float32 (batch 32), and a distillation step took 188 s against 22.5 s.
"""

from __future__ import annotations

import sys

import torch

_WARNED: set[str] = set()


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """True if this CPU has native kernels for ``dtype`` (float32 always; bfloat16 and float16 as oneDNN reports)."""
    probes = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    if dtype not in probes:
        return True
    probe = getattr(torch.ops.mkldnn, probes[dtype], None)
    try:
        return bool(probe()) if probe is not None else True  # unknown: do not warn
    except RuntimeError:
        return True


def slow_dtype_warning(dtype: torch.dtype, device: torch.device | str, what: str = "the model") -> str | None:
    """One sentence if ``what`` in ``dtype`` on ``device`` will run slower than in float32 here, else None."""
    if torch.device(device).type != "cpu" or cpu_computes_natively(dtype):
        return None
    name = str(dtype).removeprefix("torch.")
    units = "AVX512-BF16 or AMX" if dtype == torch.bfloat16 else "AVX512-FP16 or AMX-FP16"
    return (
        f"warning: this CPU has no native {name} arithmetic (no {units}), so {what} in {name} runs "
        f"several times slower than in float32; choose float32 on this machine"
    )


def warn_if_slow(dtype: torch.dtype, device: torch.device | str, what: str = "the model") -> None:
    """Print :func:`slow_dtype_warning` to stderr, once per message in this process."""
    message = slow_dtype_warning(dtype, device, what)
    if message and message not in _WARNED:
        _WARNED.add(message)
        print(message, file=sys.stderr, flush=True)
