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
    n_kv_heads: int | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal attention from the qkv projection's output.

    Args:
        qkv: (B, T, 3 * dim), split q | k | v; head h uses columns h*hd:(h+1)*hd of each. With
            n_kv_heads: (B, T, (H + 2 * Hkv) * hd), q | k | v of H, Hkv and Hkv heads.
        key_padding_mask: (B, T) bool, True = real token, or None (every token real).
        n_heads: H.
        n_kv_heads: Hkv, dividing H (grouped-query attention: query head h reads key/value head
            h // (H / Hkv)), or None for H.
        return_weights: also return the attention weights (after dropout, as nn.MultiheadAttention).
        dropout_p: attention-weight dropout, in [0, 1): weights = softmax * keep / (1 - dropout_p).
        keep: (B, H, T, T) bool, the weights kept (torch.ops.causal_attention.dropout_keep_mask
            gives the engine's); needed when dropout_p > 0.

    Returns:
        (y, weights): y (B, T, H * hd) with the heads joined back; weights (B, H, T, T) or None.
    """
    B, T, width = qkv.shape
    Hkv = n_heads if n_kv_heads is None else n_kv_heads
    hd = width // (n_heads + 2 * Hkv)
    q, k, v = qkv.split([n_heads * hd, Hkv * hd, Hkv * hd], dim=2)
    q = q.view(B, T, n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
    k = k.view(B, T, Hkv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
    v = v.view(B, T, Hkv, hd).transpose(1, 2)  # (B, Hkv, T, hd)
    y, weights = attention(q, k, v, key_mask=key_padding_mask, return_weights=return_weights, dropout_p=dropout_p,
                           keep=keep)
    return y.transpose(1, 2).reshape(B, T, n_heads * hd), weights  # (B, T, H * hd)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_mask: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal attention of queries that end a key sequence, with grouped key/value heads: the
    attention of transformers' decoder models (prefill, decoding against a cache, GQA and MQA,
    sliding windows, Gemma 2's logit softcapping, gpt-oss's attention sinks).

    Query head h reads key/value head h // (H / Hkv). Query i sits at position Tk - Tq + i and attends
    key j when j <= that position, key_mask[b, j] is True (when given) and, with a window, when the
    position minus j is less than the window (the window's keys include the query's own). Scores are
    q . k * scale (q . k / sqrt(hd) when scale is None, as attention_core computes them), then
    softcap * tanh(scores / softcap) with a softcap, then -inf where not allowed. With sinks, head h's
    softmax takes one more logit, sinks[h], whose value is 0 (its weight is dropped): the row's weights
    sum to less than 1. A row with no allowed key gives 0.

    Args:
        q: (B, H, Tq, hd).
        k, v: (B, Hkv, Tk, hd), Hkv dividing H, Tq <= Tk.
        key_mask: (B, Tk) bool, True = a real key, or None (every key real).
        scale: the factor of the scores, or None for 1 / sqrt(hd).
        window: keys per query, its own included (a positive int), or None for no limit.
        softcap: the cap of the scores (positive), or None for none.
        sinks: (H,) the sink logit of each query head (after the scale and the cap), or None.
        return_weights: also return the attention weights (after dropout).
        dropout_p: attention-weight dropout, in [0, 1): weights = softmax * keep / (1 - dropout_p).
        keep: (B, H, Tq, Tk) bool, the weights kept; needed when dropout_p > 0.

    Returns:
        (y, weights): y (B, H, Tq, hd); weights (B, H, Tq, Tk) or None.
    """
    _check_attention(q, k, v, key_mask, window, softcap, dropout_p, keep, sinks)
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if Hkv != H:  # (a copy changes how matmul reads them, and its rounding: none where not needed)
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, Tk, hd)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, H, Tk, hd)

    scores = q @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    scores = scores / math.sqrt(hd) if scale is None else scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap

    position = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]  # (Tq, 1): each query's position
    key = torch.arange(Tk, device=q.device)[None, :]  # (1, Tk)
    allowed = key <= position  # (Tq, Tk)
    if window is not None:
        allowed = allowed & (position - key < window)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]  # (B, 1, Tq, Tk)
    scores = scores.masked_fill(~allowed, float("-inf"))

    if sinks is None:
        weights = torch.softmax(scores, dim=-1)  # (B, H, Tq, Tk); NaN on rows with no allowed key
    else:  # the sink's logit joins each row's softmax, its weight then dropped
        sink = sinks.to(scores.dtype)[:, None, None].expand(B, H, Tq, 1)  # (B, H, Tq, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :Tk]  # (B, H, Tq, Tk)
    has_key = allowed.any(dim=-1, keepdim=True)  # (B or 1, 1, Tq, 1)
    weights = torch.where(has_key, weights, torch.zeros_like(weights))  # such rows give 0
    if dropout_p > 0:
        assert keep is not None
        weights = weights * keep / (1 - dropout_p)  # (B, H, Tq, Tk), in q's dtype
    y = attend(weights, allowed, v)  # (B, H, Tq, hd)
    return y, (weights if return_weights else None)


def _check_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, window: int | None,
                     softcap: float | None, dropout_p: float, keep: Tensor | None, sinks: Tensor | None) -> None:
    """attention()'s arguments, each error naming the argument and what was expected."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1); got {dropout_p}")
    if dropout_p > 0 and keep is None:
        raise ValueError("attention: dropout_p > 0 needs keep, the (B, H, Tq, Tk) bool mask of kept weights")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, heads, T, hd); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, Tq, hd = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if k.shape != (B, Hkv, Tk, hd) or v.shape != k.shape:
        raise ValueError(f"k and v must be (B, Hkv, Tk, hd) = ({B}, Hkv, Tk, {hd}) alike; got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"k's heads ({Hkv}) must divide q's heads ({H})")
    if Tq > Tk:
        raise ValueError(f"q's length ({Tq}) must not exceed k's ({Tk}): the queries end the key sequence")
    if key_mask is not None and (key_mask.shape != (B, Tk) or key_mask.dtype != torch.bool):
        raise ValueError(f"key_mask must be a ({B}, {Tk}) bool tensor; got {key_mask.dtype} {tuple(key_mask.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys; got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive; got {softcap}")
    if sinks is not None and (sinks.shape != (H,) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a floating ({H},) tensor, one logit per query head; got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")


def attend(weights: Tensor, allowed: Tensor, v: Tensor) -> Tensor:
    """``weights @ v`` summed over the allowed keys only: a masked key (later, or padding) adds exactly
    nothing, even when it holds NaN or inf, where a matmul's 0 * NaN would carry a later position's NaN
    back to every earlier row.

    Args:
        weights: (B, H, Tq, Tk), zero where not allowed.
        allowed: (Tq, Tk) or (B, 1, Tq, Tk) bool, broadcast against weights.
        v: (B, H, Tk, hd).

    Returns:
        (B, H, Tq, hd): the finite values' weighted sum; where an allowed key holds a non-finite value, the
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
