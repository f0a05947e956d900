"""A static, preallocated KV cache for generation.

One cache per attention layer: key and value buffers (B, H, max_len, head_dim) and the length of
each sequence (B,) int64. Shapes never change while generating, so a compiled decode step is
compiled once. The cache is not part of any state_dict.

A right-padded prompt batch is prefilled with its key_padding_mask: each sequence's length becomes
its real length, so the padding written by the prefill is overwritten by the next tokens and never
attended to (ragged batches without left padding).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

# Transparent huge pages are 2 MB on x86-64 (and on arm64 with 4 KB pages); below that a tensor
# spans no whole huge page (the engine reads the kernel's own size).
_HUGE_PAGE = 2 << 20


def cache_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """Zeros of shape for keys or values, by the engine's cache_zeros: on the CPU its memory on huge
    pages where it is at least one (a decode step streams the whole cache, and on 4 KB pages every
    4 KB of it costs a TLB miss), elsewhere torch's zeros; under FakeTensorMode, compiling or
    exporting, a fake tensor. Without the engine, torch.zeros."""
    from . import _ops

    if not _ops.core_loaded():
        return torch.zeros(shape, dtype=dtype, device=device)
    where = torch.device(device if device is not None else torch.get_default_device())
    return torch.ops.causal_attention.cache_zeros(list(shape), dtype, where)


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Uninitialised CPU memory of shape for weights a loader fills at once, by the engine's
    huge_page_empty: on huge pages where it spans one, so that the loader's writes make them and
    make_caches has nothing to move (advise_huge_pages copies pages already made). Without the engine,
    torch.empty."""
    from . import _ops

    if not _ops.core_loaded():
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.ops.causal_attention.huge_page_empty(list(shape), dtype)


def advise_huge_pages(tensors: Tensor | Iterable[Tensor]) -> int:
    """Moves the whole huge pages inside each CPU tensor's memory onto huge pages, in place, by the
    engine's advise_huge_pages (Linux 6.1 and later): the values, the addresses and the tensors stay
    as they are. make_cache calls it on the layer's weights, which a decode step streams with the
    cache. A hint, it never raises: plain strided CPU tensors (and parameters) of a huge page or
    more only; others (tensor subclasses such as DTensor, quantized or sparse tensors, other
    devices) are left as they are, as is everything without the engine, while compiling or
    exporting, and where the kernel refuses. Returns the bytes of the tensors' whole huge pages that
    are on huge pages after the call (those already there included).

    tensors: a tensor or an iterable of tensors."""
    from . import _ops

    # (module._tracing's two questions, asked here too: module imports this file.)
    if not _ops.core_loaded() or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return 0
    moved = 0
    for tensor in (tensors,) if isinstance(tensors, Tensor) else tensors:
        if (
            type(tensor) not in (Tensor, torch.nn.Parameter)
            or tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.untyped_storage().nbytes() < _HUGE_PAGE
        ):
            continue
        try:
            moved += int(torch.ops.causal_attention.advise_huge_pages(tensor))
        except (RuntimeError, NotImplementedError, TypeError):  # a dispatch mode that has no rule for it
            continue
    return moved


@dataclass
class KVCache:
    """Keys and values (B, H, max_len, head_dim) and per-sequence lengths (B,) int64; H is the layer's
    key/value heads (n_kv_heads, fewer than its query heads in grouped-query attention)."""

    k: Tensor
    v: Tensor
    lengths: Tensor

    @classmethod
    def empty(
        cls,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A zeroed cache for batch_size sequences of up to max_len tokens."""
        for name, value in (("batch_size", batch_size), ("n_heads", n_heads), ("head_dim", head_dim), ("max_len", max_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        shape = (batch_size, n_heads, max_len, head_dim)
        return cls(
            k=cache_buffer(shape, dtype, device),
            v=cache_buffer(shape, dtype, device),
            lengths=torch.zeros(batch_size, dtype=torch.int64, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def reset(self) -> None:
        """Forget every sequence (lengths to 0); the buffers are reused as they are."""
        self.lengths.zero_()
