"""GPT: a decoder built from CausalSelfAttention, for training on right-padded batches and
batched generation over ragged prompts with a static KV cache.

One class covers the demo's small model (``GPTConfig()`` defaults), GPT-2 itself
(``GPTConfig.gpt2()``, or ``from_huggingface`` / ``from_nanogpt`` of models/convert.py) and the
Llama family (RMSNorm, SwiGLU, rotary positions, grouped-query attention, a sliding window: the
options of GPTConfig; ``from_huggingface`` of a Llama, Qwen2 or Mistral model).

Shapes: B = batch, T = tokens, V = vocabulary, dim = model width, N = real tokens of a batch.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..attention.cache import KVCache, advise_huge_pages
from ..attention.decode import (
    _HALF,
    _global_forward_hooks,
    _tracing,
    few_rows_linear,
    few_rows_matmul,
    float32_matmul,
    project,
    unrounded_matmul,
    widened_matmul,
    widens,
)
from ..attention.module import CausalSelfAttention, normalize_key_padding_mask
from ..attention import reference
from . import checkpoint
from .config import GPTConfig
from .layers import (
    GatedMLP,
    Rotary,
    activation_layer,
    heads_of,
    inverse_frequencies,
    norm_layer,
    windowed_attention,
    windowed_cached_attention,
)

class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))). With the
    Llama family's options: RMSNorm, grouped-query attention, rotary positions applied to q and k
    between the qkv projection and the attention (rotated keys in the cache), a sliding window and
    the gated MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        dim = config.dim
        self.window = config.sliding_window
        self.ln1 = norm_layer(config)
        self.attn = CausalSelfAttention(dim, config.n_heads, n_kv_heads=config.n_kv_heads, bias=config.bias_of("qkv"),
                                        dropout=config.attn_dropout)
        if config.bias_of("proj") != config.bias_of("qkv"):
            self.attn.proj = nn.Linear(dim, dim, bias=config.bias_of("proj"))
        self.attn_drop = nn.Dropout(config.resid_dropout)
        self.ln2 = norm_layer(config)
        if config.gated_mlp:
            self.mlp: nn.Module = GatedMLP(config)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(dim, config.hidden, bias=config.bias_of("mlp")),
                activation_layer(config),
                nn.Linear(config.hidden, dim, bias=config.bias_of("mlp")),
                nn.Dropout(config.resid_dropout),
            )

    def forward(
        self, x: Tensor, mask: Tensor | None, *, cache: KVCache | None = None, return_weights: bool = False,
        rotary: Rotary | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, dim) -> (x (B, T, dim), attention weights (B, H, T, T) or None); rotary: cos
        and sin at x's positions (B, T, hd) for a rotary model."""
        weights = None
        if rotary is not None or self.window is not None:
            a, weights = self._attention(self.ln1(x), mask, cache, rotary, return_weights)
        elif return_weights:
            a, weights = self.attn(self.ln1(x), mask, return_weights=True)
        else:
            a = self.attn(self.ln1(x), mask, cache=cache)
        x = x + self.attn_drop(a)
        if cache is not None:  # a decode step: a few rows, no autograd (the cache is inference-only)
            if isinstance(self.mlp, GatedMLP):
                return x + self.mlp.step(self.ln2(x)), weights
            h = few_rows_linear(self.mlp[2], self.mlp[1](few_rows_linear(self.mlp[0], self.ln2(x))))
            return x + self.mlp[3](h), weights
        x = x + self._mlp(self.ln2(x))
        return x, weights

    def _attention(self, h: Tensor, mask: Tensor | None, cache: KVCache | None, rotary: Rotary | None,
                   return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """The attention of a rotary or windowed block, projection by projection: h (B, T, dim)
        (normalised) -> ((B, T, dim), weights (B, H, T, T) or None)."""
        if cache is not None:
            if return_weights:
                raise ValueError("return_weights is not available with a cache")
            self.attn._check_cache(cache, h, "x")
        linear = few_rows_linear if cache is not None else project
        qkv = linear(self.attn.qkv, h)  # (B, T, (H + 2 Hkv) * hd)
        if rotary is not None:
            qkv = rotary.apply(qkv, self.attn.n_heads, self.attn.kv_heads)
        y, weights = self._attend(qkv, mask, cache, return_weights)
        return linear(self.attn.proj, y), weights

    def _attend(self, qkv: Tensor, mask: Tensor | None, cache: KVCache | None,
                return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """qkv (B, T, (H + 2 Hkv) * hd), q and k rotated -> joined heads (B, T, dim), weights."""
        dropout_p = self.attn.dropout if self.training else 0.0
        if self.window is not None:
            if cache is not None:
                return windowed_cached_attention(qkv, mask, cache, self.attn.n_heads, self.attn.kv_heads, self.window), None
            return windowed_attention(qkv, mask, self.attn.n_heads, self.attn.kv_heads, self.window, dropout_p=dropout_p,
                                      return_weights=return_weights)
        if return_weights:
            if dropout_p > 0:
                raise ValueError("return_weights of a rotary model needs eval mode (no attention dropout)")
            q, k, v = heads_of(qkv, self.attn.n_heads, self.attn.kv_heads)
            y, weights = reference.attention(q, k, v, key_mask=mask, return_weights=True)
            return y.transpose(1, 2).flatten(2), weights
        return self.attn.attend(qkv, mask, cache=cache), None

    def _mlp(self, x: Tensor) -> Tensor:
        """self.mlp(x) (x (..., dim) -> (..., dim)); module by module where project may take its
        products (half precision on a CPU without half arithmetic; float32 without a gradient) and
        nothing hooks the Sequential."""
        mlp = self.mlp
        if isinstance(mlp, GatedMLP):
            return mlp(x)
        if (x.dtype in _HALF or x.dtype == torch.float32) and type(mlp) is nn.Sequential and not (
            mlp._forward_hooks or mlp._forward_pre_hooks or _global_forward_hooks()
        ):
            return mlp[3](project(mlp[2], mlp[1](project(mlp[0], x))))
        return mlp(x)

    def forward_packed(self, x: Tensor, packing: _Packing, *, cache: KVCache | None = None,
                       rotary: Rotary | None = None) -> Tensor:
        """The same block on the real tokens only: x (N, dim) -> (N, dim). Every per-token
        operation (norms, projections, rotary positions, MLP) runs on the N real tokens; the
        attention sees them at their (B, T) places, with padding zeroed and masked. rotary: cos and
        sin (N, hd) at the real tokens' positions."""
        qkv = project(self.attn.qkv, self.ln1(x))  # (N, (H + 2 Hkv) * hd)
        if rotary is not None:
            qkv = rotary.apply(qkv, self.attn.n_heads, self.attn.kv_heads)
        full = packing.unpack(qkv)  # (B, T, (H + 2 Hkv) * hd)
        if self.window is None:
            y = self.attn.attend(full, packing.mask, cache=cache)  # (B, T, dim)
        else:
            if cache is not None:
                self.attn._check_cache(cache, full, "qkv")
            y, _ = self._attend(full, packing.mask, cache)
        x = x + self.attn_drop(project(self.attn.proj, packing.pack(y)))
        return x + self._mlp(self.ln2(x))


@dataclass(frozen=True)
class _Packing:
    """Where the N real tokens of a right- or arbitrarily padded (B, T) batch sit."""

    mask: Tensor  # (B, T) bool
    index: Tensor  # (N,) flat positions b * T + t of the real tokens

    @classmethod
    def of(cls, mask: Tensor) -> _Packing:
        return cls(mask, mask.flatten().nonzero().squeeze(1))

    def right_padded_lengths(self) -> list[int] | None:
        """Each sequence's length when the padding is all on the right, else None."""
        lengths = self.mask.sum(1)  # (B,)
        T = self.mask.shape[1]
        if not bool((self.mask == (torch.arange(T, device=self.mask.device)[None, :] < lengths[:, None])).all()):
            return None
        return lengths.tolist()

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...)."""
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, T, ...), zeros at padding."""
        B, T = self.mask.shape
        full = x.new_zeros((B * T,) + tuple(x.shape[1:]))
        return full.index_copy(0, self.index, x).unflatten(0, (B, T))


class GPT(nn.Module):
    """Token and position embeddings (token only with rotary positions), n_layers Blocks, a final
    norm (LayerNorm or RMSNorm) and a head (tied to the token embedding unless ``config.tie_head``
    is False).

    Parameters: ``tok``, ``pos`` (embeddings; no ``pos`` with rotary positions), ``blocks.{i}.ln1``,
    ``.attn.qkv``, ``.attn.proj``, ``.ln2``, ``.mlp.0`` and ``.mlp.2`` (the MLP's Linears; a gated
    MLP's ``.mlp.gate_up`` and ``.mlp.down``), ``ln_f`` and, untied, ``head``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig; got {type(config).__name__}")
        self.config = config
        # Built on the meta device (build_empty), the embeddings draw nothing: normal_ on a meta tensor
        # imports torch._dynamo, a second of a loader's start-up.
        meta = torch.empty(0).is_meta

        def embedding(count: int) -> nn.Embedding:
            return nn.Embedding(count, config.dim, _weight=torch.empty(count, config.dim) if meta else None)

        self.tok = embedding(config.vocab_size)
        self.pos = embedding(config.max_len) if config.positions == "learned" else None
        # Rotary frequencies: float32 whatever the model's dtype (not a buffer, which .to() would round).
        self._inv_freq = inverse_frequencies(config) if config.positions == "rope" else None
        self.drop = nn.Dropout(config.embd_dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = norm_layer(config)
        if not config.tie_head:
            self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if not meta:
            nn.init.normal_(self.tok.weight, std=0.02)
            if self.pos is not None:
                nn.init.normal_(self.pos.weight, std=0.02)

    @property
    def head_weight(self) -> Tensor:
        """(V, dim): the output head's weight."""
        return self.tok.weight if self.config.tie_head else self.head.weight

    def make_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty KV cache per layer. On the CPU the model's weights are also moved onto huge
        pages in place where they span one (advise_huge_pages): a decode step streams them all."""
        if max_len is None:
            max_len = self.config.max_len
        elif not isinstance(max_len, int) or isinstance(max_len, bool) or not 0 < max_len <= self.config.max_len:
            # Positions past config.max_len do not exist (no position embedding, no trained rotary
            # range): a longer cache would only hold memory no step can use.
            raise ValueError(f"max_len must be an int in 1..config.max_len={self.config.max_len}; got {max_len!r}")
        advise_huge_pages(self.parameters())
        return [b.attn.make_cache(batch_size, max_len) for b in self.blocks]

    def _embed(self, tokens: Tensor, caches: list[KVCache] | None) -> tuple[Tensor, Rotary | None]:
        """tokens (B, T) -> (embeddings (B, T, dim), rotary cos and sin (B, T, hd) or None), at
        per-sequence positions (after the cache)."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an int64 or int32 tensor of shape (B, T); got {tokens!r:.80}")
        B, T = tokens.shape
        V = self.config.vocab_size
        # Checked here, where compile and export keep it: a compiled embedding's own bounds check
        # fires inside a parallel loop, which aborts the process (AOTInductor, C++ callers) instead of raising.
        torch._assert_async(((tokens >= 0) & (tokens < V)).all(), f"tokens must be in [0, vocab_size={V})")
        if caches is not None:
            if len(caches) != len(self.blocks):
                raise ValueError(f"caches must hold one KVCache per layer ({len(self.blocks)}); got {len(caches)}")
            offset = caches[0].lengths[:, None]
        else:
            offset = torch.zeros(B, 1, dtype=torch.int64, device=tokens.device)
        positions = offset + torch.arange(T, device=tokens.device)  # (B, T)
        # Checked on the values where compile and export keep it (the embedding lookup must not read past it).
        torch._assert_async((positions < self.config.max_len).all(), f"sequence longer than max_len={self.config.max_len}")
        if self.pos is not None:
            return self.drop(self.tok(tokens) + self.pos(positions)), None
        x = self.drop(self.tok(tokens))
        assert self._inv_freq is not None
        return x, Rotary.at(positions, self._inv_freq, x.dtype)

    def _packing(self, x: Tensor, mask: Tensor | None) -> _Packing | None:
        """Pack the real tokens when there is padding to skip (eager only: compiled and exported
        graphs keep static shapes and compute every position)."""
        if mask is None or _tracing() or bool(mask.all()):
            return None
        return _Packing.of(mask)

    def hidden_states(
        self, tokens: Tensor, key_padding_mask: Tensor | None = None, *, caches: list[KVCache] | None = None
    ) -> tuple[Tensor, _Packing | None]:
        """The final hidden states (after ln_f): ((B, T, dim), None), or ((N, dim), packing) for
        the N real tokens of a padded batch (every per-token operation skips the padding)."""
        x, rotary = self._embed(tokens, caches)  # (B, T, dim)
        mask = normalize_key_padding_mask(key_padding_mask, x)
        packing = self._packing(x, mask)
        if packing is None:
            for i, block in enumerate(self.blocks):
                x, _ = block(x, mask, cache=None if caches is None else caches[i], rotary=rotary)
            return self.ln_f(x), None
        h = packing.pack(x)  # (N, dim)
        rotary = None if rotary is None else rotary.pack(packing.pack)  # (N, hd)
        for i, block in enumerate(self.blocks):
            h = block.forward_packed(h, packing, cache=None if caches is None else caches[i], rotary=rotary)
        return self.ln_f(h), packing

    def logits(self, h: Tensor, *, float32: bool = False) -> Tensor:
        """Hidden states (..., dim) -> logits (..., V); with float32 (a bfloat16/half model), the
        head's sums in float32 as they are, not rounded to the model's dtype (unrounded_matmul)."""
        weight = self.head_weight
        if float32 and h.dtype in _HALF:
            return unrounded_matmul(h, weight)
        y = few_rows_matmul(h, weight)  # a decode step: W h^T
        if y is None:
            y = widened_matmul(h, weight)  # half precision on a CPU without half arithmetic
        if y is None:
            y = float32_matmul(h, weight)  # float32 without a gradient
        return h @ weight.t() if y is None else y

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        return_attention: bool = False,
        float32_logits: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """tokens (B, T) int64 -> logits (B, T, V) [, attention weights per layer (B, H, T, T)].

        key_padding_mask (B, T): True (or 1) = real token. Nothing is computed for padding
        positions: their logits are 0. With caches, tokens are the new tokens of each sequence and
        their positions continue from each sequence's own cache length. float32_logits: a
        bfloat16/half model's logits in float32, the head's sums unrounded (logits(float32=True)).
        """
        if return_attention:
            if caches is not None:
                raise ValueError("return_attention is not available with caches (it materialises T x T weights)")
            x, rotary = self._embed(tokens, None)
            mask = normalize_key_padding_mask(key_padding_mask, x)
            maps = []
            for block in self.blocks:
                x, w = block(x, mask, return_weights=True, rotary=rotary)
                assert w is not None
                maps.append(w)
            return self._zero_padding(self.logits(self.ln_f(x), float32=float32_logits), mask), maps
        h, packing = self.hidden_states(tokens, key_padding_mask, caches=caches)
        if packing is not None:
            return self._padded_logits(h, packing, float32=float32_logits)  # (B, T, V), zeros at padding
        logits = self.logits(h, float32=float32_logits)  # (B, T, V)
        if key_padding_mask is not None and _tracing():  # eager: no padding here (else it was packed)
            logits = self._zero_padding(logits, normalize_key_padding_mask(key_padding_mask, h))
        return logits

    def _padded_logits(self, h: Tensor, packing: _Packing, *, float32: bool = False) -> Tensor:
        """Packed hidden states (N, dim) -> logits (B, T, V) with zeros at padding. Without autograd
        and with right padding, each sequence's logits are written in place by the head's product
        (float32 where float32_matmul takes it: copied from its (n, V) product), no scatter of an
        (N, V) temporary; otherwise one scatter."""
        weight = self.head_weight
        lengths = packing.right_padded_lengths()
        if (lengths is None or (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad))
                or widens(h, weight) or (float32 and h.dtype in _HALF)):
            return packing.unpack(self.logits(h, float32=float32))
        B, T = packing.mask.shape
        logits = h.new_empty(B, T, weight.shape[0])
        start = 0
        for b, n in enumerate(lengths):
            y = float32_matmul(h[start : start + n], weight)  # float32: oneDNN's product where it applies
            if y is None:
                torch.mm(h[start : start + n], weight.t(), out=logits[b, :n])
            else:
                logits[b, :n].copy_(y)
            logits[b, n:].zero_()
            start += n
        return logits

    @staticmethod
    def _zero_padding(logits: Tensor, mask: Tensor | None) -> Tensor:
        return logits if mask is None else logits.masked_fill(~mask[..., None], 0)

    def last_logits(self, tokens: Tensor, lengths: Tensor, *, caches: list[KVCache] | None = None,
                    float32_logits: bool = False) -> Tensor:
        """Right-padded tokens (B, T) with real lengths (B,) -> logits at each sequence's last
        real token (B, V): the head runs on B positions only (prefill for generation).
        float32_logits: as forward's."""
        B, T = tokens.shape
        mask = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]  # (B, T)
        h, packing = self.hidden_states(tokens, mask, caches=caches)
        if packing is None:
            last = h[torch.arange(B, device=h.device), lengths - 1]  # (B, dim)
        else:
            last = h.index_select(0, lengths.cumsum(0) - 1)  # (B, dim): packed rows are in (b, t) order
        return self.logits(last, float32=float32_logits)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]] | Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        top_k: int | None = None,
        temperature: float = 1.0,
        eos_id: int | None = None,
        pad_id: int = 0,
        generator: torch.Generator | None = None,
        float32_logits: bool = True,
    ) -> list[list[int]]:
        """Continues every prompt by up to max_new_tokens tokens, in one ragged batch.

        prompts: B lists of int token ids (ragged), or a (B, T) integer tensor (B prompts of T
        tokens). Greedy when top_k is None, else top-k sampling at the temperature (positive; it
        divides the logits). With use_cache the prompts are prefilled right-padded into a KV cache
        (no left padding; the head runs only at each prompt's last token) and each step feeds one
        token per sequence; without it every step recomputes the whole prefix (for comparison).
        The last generated token is never fed back, so prompt + max_new_tokens - 1 must fit in
        max_len (a prompt of max_len tokens gets one). float32_logits (the default): a
        bfloat16/half model chooses from its head's float32 sums, not from logits rounded to its
        dtype, which make nearby logits equal (bfloat16 keeps 8 bits) and greedy picks the first of
        them. Returns the generated tokens of each prompt (up to and including eos_id).
        """
        prompts = _token_lists(prompts)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"top_k must be None or in 1..vocab_size={self.config.vocab_size}; got {top_k}")
        # The C++ GenerateOptions' rule and message: 0 is not greedy (top_k=None is).
        if not temperature > 0:
            raise ValueError(f"temperature must be positive; got {temperature}")
        V = self.config.vocab_size
        # Token ids are checked here, naming the argument (the forward's own check can only say "tokens").
        eos_id = None if eos_id is None else _token_id("eos_id", eos_id, V)
        pad_id = _token_id("pad_id", pad_id, V)
        for b, prompt in enumerate(prompts):
            bad = next((t for t, token in enumerate(prompt) if not 0 <= token < V), None)
            if bad is not None:
                raise ValueError(f"prompts[{b}][{bad}] = {prompt[bad]} is not a token id: token ids are in "
                                 f"0..vocab_size-1 = 0..{V - 1}")
        device = self.tok.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
        B, longest = len(prompts), int(lengths.max())
        positions = longest + max_new_tokens - 1  # the last token chosen needs no position
        if positions > self.config.max_len:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 = {positions} positions "
                             f"exceeds max_len={self.config.max_len}")
        picks = _Picks(B, device, top_k=top_k, temperature=temperature, eos_id=eos_id, generator=generator,
                       float32_logits=float32_logits)
        if use_cache:
            self._generate_cached(prompts, lengths, max_new_tokens, positions, pad_id, picks)
        else:
            self._generate_uncached(prompts, max_new_tokens, pad_id, picks)
        return picks.out

    def _generate_cached(self, prompts: list[list[int]], lengths: Tensor, max_new_tokens: int, positions: int,
                         pad_id: int, picks: _Picks) -> None:
        """Prefills the right-padded prompts into KV caches, then feeds one token per sequence."""
        B, longest = len(prompts), int(lengths.max())
        tokens = self._pad(prompts, longest, pad_id)  # (B, longest)
        caches = self.make_caches(B, positions)
        last = self.last_logits(tokens, lengths, caches=caches, float32_logits=picks.float32_logits)  # (B, V)
        for step in range(max_new_tokens):
            nxt = picks.choose(last)  # (B,)
            picks.record(nxt)
            if picks.all_done() or step == max_new_tokens - 1:
                break
            h, _ = self.hidden_states(nxt[:, None], None, caches=caches)  # (B, 1, dim)
            last = self.logits(h[:, 0], float32=picks.float32_logits)  # (B, V)

    def _generate_uncached(self, prompts: list[list[int]], max_new_tokens: int, pad_id: int, picks: _Picks) -> None:
        """Recomputes the whole prefix at every step (the cached loop's baseline)."""
        device = self.tok.weight.device
        seqs = [list(p) for p in prompts]
        for _ in range(max_new_tokens):
            n = max(len(s) for s in seqs)
            tokens = self._pad(seqs, n, pad_id)  # (B, n)
            lens = torch.tensor([len(s) for s in seqs], device=device)
            nxt = picks.choose(self.last_logits(tokens, lens, float32_logits=picks.float32_logits))
            picks.record(nxt)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            if picks.all_done():
                break

    def _pad(self, seqs: list[list[int]], n: int, pad_id: int) -> Tensor:
        """Right-pads token lists to (B, n) int64."""
        tokens = torch.full((len(seqs), n), pad_id, dtype=torch.int64, device=self.tok.weight.device)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return tokens

    def save(self, directory: str | Path) -> None:
        """Writes model.safetensors and config.json into directory (created if needed)."""
        checkpoint.save(self, Path(directory))

    @classmethod
    def load(cls, directory: str | Path) -> GPT:
        """A model from save()'s directory: every tensor checked against the config (errors name it)."""
        return checkpoint.load(Path(directory), cls)

    @classmethod
    def empty(cls, config: GPTConfig, *, dtype: torch.dtype = torch.float32) -> GPT:
        """GPT(config) in dtype with uninitialised parameters, for a loader that fills every one
        (checkpoint.build_empty: no float32 twin of a half model, no init)."""
        return checkpoint.build_empty(cls, config, dtype)  # type: ignore[return-value]


