"""The attention backends and how one is chosen per call.

Every backend maps ``qkv`` (B, T, 3 * dim) and an optional bool ``key_padding_mask`` (B, T,
True = real token) to the joined heads (B, T, dim), with the same contract:

- ``cpp``: the compiled C++ engine (torch.ops.causal_attention.attention), CPU tensors.
- ``sdpa``: torch's own fused kernels (F.scaled_dot_product_attention); CUDA tensors, or any
  machine where the compiled engine could not be loaded.
- ``reference``: the specification in plain PyTorch (reference.py), slow, the oracle.

``auto`` picks ``cpp`` where it can run and says why when it passes it over.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _ops, reference
from .cache import KVCache

Backend = Literal["auto", "cpp", "sdpa", "reference"]
BACKENDS: tuple[str, ...] = ("cpp", "sdpa", "reference")
CPP_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def unsupported_reasons(backend: str, qkv: Tensor) -> list[str]:
    """Why ``backend`` cannot run on these inputs (empty when it can), after xformers' model."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}; got {backend!r}")
    reasons: list[str] = []
    if backend == "cpp":
        error = _ops.load_error()
        if error is not None:
            reasons.append(f"the compiled engine is not loaded: {error}")
        if qkv.device.type != "cpu":
            reasons.append(f"the C++ kernels run on CPU tensors; got device {qkv.device}")
        if qkv.dtype not in CPP_DTYPES:
            reasons.append(f"dtype {qkv.dtype} is not one of {CPP_DTYPES}")
    return reasons


@functools.cache
def _warn_engine_missing(error: str) -> None:
    warnings.warn(
        f"causal_attention: the compiled C++ engine is not loaded ({error}); "
        "falling back to the 'sdpa' backend (torch's kernels), which is slower with padding.",
        RuntimeWarning,
        stacklevel=3,
    )


def onnx_exporting() -> bool:
    """True while ``torch.onnx.export(..., dynamo=True)`` traces the model.

    The engine's ops have no ONNX form, so while exporting to ONNX the ``cpp`` backend is written
    as torch's SDPA (the same contract, see masked_sdpa), which the exporter translates itself:
    ONNX ``Attention`` at opset >= 23, standard primitive ops below that.
    """
    return torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export()


def select_backend(qkv: Tensor, requested: Backend) -> str:
    """The backend that runs this call: ``requested``, or the best one that can when ``auto``
    (``sdpa`` in place of ``cpp`` while exporting to ONNX: onnx_exporting)."""
    if requested in ("auto", "cpp") and onnx_exporting():
        return "sdpa"
    if requested != "auto":
        reasons = unsupported_reasons(requested, qkv)
        if reasons:
            raise ValueError(f"backend {requested!r} cannot run these inputs: " + "; ".join(reasons))
        return requested
    if qkv.device.type != "cpu":
        return "sdpa"
    if not unsupported_reasons("cpp", qkv):
        return "cpp"
    error = _ops.load_error()
    if error is not None:
        _warn_engine_missing(error)
    return "sdpa"


def _cpp(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int, dropout_p: float = 0.0, *,
         n_kv_heads: int | None = None) -> Tensor:
    # the fused kernels, autograd in _ops.py
    return _ops.attention(qkv, key_padding_mask, n_heads, dropout_p, n_kv_heads=n_kv_heads)


# Checks on values that guard data. With the engine loaded they run inside its ops (ValueError),
# which torch.compile and torch.export keep as they are; without it, torch._assert_async keeps them
# (RuntimeError, and a device-side assert on CUDA).


def mask_to_bool(mask: Tensor) -> Tensor:
    """An integer 0/1 key padding mask (B, T) as bool; any other value is an error, compiled too."""
    if _ops.core_loaded() and not onnx_exporting():
        return torch.ops.causal_attention.mask_to_bool(mask)
    torch._assert_async(
        ((mask == 0) | (mask == 1)).all(), "key_padding_mask of integer dtype must hold only 0 (padding) and 1 (real token)"
    )
    return mask != 0


def cache_end(lengths: Tensor, mask: Tensor | None, new_tokens: int, max_len: int) -> Tensor:
    """The cache lengths (B,) after a step of new_tokens tokens, mask (B, new_tokens) bool marking
    the real ones (right padding, checked); each sequence must have room for its own real tokens."""
    if _ops.core_loaded() and not onnx_exporting():
        return torch.ops.causal_attention.cache_end(lengths, mask, new_tokens, max_len)
    if mask is None:
        end = lengths + new_tokens
    else:
        n_real = mask.sum(1)  # (B,)
        right_padded = torch.arange(new_tokens, device=mask.device)[None, :] < n_real[:, None]  # (B, t)
        torch._assert_async(
            (mask == right_padded).all(), "with a cache, key_padding_mask must be right padding (real tokens first)"
        )
        end = lengths + n_real
    torch._assert_async((end <= max_len).all(), f"KV cache overflow: the new tokens do not fit in max_len={max_len}")
    return end


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, dropout_p: float = 0.0) -> Tensor:
    """F.scaled_dot_product_attention with a bool mask (True = may attend), where a query with no
    allowed key gives 0 instead of NaN; dropout_p: its attention-weight dropout (torch's generator).

    q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd) (Hkv dividing H: grouped-query attention), allowed
    (B, Tq, Tk) -> (B, H, Tq, hd).
    """
    if q.shape[2] == 0 or k.shape[2] == 0:  # no query, or no key at all: nothing to attend
        return q.new_zeros(q.shape[:3] + (v.shape[3],))
    has_key = allowed.any(-1)  # (B, Tq)
    # A row with no allowed key would be all -inf (NaN): let it see key 0, then zero it.
    first = torch.zeros_like(allowed)
    first[..., 0] = True
    allowed = allowed | (~has_key[..., None] & first)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], dropout_p=dropout_p,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (B, H, Tq, hd)
    return out.masked_fill(~has_key[:, None, :, None], 0)


