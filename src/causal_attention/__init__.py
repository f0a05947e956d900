"""causal_attention: the attention layer of GPT-style models, a C++ engine with a PyTorch front.

    from causal_attention import CausalSelfAttention
    attn = CausalSelfAttention(768, 12)
    out = attn(x, key_padding_mask)   # x (B, T, 768); key_padding_mask (B, T), True = real token
"""

from ._paths import cmake_prefix_path as cmake_prefix_path
from .attention import CausalSelfAttention, KVCache
from .models import GPT, GPTConfig

__all__ = ["GPT", "CausalSelfAttention", "GPTConfig", "KVCache"]
__version__ = "0.1.0"
