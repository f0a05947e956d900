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


def select_backend(qkv: Tensor, requested: Backend) -> str:
    """The backend that runs this call: ``requested``, or the best one that can when ``auto``."""
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


def _cpp(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int) -> Tensor:
    return torch.ops.causal_attention.attention(qkv, key_padding_mask, n_heads)


def _sdpa(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int) -> Tensor:
    B, T, three_dim = qkv.shape
    dim = three_dim // 3
    q, k, v = qkv.unflatten(2, (3, n_heads, dim // n_heads)).unbind(2)  # each (B, T, H, hd)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # each (B, H, T, hd)
    if key_padding_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
    else:
        causal = torch.ones(T, T, dtype=torch.bool, device=qkv.device).tril()  # (T, T)
        allowed = causal & key_padding_mask[:, None, :]  # (B, T, T)
        has_key = key_padding_mask.cumsum(1, dtype=torch.int32) > 0  # (B, T)
        # A row with no allowed key would be all -inf (NaN): let it see its own key, then zero it.
        eye = torch.eye(T, dtype=torch.bool, device=qkv.device)
        allowed = allowed | (~has_key[:, :, None] & eye)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])  # (B, H, T, hd)
        out = out.masked_fill(~has_key[:, None, :, None], 0)
    return out.transpose(1, 2).reshape(B, T, dim)  # (B, T, dim)


def _reference(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int) -> Tensor:
    return reference.attention_core(qkv, key_padding_mask, n_heads)[0]


RUN: dict[str, Callable[[Tensor, Tensor | None, int], Tensor]] = {
    "cpp": _cpp,
    "sdpa": _sdpa,
    "reference": _reference,
}