class _Picks:
    """generate's choice of each next token (greedy, or top-k sampling) and the tokens chosen so
    far, up to and including eos_id."""

    def __init__(self, B: int, device: torch.device, *, top_k: int | None, temperature: float, eos_id: int | None,
                 generator: torch.Generator | None, float32_logits: bool) -> None:
        self.top_k, self.temperature, self.eos_id, self.generator = top_k, temperature, eos_id, generator
        self.float32_logits = float32_logits
        self.out: list[list[int]] = [[] for _ in range(B)]
        self.done = torch.zeros(B, dtype=torch.bool, device=device)

    def choose(self, last: Tensor) -> Tensor:  # (B, V) logits -> (B,) tokens
        if self.top_k is None:
            return last.argmax(-1)
        values, indices = (last / self.temperature).topk(self.top_k, dim=-1)  # (B, k)
        picks = torch.multinomial(values.softmax(-1), 1, generator=self.generator)  # (B, 1)
        return indices.gather(1, picks)[:, 0]

    def record(self, nxt: Tensor) -> None:
        for b, token in enumerate(nxt.tolist()):
            if not self.done[b]:
                self.out[b].append(token)
        if self.eos_id is not None:
            self.done = self.done | (nxt == self.eos_id)

    def all_done(self) -> bool:
        return bool(self.done.all())


