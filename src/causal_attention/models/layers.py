"""The Llama family's parts of GPT: RMSNorm, the gated MLP (SwiGLU), rotary positions and the
sliding-window attention of a block, each computed as transformers' Llama, Qwen2 and Mistral compute
them (the same operations in the same order and precision), so that a converted checkpoint gives
their logits.

Shapes: B = batch, T = tokens, N = real tokens of a packed batch, H / Hkv = query / key-value heads,
hd = head_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..attention import _ops, reference
from ..attention import backends
from ..attention.cache import KVCache
from ..attention.decode import few_rows_linear, project
from .config import GPTConfig


class RMSNorm(nn.Module):
    """Llama's RMSNorm: x / sqrt(mean(x^2) + eps) computed in float32 (whatever x's dtype, as
    transformers' LlamaRMSNorm), rounded back to x's dtype, then times the weight. x (..., dim)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def norm_layer(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.dim, config.layer_norm_eps)
    return nn.LayerNorm(config.dim, eps=config.layer_norm_eps, bias=config.bias)


def activation_layer(config: GPTConfig) -> nn.Module:
    if config.activation == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) (SwiGLU with SiLU), gate and up in one Linear ``gate_up`` (rows
    gate | up: one product), then dropout. x (..., dim) -> (..., dim)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        bias = config.bias_of("mlp")
        self.hidden = config.hidden
        self.gate_up = nn.Linear(config.dim, 2 * config.hidden, bias=bias)
        self.act = activation_layer(config)
        self.down = nn.Linear(config.hidden, config.dim, bias=bias)
        self.drop = nn.Dropout(config.resid_dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.down_of(project(self.gate_up, x), project))

    def step(self, x: Tensor) -> Tensor:
        """forward for a decode step's few rows: each weight streamed once (few_rows_linear)."""
        return self.drop(self.down_of(few_rows_linear(self.gate_up, x), few_rows_linear))

    def down_of(self, gate_up: Tensor, linear: Any) -> Tensor:
        gate, up = gate_up.split(self.hidden, dim=-1)
        return linear(self.down, self.act(gate) * up)


