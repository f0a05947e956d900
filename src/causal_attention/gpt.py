"""A small GPT built from CausalSelfAttention: training on right-padded batches and batched
generation over ragged prompts with a static KV cache.

Shapes: B = batch, T = tokens, V = vocabulary, dim = model width.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .module import CausalSelfAttention


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    max_len: int  # longest sequence (prompt + generated tokens)
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    mlp_ratio: int = 4

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = CausalSelfAttention(config.dim, config.n_heads)
        self.ln2 = nn.LayerNorm(config.dim)
        hidden = config.mlp_ratio * config.dim
        self.mlp = nn.Sequential(nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim))

    def forward(
        self, x: Tensor, mask: Tensor | None, *, cache: KVCache | None = None, return_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, dim) -> (x (B, T, dim), attention weights (B, H, T, T) or None)."""
        weights = None
        if return_weights:
            a, weights = self.attn(self.ln1(x), mask, return_weights=True)
        else:
            a = self.attn(self.ln1(x), mask, cache=cache)
        x = x + a
        x = x + self.mlp(self.ln2(x))
        return x, weights


class TinyGPT(nn.Module):
    """Token and per-sequence position embeddings, N blocks, a final LayerNorm and a head tied to
    the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.max_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def make_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty KV cache per layer."""
        return [b.attn.make_cache(batch_size, max_len or self.config.max_len) for b in self.blocks]

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """tokens (B, T) int64 -> logits (B, T, V) [, attention weights per layer (B, H, T, T)].

        With caches, tokens are the new tokens of each sequence and their positions continue
        from each sequence's own cache length.
        """
        if caches is not None and return_attention:
            raise ValueError("return_attention is not available with caches (it materialises T x T weights)")
        B, T = tokens.shape
        offset = caches[0].lengths[:, None] if caches is not None else torch.zeros(B, 1, dtype=torch.int64, device=tokens.device)
        positions = offset + torch.arange(T, device=tokens.device)  # (B, T)
        # Checked on the values where compile and export keep it (the embedding lookup must not read past it).
        torch._assert_async((positions < self.config.max_len).all(), f"sequence longer than max_len={self.config.max_len}")
        x = self.tok(tokens) + self.pos(positions)  # (B, T, dim)
        maps = []
        for i, block in enumerate(self.blocks):
            x, w = block(x, key_padding_mask, cache=None if caches is None else caches[i], return_weights=return_attention)
            if w is not None:
                maps.append(w)
        logits = self.ln_f(x) @ self.tok.weight.t()  # (B, T, V), tied head
        return (logits, maps) if return_attention else logits

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        top_k: int | None = None,
        temperature: float = 1.0,
        eos_id: int | None = None,
        pad_id: int = 0,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Continues every prompt by up to max_new_tokens tokens, in one ragged batch.

        Greedy when top_k is None, else top-k sampling at the temperature. With use_cache the
        prompts are prefilled right-padded into a KV cache and each step feeds one token per
        sequence; without it every step recomputes the whole prefix (for comparison).
        Returns the generated tokens of each prompt (up to and including eos_id).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        device = self.tok.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
        B, longest = len(prompts), int(lengths.max())
        if longest + max_new_tokens > self.config.max_len:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_len={self.config.max_len}")
        out: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(B, dtype=torch.bool, device=device)

        def choose(last: Tensor) -> Tensor:  # (B, V) logits -> (B,) tokens
            if top_k is None:
                return last.argmax(-1)
            values, indices = (last / temperature).topk(top_k, dim=-1)  # (B, k)
            picks = torch.multinomial(values.softmax(-1), 1, generator=generator)  # (B, 1)
            return indices.gather(1, picks)[:, 0]

        def record(nxt: Tensor) -> None:
            nonlocal done
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
            if eos_id is not None:
                done = done | (nxt == eos_id)

        if use_cache:
            tokens = self._pad(prompts, longest, pad_id)  # (B, longest)
            mask = torch.arange(longest, device=device)[None, :] < lengths[:, None]  # (B, longest)
            caches = self.make_caches(B, longest + max_new_tokens)
            logits = self(tokens, mask, caches=caches)  # (B, longest, V)
            last = logits[torch.arange(B, device=device), lengths - 1]  # (B, V)
            for step in range(max_new_tokens):
                nxt = choose(last)  # (B,)
                record(nxt)
                if bool(done.all()) or step == max_new_tokens - 1:
                    break
                last = self(nxt[:, None], None, caches=caches)[:, 0]  # (B, V)
            return out

        seqs = [list(p) for p in prompts]
        for _ in range(max_new_tokens):
            n = max(len(s) for s in seqs)
            tokens = self._pad(seqs, n, pad_id)  # (B, n)
            lens = torch.tensor([len(s) for s in seqs], device=device)
            mask = torch.arange(n, device=device)[None, :] < lens[:, None]  # (B, n)
            last = self(tokens, mask)[torch.arange(B, device=device), lens - 1]  # (B, V)
            nxt = choose(last)
            record(nxt)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            if bool(done.all()):
                break
        return out

    def _pad(self, seqs: list[list[int]], n: int, pad_id: int) -> Tensor:
        """Right-pads token lists to (B, n) int64."""
        tokens = torch.full((len(seqs), n), pad_id, dtype=torch.int64, device=self.tok.weight.device)
        for b, s in enumerate(seqs):
            tokens[b, : len(s)] = torch.tensor(s, dtype=torch.int64)
        return tokens