def _token_id(name: str, value: Any, vocab_size: int) -> int:
    """generate's eos_id / pad_id as an int in 0..vocab_size-1, or a ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        token = operator.index(value)
    except TypeError:
        token = None
    if token is None or not 0 <= token < vocab_size:
        raise ValueError(f"{name} must be a token id in 0..vocab_size-1 = 0..{vocab_size - 1}; got {value!r}")
    return token


def _token_lists(prompts: Any) -> list[list[int]]:
    """generate's prompts as lists of ints: a list of token-id sequences, or a (B, T) integer
    tensor. Anything else (floats, bools, an empty prompt) is a ValueError naming the place."""
    if isinstance(prompts, Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype.is_complex or prompts.dtype == torch.bool:
            raise ValueError(f"prompts as a tensor must be a (B, T) integer tensor; got {prompts.dtype} of shape "
                             f"{tuple(prompts.shape)}")
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of non-empty token lists; got {prompts!r:.80}")
    out: list[list[int]] = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist() if prompt.dim() == 1 else prompt
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or len(prompt) == 0:
            raise ValueError(f"prompts must be a non-empty list of non-empty token lists; prompts[{b}] is {prompt!r:.80}")
        tokens = []
        for t, token in enumerate(prompt):
            # int or numpy's integers; a float (12.5) is not truncated, nor a bool taken for 0/1.
            try:
                if isinstance(token, bool):
                    raise TypeError
                tokens.append(operator.index(token))
            except TypeError:
                raise ValueError(f"prompts[{b}][{t}] must be an int token id; got {token!r}") from None
        out.append(tokens)
    return out


#: The demo's small model is a configuration of GPT (``GPTConfig`` defaults); the old name stays.
TinyGPT = GPT