def inverse_frequencies(config: GPTConfig) -> Tensor:
    """(hd / 2,) float32: the rotary frequencies as transformers computes them (in float32), with
    Llama 3's scaling where config.rope_scaling asks for it."""
    hd = config.head_dim
    # On the CPU even under a meta-device context (GPT.load builds the model there, then fills it).
    steps = torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").to(torch.float32)
    inv = 1.0 / (config.rope_theta ** (steps / hd))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class Rotary:
    """cos and sin (..., hd) in the model's dtype at each token's position: computed in float32
    (positions x frequencies, then cos / sin), as transformers' rotary embedding computes them."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def at(cls, positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> Rotary:
        freqs = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)  # (..., hd / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (..., hd)
        return cls(angles.cos().to(dtype), angles.sin().to(dtype))

    def pack(self, pack: Any) -> Rotary:
        return Rotary(pack(self.cos), pack(self.sin))

    def apply(self, qkv: Tensor, n_heads: int, kv_heads: int) -> Tensor:
        """qkv (..., (H + 2 Hkv) * hd) with cos, sin (..., hd) -> the same with q and k rotated
        (rotate-half layout: x * cos + rotate_half(x) * sin, as transformers' apply_rotary_pos_emb)."""
        if _rotates_in_one_pass(qkv, self.cos, self.sin):
            return torch.ops.causal_attention.rotary_qkv(qkv, self.cos, self.sin, n_heads, kv_heads)
        hd = self.cos.shape[-1]
        q, k, v = qkv.split((n_heads * hd, kv_heads * hd, kv_heads * hd), dim=-1)
        cos, sin = self.cos.unsqueeze(-2), self.sin.unsqueeze(-2)  # (..., 1, hd)

        def rotate(x: Tensor, heads: int) -> Tensor:
            x = x.unflatten(-1, (heads, hd))
            half = torch.cat((-x[..., hd // 2:], x[..., : hd // 2]), dim=-1)
            return ((x * cos) + (half * sin)).flatten(-2)

        return torch.cat((rotate(q, n_heads), rotate(k, kv_heads), v), dim=-1)


def _rotates_in_one_pass(qkv: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether Rotary.apply takes the engine's rotary_qkv (the composition's bits in one pass): plain CPU
    tensors of one dtype with nothing to differentiate, in eager mode outside torch.func transforms and
    CPU autocast. Compiled, exported and traced graphs keep the composition."""
    tensors = (qkv, cos, sin)
    return (
        _ops.core_loaded()
        and all(type(t) is Tensor and t.device.type == "cpu" and t.dtype == qkv.dtype for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing())
        and not torch._C._are_functorch_transforms_active()
        and not torch.is_autocast_enabled("cpu")
    )


def heads_of(qkv: Tensor, n_heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, T, (H + 2 Hkv) * hd) -> q (B, H, T, hd), k and v (B, Hkv, T, hd) (views)."""
    return backends.split_heads(qkv, n_heads, kv_heads)


def windowed_attention(qkv: Tensor, mask: Tensor | None, n_heads: int, kv_heads: int, window: int, *,
                       dropout_p: float = 0.0, return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Causal attention within a sliding window: qkv (B, T, (H + 2 Hkv) * hd), mask (B, T) bool or
    None -> (joined heads (B, T, H * hd), weights (B, H, T, T) when return_weights). On the CPU the
    engine's attention_heads (keys before the window skipped by blocks); elsewhere, and for the
    weights, the reference."""
    q, k, v = heads_of(qkv, n_heads, kv_heads)
    B, T = qkv.shape[:2]
    # (ONNX has no translation of the engine's op: the exported graph takes the reference's operations.)
    if not return_weights and qkv.device.type == "cpu" and _ops.core_loaded() and not backends.onnx_exporting():
        out = _ops.attention_heads(q, k, v, mask, window=window, dropout_p=dropout_p)  # (B, T, H, hd)
        return out.reshape(B, T, -1), None
    if dropout_p > 0:
        raise ValueError("dropout in a sliding-window attention needs the engine on the CPU (attention_heads)")
    y, weights = reference.attention(q, k, v, key_mask=mask, window=window, return_weights=return_weights)
    return y.transpose(1, 2).reshape(B, T, -1), weights


def windowed_cached_attention(qkv: Tensor, mask: Tensor | None, cache: KVCache, n_heads: int, kv_heads: int,
                              window: int) -> Tensor:
    """The KV-cache step of a sliding-window layer: qkv (B, t, (H + 2 Hkv) * hd) of each sequence's
    new tokens (right padding in mask, bool (B, t) or None) -> joined heads (B, t, H * hd); their
    keys and values are written at each sequence's own place and the lengths advance. A prefill into
    empty caches attends its own tokens within the window; a step of one token per sequence attends
    its last `window` cached keys (its own included). Other steps (several new tokens after a non-empty
    cache) are refused: each query would need a window of its own over a ragged cache."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        raise NotImplementedError("a sliding-window model's cached step chooses its path from the cache lengths: "
                                  "it runs eagerly (torch.compile / torch.export of it are not supported yet)")
    start = cache.lengths  # (B,)
    t = qkv.shape[1]
    end = backends.cache_end(start, mask, t, cache.max_len)  # (B,), checked
    empty = not bool(start.any())
    if not empty and t != 1:
        raise ValueError(f"a sliding-window model's cached step takes 1 token per sequence after the prefill; got {t}")
    heads = (n_heads,) if kv_heads == n_heads else (n_heads, kv_heads)
    if qkv.device.type == "cpu" and _ops.core_loaded():
        torch.ops.causal_attention.kv_cache_write(qkv, cache.k, cache.v, start, end, *heads)
    else:
        backends.write_cache_torch(qkv, cache, start, end, n_heads, kv_heads)
    if empty:
        y, _ = windowed_attention(qkv, mask, n_heads, kv_heads, window)
    else:
        length = int(end.max())
        keys = torch.arange(length, device=qkv.device)[None, :]
        key_mask = (keys < end[:, None]) & (keys >= end[:, None] - window)  # (B, L): the window of each query
        q, _, _ = heads_of(qkv, n_heads, kv_heads)  # (B, H, 1, hd)
        k, v = cache.k[:, :, :length], cache.v[:, :, :length]
        if qkv.device.type == "cpu" and _ops.core_loaded():
            y = _ops.attention_heads(q, k, v, key_mask).reshape(qkv.shape[0], 1, -1)
        else:
            out, _ = reference.attention(q, k, v, key_mask=key_mask)
            y = out.transpose(1, 2).reshape(qkv.shape[0], 1, -1)
    cache.lengths.copy_(end)
    return y

