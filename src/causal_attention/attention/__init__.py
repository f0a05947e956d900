"""The attention layer: the module, its decode fast path, backends, the reference (the spec), the
KV cache and the ops loader."""

from .cache import KVCache, advise_huge_pages, cache_buffer
from .decode import FEW_ROWS, few_rows_linear, few_rows_matmul
from .module import CausalSelfAttention, normalize_key_padding_mask

__all__ = ["FEW_ROWS", "CausalSelfAttention", "KVCache", "advise_huge_pages", "cache_buffer", "few_rows_linear",
           "few_rows_matmul", "normalize_key_padding_mask"]
