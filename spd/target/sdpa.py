"""Which scaled-dot-product-attention kernels decoding runs on CUDA.

PyTorch may pick cuDNN's attention kernel on Hopper GPUs. cuDNN builds an execution plan for every new pair of
query and key lengths, and decoding meets a new key length at every step: on an H200 that cost about 1 ms of CPU
per attention call and one 42 ms stage call per new length (docs/gpu.md). :func:`decode_kernels` keeps cuDNN out
and leaves the choice among flash, memory-efficient and math attention to PyTorch; on other devices it changes
nothing.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Let PyTorch use cuDNN's attention kernel too (its own default); False keeps cuDNN out (ours).
ALLOW_CUDNN = False

_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_kernels(device: torch.device):
    """A context in which attention on ``device`` runs without cuDNN's kernel (CUDA), or an empty one."""
    if device.type != "cuda" or ALLOW_CUDNN:
        return contextlib.nullcontext()
    return sdpa_kernel(_WITHOUT_CUDNN)