def split_heads(qkv: Tensor, n_heads: int, n_kv_heads: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, T, (H + 2 Hkv) * hd) -> q (B, H, T, hd), k and v (B, Hkv, T, hd); Hkv = H when None."""
    Hkv = n_heads if n_kv_heads is None else n_kv_heads
    hd = qkv.shape[2] // (n_heads + 2 * Hkv)
    q, k, v = qkv.split([n_heads * hd, Hkv * hd, Hkv * hd], dim=2)
    return (q.unflatten(2, (n_heads, hd)).transpose(1, 2), k.unflatten(2, (Hkv, hd)).transpose(1, 2),
            v.unflatten(2, (Hkv, hd)).transpose(1, 2))


def _sdpa(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int, dropout_p: float = 0.0, *,
          n_kv_heads: int | None = None) -> Tensor:
    B, T, _ = qkv.shape
    q, k, v = split_heads(qkv, n_heads, n_kv_heads)  # (B, H, T, hd), (B, Hkv, T, hd) twice
    if key_padding_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                             enable_gqa=k.shape[1] != n_heads)  # (B, H, T, hd)
    else:
        causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()  # (T, T)
        out = masked_sdpa(q, k, v, causal & key_padding_mask[:, None, :], dropout_p)  # (B, H, T, hd)
    return out.transpose(1, 2).reshape(B, T, n_heads * q.shape[3])  # (B, T, dim)


def write_cache_torch(qkv: Tensor, cache: KVCache, start: Tensor, end: Tensor, n_heads: int,
                      n_kv_heads: int | None = None) -> Tensor:
    """kv_cache_write in plain torch (any device): the real new keys and values of qkv (B, t,
    (H + 2 Hkv) * hd) at cache positions start[b]..end[b]-1 (checked by cache_end), with static shapes
    (nothing indexes past max_len). Returns the queries q (B, H, t, hd)."""
    B, t, _ = qkv.shape
    q, k_new, v_new = split_heads(qkv, n_heads, n_kv_heads)  # (B, H, t, hd), (B, Hkv, t, hd) twice
    keys = torch.arange(cache.max_len, device=qkv.device)  # (L,)
    written = (keys[None, :] >= start[:, None]) & (keys[None, :] < end[:, None])  # (B, L)
    source = (keys[None, :] - start[:, None]).clamp(0, max(t - 1, 0))  # (B, L): new token at each position
    if t > 0:
        index = source[:, None, :, None].expand(B, k_new.shape[1], cache.max_len, k_new.shape[3])  # (B, Hkv, L, hd)
        cache.k.copy_(torch.where(written[:, None, :, None], k_new.gather(2, index), cache.k))
        cache.v.copy_(torch.where(written[:, None, :, None], v_new.gather(2, index), cache.v))
    return q


def cached_attention_torch(qkv: Tensor, cache: KVCache, start: Tensor, end: Tensor, n_heads: int,
                           n_kv_heads: int | None = None) -> Tensor:
    """The KV cache path in plain torch (any device): writes the new k and v, then attends.

    qkv (B, t, (H + 2 Hkv) * hd), the cache (B, Hkv, L, hd); start, end (B,), already checked
    (cache_end): new query i of sequence b
    sits at start[b] + i and sees cache positions j <= min(start[b] + i, end[b] - 1). Only the real
    new tokens (positions start[b]..end[b]-1) are written; shapes are static and nothing indexes
    past max_len, so a compiled step never reads or writes out of bounds. Returns (B, t, dim).
    """
    B, t, _ = qkv.shape
    q = write_cache_torch(qkv, cache, start, end, n_heads, n_kv_heads)  # (B, H, t, hd)
    keys = torch.arange(cache.max_len, device=qkv.device)  # (L,)
    positions = start[:, None] + torch.arange(t, device=qkv.device)  # (B, t)
    allowed = (keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] < end[:, None, None])  # (B, t, L)
    out = masked_sdpa(q, cache.k, cache.v, allowed)  # (B, H, t, hd)
    return out.transpose(1, 2).reshape(B, t, n_heads * q.shape[3])  # (B, t, dim)


def dropout_keep(qkv: Tensor, n_heads: int, dropout_p: float) -> Tensor:
    """A fresh (B, H, T, T) bool dropout mask for qkv (B, T, 3 * dim): the engine's keep decisions
    (dropout_keep_mask of a seed from torch's generator) when it is loaded, else torch.rand's."""
    B, T = qkv.shape[0], qkv.shape[1]
    if _ops.core_loaded():
        keep = torch.ops.causal_attention.dropout_keep_mask(_ops.draw_seed(), B, n_heads, T, dropout_p)
        return keep.to(qkv.device)
    return torch.rand(B, n_heads, T, T, device=qkv.device) >= dropout_p


def _reference(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int, dropout_p: float = 0.0, *,
               n_kv_heads: int | None = None) -> Tensor:
    keep = dropout_keep(qkv, n_heads, dropout_p) if dropout_p > 0 else None
    return reference.attention_core(qkv, key_padding_mask, n_heads, n_kv_heads=n_kv_heads, dropout_p=dropout_p,
                                    keep=keep)[0]


# Each backend: (qkv, key_padding_mask, n_heads, dropout_p=0.0, *, n_kv_heads=None) -> (B, T, H * hd).
RUN: dict[str, Callable[..., Tensor]] = {
    "cpp": _cpp,
    "sdpa": _sdpa,
    "reference": _reference,
}
