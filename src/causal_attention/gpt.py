"""GPT: a GPT-2-style decoder built from CausalSelfAttention, for training on right-padded
batches and batched generation over ragged prompts with a static KV cache.

One class covers the demo's small model (``GPTConfig()`` defaults) and GPT-2 itself
(``GPTConfig.gpt2()``, or ``GPT.from_huggingface`` / ``GPT.from_nanogpt``: see checkpoints.py).

Shapes: B = batch, T = tokens, V = vocabulary, dim = model width, N = real tokens of a batch.
"""

from __future__ import annotations

import json
import operator
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .cache import KVCache, advise_huge_pages
from .module import CausalSelfAttention, _tracing, few_rows_linear, few_rows_matmul, normalize_key_padding_mask

Activation = Literal["gelu", "gelu_tanh"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The architecture of a GPT (all keyword-only).

    vocab_size: tokens; max_len: positions (GPT-2's n_positions, nanoGPT's block_size); dim: width;
    n_layers, n_heads (must divide dim); mlp_hidden: the MLP's inner width (None = 4 * dim);
    layer_norm_eps; activation: ``"gelu"`` (exact, nanoGPT) or ``"gelu_tanh"`` (GPT-2's gelu_new);
    bias: biases in every Linear and LayerNorm (nanoGPT's bias=False removes them); tie_head: the
    output head is the token embedding; attn_dropout, resid_dropout, embd_dropout: GPT-2's attn_pdrop,
    resid_pdrop, embd_pdrop (training mode only).
    """

    vocab_size: int
    max_len: int
    dim: int = 128
    n_layers: int = 3
    n_heads: int = 4
    mlp_hidden: int | None = None
    layer_norm_eps: float = 1e-5
    activation: Activation = "gelu"
    bias: bool = True
    tie_head: bool = True
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int; got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"GPTConfig: n_heads={self.n_heads} must divide dim={self.dim}")
        if self.mlp_hidden is not None and (
            not isinstance(self.mlp_hidden, int) or isinstance(self.mlp_hidden, bool) or self.mlp_hidden <= 0
        ):
            raise ValueError(f"GPTConfig.mlp_hidden must be None or a positive int; got {self.mlp_hidden!r}")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"GPTConfig.activation must be 'gelu' or 'gelu_tanh'; got {self.activation!r}")
        if not (isinstance(self.layer_norm_eps, float) and self.layer_norm_eps > 0):
            raise ValueError(f"GPTConfig.layer_norm_eps must be a positive float; got {self.layer_norm_eps!r}")
        for name in ("attn_dropout", "resid_dropout", "embd_dropout"):
            p = getattr(self, name)
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be a probability in [0, 1); got {p!r}")
        for name in ("bias", "tie_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool; got {getattr(self, name)!r}")

    @property
    def hidden(self) -> int:
        """The MLP's inner width."""
        return self.mlp_hidden if self.mlp_hidden is not None else 4 * self.dim

    @classmethod
    def gpt2(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (124M): 50257 tokens, 1024 positions, 12 layers of width 768 with 12 heads,
        tanh GELU, tied head, dropout 0.1; keywords override any field."""
        base: dict[str, Any] = dict(vocab_size=50257, max_len=1024, dim=768, n_layers=12, n_heads=12,
                                    activation="gelu_tanh", attn_dropout=0.1, resid_dropout=0.1, embd_dropout=0.1)
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> GPTConfig:
        """From config.json's values (to_dict's output, with "format" = FORMAT optional); strict, as
        the C++ GPTConfig::from_json: an unknown key, a missing one, a JSON type other than the
        field's (true is not an int, 2.0 is not an int) is a ValueError naming `source` and the key.

        An older version's file (the demo's ``mlp_ratio``, before the other options existed) is read
        as the model that version built: the options it lacks take LEGACY_DEFAULTS, named in a warning.
        """
        checked = _config_values(values, source=source)
        try:
            return cls(**checked)
        except ValueError as exc:  # a value out of range (__post_init__)
            raise ValueError(f"{source}: {exc}") from None


#: What config.json's "format" key holds (GPT.save writes it; a file may omit it).
FORMAT = "causal_attention.gpt"
_INT_OPTIONS = ("vocab_size", "max_len", "dim", "n_layers", "n_heads")
_NUMBER_OPTIONS = ("layer_norm_eps", "attn_dropout", "resid_dropout", "embd_dropout")
_BOOL_OPTIONS = ("bias", "tie_head")
_OPTIONS = tuple(f.name for f in fields(GPTConfig))
#: An older version's config.json (the demo's, with mlp_ratio) holds these keys; the options it
#: lacks take the values of the model that version built.
LEGACY_REQUIRED = ("vocab_size", "max_len", "dim", "n_layers", "n_heads", "mlp_ratio")
LEGACY_DEFAULTS: dict[str, Any] = {"layer_norm_eps": 1e-5, "activation": "gelu", "bias": True, "tie_head": True,
                                   "attn_dropout": 0.0, "resid_dropout": 0.0, "embd_dropout": 0.0}


def _json_text(value: Any) -> str:
    """A value as JSON writes it compactly (as nlohmann's dump(), so both sides' messages agree)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63


def _listing(names: list[str]) -> str:
    """['a', 'b'] (at most 8 names, then ', ...')."""
    shown = ", ".join(f"'{n}'" for n in names[:8])
    return f"[{shown}{', ...' if len(names) > 8 else ''}]"


def _config_values(values: dict[str, Any], *, source: str) -> dict[str, Any]:
    """GPTConfig's keyword arguments from config.json's values, checked in the order C++'s
    GPTConfig::from_json checks them: unknown keys, format, missing keys, each key's JSON type."""
    unknown = sorted(set(values) - set(_OPTIONS) - {"format", "mlp_ratio"})
    if unknown:
        raise ValueError(f"{source}: unknown option(s) {_listing(unknown)}; known: {', '.join(sorted(_OPTIONS + ('format',)))}")
    if "format" in values and values["format"] != FORMAT:
        raise ValueError(f'{source}: format must be "{FORMAT}"; got {_json_text(values["format"])}')
    legacy = "mlp_ratio" in values
    if legacy and "mlp_hidden" in values:
        raise ValueError(f"{source}: mlp_ratio (an older version's option) and mlp_hidden cannot both be given")
    required = LEGACY_REQUIRED if legacy else _OPTIONS
    missing = sorted(set(required) - set(values))
    if missing:
        raise ValueError(f"{source}: missing option(s) {_listing(missing)} (GPT.save writes every option)")
    out: dict[str, Any] = {}
    for key in _OPTIONS:
        if key not in values:
            continue
        value = values[key]
        if key in _INT_OPTIONS:
            ok, what = _is_int64(value), "an int"
        elif key == "mlp_hidden":
            ok, what = value is None or _is_int64(value), "an int or null"
        elif key in _NUMBER_OPTIONS:
            ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            value = float(value) if ok else value
        elif key in _BOOL_OPTIONS:
            ok, what = isinstance(value, bool), "true or false"
        else:  # activation
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"{source}: {key} must be {what}; got {_json_text(values[key])}")
        out[key] = value
    if legacy:
        ratio = values["mlp_ratio"]
        if not _is_int64(ratio):
            raise ValueError(f"{source}: mlp_ratio must be an int; got {_json_text(ratio)}")
        if ratio <= 0:
            raise ValueError(f"{source}: mlp_ratio must be a positive int; got {ratio}")
        out["mlp_hidden"] = None if ratio == 4 else ratio * out["dim"]
        taken = {key: value for key, value in LEGACY_DEFAULTS.items() if key not in out}
        if taken:
            warnings.warn(f"{source}: an older version's file (mlp_ratio); the options it lacks take that version's "
                          f"values: {', '.join(f'{k}={_json_text(v)}' for k, v in taken.items())}", UserWarning,
                          stacklevel=3)
        out = {**taken, **out}
    return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        dim, bias = config.dim, config.bias
        self.ln1 = nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=bias)
        self.attn = CausalSelfAttention(dim, config.n_heads, bias=bias, dropout=config.attn_dropout)
        self.attn_drop = nn.Dropout(config.resid_dropout)
        self.ln2 = nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=bias)
        approximate = "tanh" if config.activation == "gelu_tanh" else "none"
        self.mlp = nn.Sequential(
            nn.Linear(dim, config.hidden, bias=bias),
            nn.GELU(approximate=approximate),
            nn.Linear(config.hidden, dim, bias=bias),
            nn.Dropout(config.resid_dropout),
        )

    def forward(
        self, x: Tensor, mask: Tensor | None, *, cache: KVCache | None = None, return_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, dim) -> (x (B, T, dim), attention weights (B, H, T, T) or None)."""
        weights = None
        if return_weights:
            a, weights = self.attn(self.ln1(x), mask, return_weights=True)
        else:
            a = self.attn(self.ln1(x), mask, cache=cache)
        x = x + self.attn_drop(a)
        if cache is not None:  # a decode step: a few rows, no autograd (the cache is inference-only)
            h = few_rows_linear(self.mlp[2], self.mlp[1](few_rows_linear(self.mlp[0], self.ln2(x))))
            return x + self.mlp[3](h), weights
        x = x + self.mlp(self.ln2(x))
        return x, weights

    def forward_packed(self, x: Tensor, packing: _Packing, *, cache: KVCache | None = None) -> Tensor:
        """The same block on the real tokens only: x (N, dim) -> (N, dim). Every per-token
        operation (LayerNorms, projections, MLP) runs on the N real tokens; the attention sees them
        at their (B, T) places, with padding zeroed and masked."""
        qkv = self.attn.qkv(self.ln1(x))  # (N, 3 * dim)
        y = self.attn.attend(packing.unpack(qkv), packing.mask, cache=cache)  # (B, T, dim)
        x = x + self.attn_drop(self.attn.proj(packing.pack(y)))
        return x + self.mlp(self.ln2(x))


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
    """Token and position embeddings, n_layers Blocks, a final LayerNorm and a head (tied to the
    token embedding unless ``config.tie_head`` is False).

    Parameters: ``tok``, ``pos`` (embeddings), ``blocks.{i}.ln1``, ``.attn.qkv``, ``.attn.proj``,
    ``.ln2``, ``.mlp.0`` and ``.mlp.2`` (the MLP's Linears), ``ln_f`` and, untied, ``head``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig; got {type(config).__name__}")
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.max_len, config.dim)
        self.drop = nn.Dropout(config.embd_dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.dim, eps=config.layer_norm_eps, bias=config.bias)
        if not config.tie_head:
            self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    @property
    def head_weight(self) -> Tensor:
        """(V, dim): the output head's weight."""
        return self.tok.weight if self.config.tie_head else self.head.weight

    def make_caches(self, batch_size: int, max_len: int | None = None) -> list[KVCache]:
        """One empty KV cache per layer. On the CPU the model's weights are also moved onto huge
        pages in place where they span one (advise_huge_pages): a decode step streams them all."""
        advise_huge_pages(self.parameters())
        return [b.attn.make_cache(batch_size, max_len or self.config.max_len) for b in self.blocks]

    def _embed(self, tokens: Tensor, caches: list[KVCache] | None) -> Tensor:
        """tokens (B, T) -> embeddings (B, T, dim), at per-sequence positions (after the cache)."""
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
        return self.drop(self.tok(tokens) + self.pos(positions))

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
        x = self._embed(tokens, caches)  # (B, T, dim)
        mask = normalize_key_padding_mask(key_padding_mask, x)
        packing = self._packing(x, mask)
        if packing is None:
            for i, block in enumerate(self.blocks):
                x, _ = block(x, mask, cache=None if caches is None else caches[i])
            return self.ln_f(x), None
        h = packing.pack(x)  # (N, dim)
        for i, block in enumerate(self.blocks):
            h = block.forward_packed(h, packing, cache=None if caches is None else caches[i])
        return self.ln_f(h), packing

    def logits(self, h: Tensor) -> Tensor:
        """Hidden states (..., dim) -> logits (..., V)."""
        weight = self.head_weight
        y = few_rows_matmul(h, weight)  # a decode step: W h^T
        return h @ weight.t() if y is None else y

    def forward(
        self,
        tokens: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        caches: list[KVCache] | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """tokens (B, T) int64 -> logits (B, T, V) [, attention weights per layer (B, H, T, T)].

        key_padding_mask (B, T): True (or 1) = real token. Nothing is computed for padding
        positions: their logits are 0. With caches, tokens are the new tokens of each sequence and
        their positions continue from each sequence's own cache length.
        """
        if return_attention:
            if caches is not None:
                raise ValueError("return_attention is not available with caches (it materialises T x T weights)")
            x = self._embed(tokens, None)
            mask = normalize_key_padding_mask(key_padding_mask, x)
            maps = []
            for block in self.blocks:
                x, w = block(x, mask, return_weights=True)
                assert w is not None
                maps.append(w)
            return self._zero_padding(self.logits(self.ln_f(x)), mask), maps
        h, packing = self.hidden_states(tokens, key_padding_mask, caches=caches)
        if packing is not None:
            return self._padded_logits(h, packing)  # (B, T, V), zeros at padding
        logits = self.logits(h)  # (B, T, V)
        if key_padding_mask is not None and _tracing():  # eager: no padding here (else it was packed)
            logits = self._zero_padding(logits, normalize_key_padding_mask(key_padding_mask, h))
        return logits

    def _padded_logits(self, h: Tensor, packing: _Packing) -> Tensor:
        """Packed hidden states (N, dim) -> logits (B, T, V) with zeros at padding. Without autograd
        and with right padding, each sequence's logits are written in place by the head's product
        (no (N, V) temporary, no scatter); otherwise one scatter."""
        weight = self.head_weight
        lengths = packing.right_padded_lengths()
        if lengths is None or (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
            return packing.unpack(self.logits(h))
        B, T = packing.mask.shape
        logits = h.new_empty(B, T, weight.shape[0])
        start = 0
        for b, n in enumerate(lengths):
            torch.mm(h[start : start + n], weight.t(), out=logits[b, :n])
            logits[b, n:].zero_()
            start += n
        return logits

    @staticmethod
    def _zero_padding(logits: Tensor, mask: Tensor | None) -> Tensor:
        return logits if mask is None else logits.masked_fill(~mask[..., None], 0)

    def last_logits(self, tokens: Tensor, lengths: Tensor, *, caches: list[KVCache] | None = None) -> Tensor:
        """Right-padded tokens (B, T) with real lengths (B,) -> logits at each sequence's last
        real token (B, V): the head runs on B positions only (prefill for generation)."""
        B, T = tokens.shape
        mask = torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]  # (B, T)
        h, packing = self.hidden_states(tokens, mask, caches=caches)
        if packing is None:
            last = h[torch.arange(B, device=h.device), lengths - 1]  # (B, dim)
        else:
            last = h.index_select(0, lengths.cumsum(0) - 1)  # (B, dim): packed rows are in (b, t) order
        return self.logits(last)

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
    ) -> list[list[int]]:
        """Continues every prompt by up to max_new_tokens tokens, in one ragged batch.

        prompts: B lists of int token ids (ragged), or a (B, T) integer tensor (B prompts of T
        tokens). Greedy when top_k is None, else top-k sampling at the temperature (positive; it
        divides the logits). With use_cache the prompts are prefilled right-padded into a KV cache
        (no left padding; the head runs only at each prompt's last token) and each step feeds one
        token per sequence; without it every step recomputes the whole prefix (for comparison).
        The last generated token is never fed back, so prompt + max_new_tokens - 1 must fit in
        max_len (a prompt of max_len tokens gets one). Returns the generated tokens of each prompt
        (up to and including eos_id).
        """
        prompts = _token_lists(prompts)
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"top_k must be None or in 1..vocab_size={self.config.vocab_size}; got {top_k}")
        # The C++ GenerateOptions' rule and message: 0 is not greedy (top_k=None is).
        if not temperature > 0:
            raise ValueError(f"temperature must be positive; got {temperature}")
        device = self.tok.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
        B, longest = len(prompts), int(lengths.max())
        positions = longest + max_new_tokens - 1  # the last token chosen needs no position
        if positions > self.config.max_len:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) - 1 = {positions} positions "
                             f"exceeds max_len={self.config.max_len}")
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
            for b, token in enumerate(nxt.tolist()):
                if not done[b]:
                    out[b].append(token)
            if eos_id is not None:
                done = done | (nxt == eos_id)

        if use_cache:
            tokens = self._pad(prompts, longest, pad_id)  # (B, longest)
            caches = self.make_caches(B, positions)
            last = self.last_logits(tokens, lengths, caches=caches)  # (B, V)
            for step in range(max_new_tokens):
                nxt = choose(last)  # (B,)
                record(nxt)
                if bool(done.all()) or step == max_new_tokens - 1:
                    break
                h, _ = self.hidden_states(nxt[:, None], None, caches=caches)  # (B, 1, dim)
                last = self.logits(h[:, 0])  # (B, V)
            return out

        seqs = [list(p) for p in prompts]
        for _ in range(max_new_tokens):
            n = max(len(s) for s in seqs)
            tokens = self._pad(seqs, n, pad_id)  # (B, n)
            lens = torch.tensor([len(s) for s in seqs], device=device)
            nxt = choose(self.last_logits(tokens, lens))
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

    # Checkpoints: this project's own files, and converters from and to transformers and nanoGPT
    # (the work is in checkpoints.py).

    def save(self, directory: str | Path) -> None:
        """Writes model.safetensors and config.json into directory (created if needed)."""
        from . import checkpoints

        checkpoints.save(self, Path(directory))

    @classmethod
    def load(cls, directory: str | Path) -> GPT:
        """A model from save()'s directory: every tensor checked against the config (errors name it)."""
        from . import checkpoints

        return checkpoints.load(Path(directory))

    @classmethod
    def from_huggingface(cls, source: Any, *, n_heads: int | None = None) -> GPT:
        """From transformers' GPT-2: a GPT2LMHeadModel or GPT2Model, its state_dict, or a
        save_pretrained directory (config.json + model.safetensors, read offline)."""
        from . import checkpoints

        return checkpoints.from_huggingface(source, n_heads=n_heads)

    def to_huggingface_state_dict(self) -> dict[str, Tensor]:
        """The weights under GPT2LMHeadModel's names (Conv1D layout: weights (in, out))."""
        from . import checkpoints

        return checkpoints.to_huggingface_state_dict(self)

    @classmethod
    def from_nanogpt(cls, source: Any, *, n_heads: int | None = None) -> GPT:
        """From nanoGPT: the checkpoint dict its train.py saves ('model', 'model_args'), a path to
        it, or a bare state_dict (``_orig_mod.`` prefixes and ``attn.bias`` buffers handled)."""
        from . import checkpoints

        return checkpoints.from_nanogpt(source, n_heads=n_heads)

    def to_nanogpt_state_dict(self) -> dict[str, Tensor]:
        """The weights under nanoGPT's names (GPT.state_dict() of its model.py)."""
        from . import checkpoints

        return checkpoints.to_nanogpt_state_dict(self)


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


def load_config(path: Path) -> GPTConfig:
    """GPTConfig from a config.json written by GPT.save (or the demo): GPTConfig.from_dict's rules,
    and a ValueError naming the file for anything else (JSON not well-formed, NaN included, or not an
    object; a field out of range)."""

    def no_constant(name: str) -> Any:  # NaN and Infinity are not JSON (nor accepted by C++)
        raise ValueError(f"{name} is not a JSON value")

    try:
        values = json.loads(path.read_text(), parse_constant=no_constant)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ValueError(f"{path}: not well-formed JSON ({exc})") from None
    if not isinstance(values, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(values), "null")
        raise ValueError(f"{path}: must be a JSON object; got {kind}")
    return GPTConfig.from_dict(values, source=str(path))


#: The demo's small model is a configuration of GPT (``GPTConfig`` defaults); the old name stays.
TinyGPT = GPT
