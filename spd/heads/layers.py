"""The speculation head's building blocks: RMSNorm, the rotary embedding at the target's rope parameters, and the
decoder layer whose query stream attends fixed memory rows (docs/method.md §2-3). The model that stacks them is
:mod:`spd.heads.speculator`.

Shape suffixes: B batch, N positions, D hidden, H query heads, Hk kv heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SpeculatorConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # half precision is normalised in fp32
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHND: torch.Tensor, cos_BND: torch.Tensor, sin_BND: torch.Tensor) -> torch.Tensor:
    return x_BHND * cos_BND[:, None] + _rotate_half(x_BHND) * sin_BND[:, None]


class Rope(nn.Module):
    """Rotary embedding with the target's rope parameters (Hugging Face's init functions for scaled types)."""

    def __init__(self, config: SpeculatorConfig):
        super().__init__()
        params = config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            arange = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
            inv_freq = 1.0 / (params["rope_theta"] ** (arange / dim))
            scale = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device=torch.device("cpu"))
        # A plain fp32 CPU tensor, not a buffer: casting the model to bf16 must not round the frequencies,
        # and loading (which builds modules on the meta device) must not leave it without data.
        self.inv_freq = inv_freq.float()
        self.scale = scale

    def forward(self, position_ids_BN: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != position_ids_BN.device:
            self.inv_freq = self.inv_freq.to(position_ids_BN.device)
        inv_freq = self.inv_freq.to(torch.promote_types(dtype, torch.float32))
        freqs_BNF = position_ids_BN[..., None].to(inv_freq.dtype) * inv_freq
        emb_BND = torch.cat((freqs_BNF, freqs_BNF), dim=-1)
        return (emb_BND.cos() * self.scale).to(dtype), (emb_BND.sin() * self.scale).to(dtype)


class SpeculatorLayer(nn.Module):
    """One decoder layer: query stream attends fixed memory rows; SwiGLU MLP on the query stream."""

    def __init__(self, config: SpeculatorConfig):
        super().__init__()
        d, h, hk, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hk, dh
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, h * dh, bias=False)
        self.k_proj = nn.Linear(d, hk * dh, bias=False)
        self.v_proj = nn.Linear(d, hk * dh, bias=False)
        self.o_proj = nn.Linear(h * dh, d, bias=False)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(dh, config.rms_norm_eps) if config.qk_norm else None
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        # Per-depth memory projections (reference-code parity), identity-initialised in _init_weights.
        self.memory_proj = (
            nn.ModuleDict({str(k): nn.Linear(d, d, bias=False) for k in config.used_depths})
            if config.memory_proj
            else None
        )

    def query_heads(self, h_BND: torch.Tensor, cos_BND, sin_BND) -> torch.Tensor:
        b, n, _ = h_BND.shape
        q = self.q_proj(self.input_layernorm(h_BND)).view(b, n, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos_BND, sin_BND)

    def memory_kv(self, mem_BND: torch.Tensor, depth: int, cos_BND, sin_BND):
        """Keys and values (B, Hk, N, Dh) of memory rows that all have the same depth."""
        b, n, _ = mem_BND.shape
        if self.memory_proj is not None:
            mem_BND = self.memory_proj[str(depth)](mem_BND)
        x = self.input_layernorm(mem_BND)
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos_BND, sin_BND), v

    def finish(self, h_BND: torch.Tensor, attn_BHND: torch.Tensor) -> torch.Tensor:
        """Residual attention output, then the residual SwiGLU MLP."""
        b, _, n, _ = attn_BHND.shape
        h_BND = h_BND + self.o_proj(attn_BHND.transpose(1, 2).reshape(b, n, -1))
        x = self.post_attention_layernorm(h_BND)
        return h_BND + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def expand_kv(self, x_BHkND: torch.Tensor) -> torch.Tensor:
        groups = self.n_heads // self.n_kv_heads
        return x_BHkND if groups == 1 else x_BHkND.repeat_interleave(groups, dim=1)
