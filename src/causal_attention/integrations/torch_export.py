"""torch.export and AOTInductor: what the layer and the GPT need to leave the Python process.

The layer and the GPT forward export as they are (``torch.export.export``, strict or not, with
dynamic batch and length: see ``dynamic_shapes``); the engine's ops stay in the graph as
``torch.ops.causal_attention.*`` and an AOTInductor package calls them, so the process that loads
the package must have loaded ``libcausal_attention.so`` (``import causal_attention`` does).

Generation with the static KV cache exports as ``CachedGPT``: the GPT with its caches held as
buffers, which one call (a prefill of right-padded prompts, or a decode step) mutates in place.

    step = CachedGPT(model, batch_size=4, max_len=256).eval()
    ep = torch.export.export(step, (tokens,))        # tokens (4, 1): a decode step
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.export import Dim

from ..attention.cache import KVCache
from ..models.gpt import GPT


def dynamic_shapes(
    *, with_mask: bool, max_batch: int | None = None, max_len: int | None = None
) -> tuple[dict[int, Dim], ...]:
    """``dynamic_shapes`` for ``torch.export.export(model, (x_or_tokens[, key_padding_mask]))``:
    dimension 0 (B) and 1 (T) of the input, and the same of the mask when with_mask.

    max_len bounds T (a GPT's ``config.max_len``: positions past it do not exist).
    """
    batch = Dim("B", max=max_batch) if max_batch is not None else Dim("B")
    length = Dim("T", max=max_len) if max_len is not None else Dim("T")
    shapes = {0: batch, 1: length}
    return (shapes, dict(shapes)) if with_mask else (shapes,)


class CachedGPT(nn.Module):
    """A GPT with one static KV cache per layer held as buffers (for torch.export).

    ``forward(tokens (B, t), key_padding_mask (B, t) or None) -> logits (B, t, V)`` runs the new
    tokens of each sequence against its cache and writes their keys and values into it: the
    exported program mutates the buffers ``k{i}``, ``v{i}`` ((B, H, max_len, head_dim)) and
    ``lengths{i}`` ((B,) int64) in place, as ``GPT.forward(..., caches=...)`` does eagerly.
    Shapes are static: B is fixed by the cache, and t by the example (the engine's ``cache_end``
    op takes the number of new tokens as an int), so a prefill of prompts right-padded to T0 and
    a decode step (t = 1) are two programs. The buffers are not persistent (not in state_dict).
    In an AOTInductor package they are constants: ``load_constants(caches, check_full_update=False,
    user_managed=True)`` hands it the caller's tensors, which each call then updates in place.
    """

    def __init__(self, model: GPT, *, batch_size: int, max_len: int | None = None) -> None:
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a causal_attention.GPT; got {type(model).__name__}")
        self.model = model
        self.n_layers = len(model.blocks)
        for i, cache in enumerate(model.make_caches(batch_size, max_len)):
            self.register_buffer(f"k{i}", cache.k, persistent=False)
            self.register_buffer(f"v{i}", cache.v, persistent=False)
            self.register_buffer(f"lengths{i}", cache.lengths, persistent=False)

    def caches(self) -> list[KVCache]:
        """The caches, as views of the buffers (writing them writes the buffers)."""
        return [KVCache(getattr(self, f"k{i}"), getattr(self, f"v{i}"), getattr(self, f"lengths{i}"))
                for i in range(self.n_layers)]

    def reset(self) -> None:
        """Forget every sequence (lengths to 0)."""
        for cache in self.caches():
            cache.reset()

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """tokens (B, t) int64, key_padding_mask (B, t) right padding or None -> logits (B, t, V)
        (zeros at padding); the caches advance by each sequence's real tokens."""
        logits = self.model(tokens, key_padding_mask, caches=self.caches())
        assert isinstance(logits, Tensor)
        return logits
