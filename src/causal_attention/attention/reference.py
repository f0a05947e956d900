"""The specification, line by line, in plain PyTorch: the oracle of every test.

Nothing here is fast. Every backend of the module is tested against these functions.

Shapes: B = batch, T = sequence length, H = heads, hd = head_dim, dim = H * hd.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_core(
    qkv: Tensor,
    key_padding_mask: Tensor | None,
    n_heads: int,
    *,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal attention from the qkv projection's output.

    Args:
        qkv: (B, T, 3 * dim), split q | k | v; head h uses columns h*hd:(h+1)*hd of each.
        key_padding_mask: (B, T) bool, True = real token, or None (every token real).
        n_heads: H.
        return_weights: also return the attention weights (after dropout, as nn.MultiheadAttention).
        dropout_p: attention-weight dropout, in [0, 1): weights = softmax * keep / (1 - dropout_p).
        keep: (B, H, T, T) bool, the weights kept (torch.ops.causal_attention.dropout_keep_mask
            gives the engine's); needed when dropout_p > 0.

    Returns:
        (y, weights): y (B, T, dim) with the heads joined back; weights (B, H, T, T) or None.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1); got {dropout_p}")
    if dropout_p > 0 and keep is None:
        raise ValueError("attention_core: dropout_p > 0 needs keep, the (B, H, T, T) bool mask of kept weights")
    B, T, three_dim = qkv.shape
    dim = three_dim // 3
    hd = dim // n_heads
    q, k, v = qkv.split(dim, dim=2)  # each (B, T, dim)
    q = q.view(B, T, n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
    k = k.view(B, T, n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
    v = v.view(B, T, n_heads, hd).transpose(1, 2)  # (B, H, T, hd)

    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, H, T, T)

    # Query t may attend keys 0..t, and only real ones.
    allowed = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()  # (T, T)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]  # (B, 1, T, T)
    scores = scores.masked_fill(~allowed, float("-inf"))

    weights = torch.softmax(scores, dim=-1)  # (B, H, T, T); NaN on rows with no allowed key
    has_key = allowed.any(dim=-1, keepdim=True)  # (B or 1, 1, T, 1)
    weights = torch.where(has_key, weights, torch.zeros_like(weights))  # such rows give 0
    if dropout_p > 0:
        assert keep is not None
        weights = weights * keep / (1 - dropout_p)  # (B, H, T, T), in qkv's dtype

    y = attend(weights, allowed, v)  # (B, H, T, hd)
    y = y.transpose(1, 2).reshape(B, T, dim)  # (B, T, dim)
    return y, (weights if return_weights else None)


def attend(weights: Tensor, allowed: Tensor, v: Tensor) -> Tensor:
    """``weights @ v`` summed over the allowed keys only: a masked key (later, or padding) adds exactly
    nothing, even when it holds NaN or inf, where a matmul's 0 * NaN would carry a later position's NaN
    back to every earlier row.

    Args:
        weights: (B, H, T, T), zero where not allowed.
        allowed: (T, T) or (B, 1, T, T) bool, broadcast against weights.
        v: (B, H, T, hd).

    Returns:
        (B, H, T, hd): the finite values' weighted sum; where an allowed key holds a non-finite value, the
        sum IEEE arithmetic gives it: NaN for a NaN, for inf times a weight of 0 and for +inf with -inf, else
        the infinity.
    """
    finite = v.isfinite()
    y = weights @ v.where(finite, 0)  # (B, H, T, hd)
    weighted = (allowed & (weights != 0)).to(v.dtype)  # (B, H, T, T)
    unweighted = (allowed & (weights == 0)).to(v.dtype)  # (B, H, T, T)
    hd = v.shape[-1]
    kinds = torch.cat([v.isnan(), v == math.inf, v == -math.inf], dim=-1).to(v.dtype)  # (B, H, T, 3 hd)
    nan, pos, neg = (weighted @ kinds).split(hd, dim=-1)  # (B, H, T, hd) each: counts of such keys
    zero_times_inf = unweighted @ (~finite).to(v.dtype)  # (B, H, T, hd)
    y = torch.where(pos > 0, math.inf, torch.where(neg > 0, -math.inf, y))
    return torch.where((nan > 0) | (zero_times_inf > 0) | ((pos > 0) & (neg > 0)), math.nan, y)


def causal_self_attention(
    x: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    proj_weight: Tensor,
    proj_bias: Tensor,
    n_heads: int,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The whole layer: out = proj(attention(qkv(x))).

    Args:
        x: (B, T, dim).
        qkv_weight, qkv_bias: (3 * dim, dim), (3 * dim,).
        proj_weight, proj_bias: (dim, dim), (dim,).
        n_heads: H, dividing dim.
        key_padding_mask: (B, T) bool, True = real token, or None.

    Returns:
        (B, T, dim).
    """
    qkv = torch.nn.functional.linear(x, qkv_weight, qkv_bias)  # (B, T, 3 * dim)
    y, _ = attention_core(qkv, key_padding_mask, n_heads)  # (B, T, dim)
    return torch.nn.functional.linear(y, proj_weight, proj_bias)  # (B, T, dim)
