"""Loads the compiled engine (libcausal_attention.so), which registers torch.ops.causal_attention.*.

The engine missing (a source checkout that was never built, a platform without a build) is not an
error: the module falls back to the ``sdpa`` backend and warns once (see ``backends.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

_LIBRARY_NAME = "libcausal_attention.so"


def _load() -> str | None:
    """Loads the compiled core; returns why it could not be loaded, or None when it is loaded."""
    path = Path(__file__).with_name(_LIBRARY_NAME)
    if not path.exists():
        return f"{path} does not exist (build the package: make install)"
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:  # a broken or mismatched build
        return f"loading {path} failed: {exc}"
    _register_fakes()
    return None


def _register_fakes() -> None:
    """Fake (meta) kernels: shapes and dtypes only, so that torch.compile can trace the ops."""

    @torch.library.register_fake("causal_attention::attention_forward")
    def _forward_fake(qkv: torch.Tensor, key_padding_mask: torch.Tensor | None, n_heads: int):
        B, T, three_dim = qkv.shape
        lse_dtype = torch.float64 if qkv.dtype == torch.float64 else torch.float32
        out = qkv.new_empty((B, T, three_dim // 3))  # (B, T, dim)
        lse = qkv.new_empty((B, n_heads, T), dtype=lse_dtype)  # (B, H, T)
        return out, lse

    @torch.library.register_fake("causal_attention::kv_cache_write")
    def _cache_write_fake(qkv, k_cache, v_cache, start, n_heads):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("causal_attention::decode_attention")
    def _decode_fake(qkv, k_cache, v_cache, start, end, n_heads):  # type: ignore[no-untyped-def]
        B, t, three_dim = qkv.shape
        return qkv.new_empty((B, t, three_dim // 3))  # (B, t, dim)

    @torch.library.register_fake("causal_attention::attention_backward")
    def _backward_fake(grad_out, qkv, key_padding_mask, out, lse, n_heads):  # type: ignore[no-untyped-def]
        return qkv.new_empty(qkv.shape)  # (B, T, 3 * dim)


_LOAD_ERROR: str | None = _load()  # once, at import: never in the middle of a traced call


def load_error() -> str | None:
    """Why the compiled engine could not be loaded, or None when it is loaded."""
    return _LOAD_ERROR


def core_loaded() -> bool:
    """True when the compiled C++ engine is loaded and its ops are registered."""
    return load_error() is None
