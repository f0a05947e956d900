"""CausalSelfAttention: the attention layer of a GPT-style model.

    attn = CausalSelfAttention(768, 12)
    y = attn(x)                      # x (B, T, 768) -> y (B, T, 768)
    y = attn(x, key_padding_mask)    # key_padding_mask (B, T): True = real token, False = padding
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _ops, backends, reference
from .backends import Backend
from .cache import KVCache, advise_huge_pages
from .decode import (
    FEW_ROWS,
    _engine_streams,
    _few_rows_step,
    _global_forward_hooks,
    _linear_weights,
    _tracing,
    few_rows_linear,
    project,
)


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive; got {value}")
    return value


def normalize_key_padding_mask(key_padding_mask: Tensor | None, x: Tensor) -> Tensor | None:
    """Validates a key padding mask against x (B, T, dim); returns it as bool (B, T), True = real.

    An integer 0/1 mask (a tokenizer's attention_mask) means the same as bool. A float mask is a
    TypeError: it is ambiguous (an additive bias? a probability?).
    """
    if key_padding_mask is None:
        return None
    if not isinstance(key_padding_mask, Tensor):
        raise TypeError(f"key_padding_mask must be a Tensor or None; got {type(key_padding_mask).__name__}")
    mask = key_padding_mask
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(
            "key_padding_mask must be bool (True = real token) or an integer 0/1 tensor; "
            f"got dtype {mask.dtype} (a float mask is ambiguous: additive bias or probability?)"
        )
    B, T = x.shape[0], x.shape[1]
    if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] != T:
        raise ValueError(f"key_padding_mask must have shape (B, T) = ({B}, {T}); got shape {tuple(mask.shape)}")
    if mask.device != x.device:
        raise ValueError(f"key_padding_mask must be on the same device as x ({x.device}); got {mask.device}")
    if mask.dtype == torch.bool:
        return mask
    return backends.mask_to_bool(mask)  # checks the values inside an op: eager, compiled and exported


def _inference_cache_outside_inference_mode(cache: KVCache) -> bool:
    """Whether a step would write the cache's inference tensors outside inference mode, which may
    write them in place only inside it (both decode paths refuse it before writing)."""
    return not torch.is_inference_mode_enabled() and (
        cache.k.is_inference() or cache.v.is_inference() or cache.lengths.is_inference()
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one qkv projection and an output projection.

    Args:
        dim: model width; x is (B, T, dim).
        n_heads: number of (query) heads; must divide dim (head_dim = dim // n_heads).
        n_kv_heads: keyword-only; grouped-query attention (multi-query with 1): the key/value heads, a
            divisor of n_heads; query head h reads key/value head h // (n_heads // n_kv_heads). None
            (the default): n_heads, the multi-head layer of the contract, bit for bit.
        backend: keyword-only. ``"auto"`` (the compiled C++ engine on CPU, torch's SDPA on CUDA),
            or one of ``"cpp"``, ``"sdpa"``, ``"reference"`` to force one.
        bias: keyword-only; False makes qkv and proj Linear layers without bias (nanoGPT's
            ``bias=False``, nn.MultiheadAttention's ``bias=False``).
        dropout: keyword-only. Attention-weight dropout probability in [0, 1), applied in training
            mode only (``P * keep / (1 - dropout)``, as nn.MultiheadAttention); 0 (the default) and
            eval mode are exact. The C++ engine draws one seed per call from torch's default
            generator, so ``torch.manual_seed`` reproduces a run, for any thread count.
        device, dtype: keyword-only, for the parameters.

    State: ``qkv`` = Linear(dim, 3 * dim) (output split q | k | v; with n_kv_heads
    Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim)) and ``proj`` = Linear(dim, dim); the state_dict
    holds exactly their weights and biases (weights only with ``bias=False``).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        backend: Backend = "auto",
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_positive_int("dim", dim)
        _check_positive_int("n_heads", n_heads)
        if dim % n_heads != 0:
            raise ValueError(f"CausalSelfAttention: dim (got {dim}) must be divisible by n_heads (got {n_heads})")
        if n_kv_heads is not None:
            _check_positive_int("n_kv_heads", n_kv_heads)
            if n_heads % n_kv_heads != 0:
                raise ValueError(f"CausalSelfAttention: n_kv_heads (got {n_kv_heads}) must divide n_heads (got {n_heads})")
        if backend != "auto" and backend not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {('auto',) + backends.BACKENDS}; got {backend!r}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool):
            raise TypeError(f"dropout must be a float in [0, 1); got {type(dropout).__name__} {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1); got {dropout}")
        self.dropout = float(dropout)
        self.dim = dim
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.n_kv_heads = n_kv_heads  # None: n_heads (the ops are then called without it)
        self.backend: Backend = backend
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool; got {type(bias).__name__}")
        width = (n_heads + 2 * self.kv_heads) * self.head_dim  # q | k | v
        self.qkv = nn.Linear(dim, width, bias=bias, device=device, dtype=dtype)
        self.proj = nn.Linear(dim, dim, bias=bias, device=device, dtype=dtype)

    @property
    def kv_heads(self) -> int:
        """The key/value heads: n_kv_heads, or n_heads without it."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def extra_repr(self) -> str:
        extra = f", dropout={self.dropout}" if self.dropout else ""
        heads = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads is not None else ""
        return (f"dim={self.dim}, n_heads={self.n_heads}{heads}, head_dim={self.head_dim}, backend={self.backend!r}"
                f"{extra}")

    def _check_x(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor of shape (B, T, dim); got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"x must be 3-D (B, T, dim); got shape {tuple(x.shape)}")
        if x.shape[2] != self.dim:
            raise ValueError(f"x must have last dimension dim={self.dim}; got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor; got dtype {x.dtype}")
        qkv = self.qkv
        # Only a plain Linear's weight is what its product reads: hooks (FSDP, offloading), a replaced
        # forward (accelerate) or a parametrization (its class changes) make or move it in the call.
        if type(qkv) is not nn.Linear or qkv._forward_pre_hooks or "forward" in qkv.__dict__:
            return
        weight = qkv.weight
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            return  # a quantized weight: the product checks its own input
        # Said here, naming x, where torch's own message names mat1 and mat2. Under autocast x may
        # legitimately differ from the weights' dtype (the projections cast it).
        autocast = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)
        if x.dtype != weight.dtype and not autocast:
            raise TypeError(f"x must have the layer's parameters' dtype {weight.dtype}; got x of dtype {x.dtype} "
                            "(convert one: layer.to(x.dtype) or x.to(dtype))")
        if x.device != weight.device:
            raise ValueError(f"x must be on the layer's parameters' device {weight.device}; got x on {x.device} "
                             "(move one: layer.to(x.device) or x.to(device))")

    def make_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> KVCache:
        """An empty KV cache for this layer: (batch_size, kv_heads, max_len, head_dim) keys and values.
        On the CPU, the layer's weights are also moved onto huge pages in place where they span one
        (advise_huge_pages), as the cache's buffers are: a decode step streams both."""
        weight = getattr(self.qkv, "weight", None)
        advise_huge_pages((weight, getattr(self.proj, "weight", None)))
        if dtype is None or device is None:
            if not isinstance(weight, Tensor) or not weight.is_floating_point():
                raise TypeError(
                    "make_cache takes the cache's dtype and device from qkv.weight, which is not a floating-point "
                    f"tensor here ({type(weight).__name__}: a quantized layer?); pass dtype= and device="
                )
            dtype, device = dtype or weight.dtype, device or weight.device
        return KVCache.empty(batch_size, self.kv_heads, self.head_dim, max_len, dtype=dtype, device=device)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Causal self-attention.

        Args:
            x: (B, T, dim).
            key_padding_mask: (B, T), True (or 1) = real token, False (or 0) = padding; None = all real.
            cache: keyword-only; a KVCache to generate with (inference only). x holds the new tokens
                of each sequence, which attend the cache plus the new tokens up to themselves; their
                keys and values are written at each sequence's own position and its length grows by
                its number of real new tokens. With a cache the mask must be right padding.
            return_weights: keyword-only; also return the attention weights (B, H, T, T), computed
                by the reference (for inspection: it materialises T x T). Not with a cache.

        Returns:
            out (B, T, dim), or (out, weights) when return_weights.
        """
        if cache is not None and key_padding_mask is None and not return_weights:
            y = self._decode_step(x, cache)  # the common decode step, in one op call
            if y is not None:
                return y
        self._check_x(x)
        mask = normalize_key_padding_mask(key_padding_mask, x)  # (B, T) bool or None
        if cache is not None:
            if return_weights:
                raise ValueError("return_weights is not available with a cache")
            self._check_cache(cache, x, "x")
            fused = self._decode_layer(x, mask, cache)
            if fused is not None:
                return fused
            y = self.attend(few_rows_linear(self.qkv, x), mask, cache=cache)  # (B, t, dim)
            return few_rows_linear(self.proj, y)  # (B, t, dim)
        qkv = project(self.qkv, x)  # (B, T, 3 * dim)
        if return_weights:
            dropout_p = self.dropout if self.training else 0.0
            keep = backends.dropout_keep(qkv, self.n_heads, dropout_p) if dropout_p > 0 else None  # (B, H, T, T)
            y, weights = reference.attention_core(
                qkv, mask, self.n_heads, n_kv_heads=self.n_kv_heads, return_weights=True, dropout_p=dropout_p, keep=keep
            )
            assert weights is not None
            return project(self.proj, y), weights
        return project(self.proj, self.attend(qkv, mask))  # (B, T, dim)

    def attend(self, qkv: Tensor, key_padding_mask: Tensor | None, *, cache: KVCache | None = None) -> Tensor:
        """The attention between the projections: qkv (B, T, 3 * dim; (B, T, (H + 2 Hkv) * hd) with
        n_kv_heads) -> joined heads (B, T, dim).

        key_padding_mask: bool (B, T) or None (as normalised by forward). With a cache (checked by
        the caller against the shapes), the new keys and values are written and the lengths grow.
        For callers that make qkv themselves (the GPT computes the projections for real tokens only).
        """
        if cache is not None:
            self._check_cache(cache, qkv, "qkv")
            return self._attend_cached(qkv, key_padding_mask, cache)
        name = backends.select_backend(qkv, self.backend)
        dropout_p = self.dropout if self.training else 0.0
        if self.n_kv_heads is None:
            return backends.RUN[name](qkv, key_padding_mask, self.n_heads, dropout_p)  # (B, T, dim)
        return backends.RUN[name](qkv, key_padding_mask, self.n_heads, dropout_p, n_kv_heads=self.n_kv_heads)

    def _decode_step(self, x: Tensor, cache: KVCache) -> Tensor | None:
        """forward(x, cache=cache) without a mask, by the fused decode_layer op, asking in Python only
        whether x, the backend and the engine allow it and what the op cannot see (grad mode,
        tracing, autocast, inference tensors, projections that must be called as modules: _weights);
        the op checks the weights and the cache. None (forward's general path) where x, the backend,
        the engine or the projections do not allow it. x: (B, t, dim). Returns (B, t, dim).

        A decode step's Python runs with cold caches, so the checks are few. The op checks the shapes, dtypes, devices and positions before it
        writes anything (the keys and values, the lengths last). Where it raises, forward's own
        checks run and raise theirs where one applies (naming forward's arguments); otherwise the
        op's error is raised. The op is never called a second time: a step is not applied twice.
        A tensor subclass (a FakeTensor: the op's fake kernel checks nothing) takes the general path.
        """
        if (
            torch.is_grad_enabled()  # the general path refuses a cache that could want a gradient
            or self.backend not in ("auto", "cpp")
            or type(x) is not Tensor
            or not isinstance(cache, KVCache)
            or _tracing()  # asked before the shapes: see _few_rows_step
            or not x.is_cpu
            or x.dim() != 3
            or x.shape[2] != self.dim
            or x.shape[0] * x.shape[1] > FEW_ROWS
            or torch.is_autocast_enabled("cpu")
            or not _ops.core_loaded()
        ):
            return None
        if _inference_cache_outside_inference_mode(cache):
            return None  # _check_cache refuses it
        weights = self._weights()
        if weights is None:
            return None  # a projection to be called as a module
        try:
            # The overload itself: the packet's __call__ is one Python frame more per step.
            return torch.ops.causal_attention.decode_layer.default(x, *weights, cache.k, cache.v, cache.lengths, None,
                                                                   self.n_heads, self.n_kv_heads)
        except (RuntimeError, ValueError, TypeError) as error:
            refused = error
        # Outside the except block: forward's error, where one applies, is raised on its own.
        self._check_x(x)
        self._check_cache(cache, x, "x")
        raise refused

    def _decode_layer(self, x: Tensor, mask: Tensor | None, cache: KVCache) -> Tensor | None:
        """A decode step (x: (B, t, dim) with B * t <= FEW_ROWS) by the engine's fused decode_layer op:
        the same output, cache and lengths, bit for bit, as the qkv projection, the cached attention
        and the output projection one after the other, where both projections would take
        few_rows_matmul's engine path and the attention the engine's; None elsewhere (the caller's
        path): one op call where the path op by op makes five engine ops and a copy, each paying its
        call with the caches cold. mask: bool (B, t) or None. Returns (B, t, dim).
        """
        if not _few_rows_step(x):  # (first: it asks whether this is traced)
            return None
        # The backend first: backend="cpp" without the engine raises here, before any work.
        if backends.select_backend(x, self.backend) != "cpp":
            return None
        weights = self._weights()
        if weights is None or not _engine_streams(x, *weights):
            return None  # a projection to be called as a module, or one that would not stream on the engine
        # One op for the whole step (checks, cache write, lengths advanced): each Python op call
        # of a step runs with cold caches.
        return torch.ops.causal_attention.decode_layer.default(x, *weights, cache.k, cache.v, cache.lengths, mask,
                                                               self.n_heads, self.n_kv_heads)

    def _weights(self) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None] | None:
        """(qkv.weight, qkv.bias, proj.weight, proj.bias) where a decode step may stream both
        projections' weights instead of calling them (_linear_weights; no global forward hooks);
        None where a projection must be called. By name, through the module dict where nothing of
        a subclass or the instance stands in the way: nn.Module.parameters() walks the module tree
        and nn.Module.__getattr__ looks in three dicts, which cost more than the checks themselves
        when a step's Python runs with cold caches, as it does."""
        if _global_forward_hooks():
            return None
        attributes = self.__dict__
        if type(self) is CausalSelfAttention and "qkv" not in attributes and "proj" not in attributes:
            modules = attributes["_modules"]
            qkv, proj = _linear_weights(modules.get("qkv")), _linear_weights(modules.get("proj"))
        else:
            qkv, proj = _linear_weights(self.qkv), _linear_weights(self.proj)
        if qkv is None or proj is None:
            return None
        return qkv[0], qkv[1], proj[0], proj[1]

    def _check_cache(self, cache: KVCache, x: Tensor, x_name: str) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache; got {type(cache).__name__}")
        heads = "n_heads" if self.n_kv_heads is None else "n_kv_heads"
        if any(not isinstance(b, Tensor) or b.dim() != 4 for b in (cache.k, cache.v)):
            got = [tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__ for b in (cache.k, cache.v)]
            raise ValueError(f"cache must hold 4-D (B, {heads}, max_len, head_dim) keys and values; got {got[0]} and {got[1]}")
        expected = (x.shape[0], self.kv_heads, cache.max_len, self.head_dim)
        for name, buffer in (("keys", cache.k), ("values", cache.v)):
            if tuple(buffer.shape) != expected:
                raise ValueError(
                    f"cache must hold (B, {heads}, max_len, head_dim) = {expected} {name}; got {tuple(buffer.shape)}"
                )
            if buffer.dtype != x.dtype or buffer.device != x.device:
                raise ValueError(
                    f"cache must match {x_name}'s dtype and device ({x.dtype}, {x.device}); got {name} in "
                    f"({buffer.dtype}, {buffer.device})"
                )
        if not _tracing() and _inference_cache_outside_inference_mode(cache):
            raise ValueError(
                "the KV cache was made under torch.inference_mode(): step it under torch.inference_mode() too "
                "(or make it under torch.no_grad())"
            )
        if torch.is_grad_enabled():
            # The cache path has no backward: refuse it while anything could want a gradient.
            wanting = [x_name] if x.requires_grad else []
            wanting += [name for name, p in self.named_parameters() if p.requires_grad]
            if wanting:
                raise ValueError(
                    f"the KV cache is for inference, but {', '.join(wanting)} require(s) grad: call the layer under "
                    "torch.no_grad() or torch.inference_mode()"
                )

    def _attend_cached(self, qkv: Tensor, mask: Tensor | None, cache: KVCache) -> Tensor:
        start = cache.lengths  # (B,) tokens already in the cache
        end = backends.cache_end(start, mask, qkv.shape[1], cache.max_len)  # (B,), checked: right padding, room
        if backends.select_backend(qkv, self.backend) == "cpp":
            heads = (self.n_heads,) if self.n_kv_heads is None else (self.n_heads, self.n_kv_heads)
            torch.ops.causal_attention.kv_cache_write(qkv, cache.k, cache.v, start, end, *heads)
            y = torch.ops.causal_attention.decode_attention(qkv, cache.k, cache.v, start, end, *heads)
        else:
            y = backends.cached_attention_torch(qkv, cache, start, end, self.n_heads, self.n_kv_heads)  # (B, t, dim)
        cache.lengths.copy_(end)
        return y  # (B, t, dim)

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention, *, backend: Backend = "auto") -> CausalSelfAttention:
        """The layer holding an ``nn.MultiheadAttention``'s weights, copied exactly.

        ``in_proj_weight`` / ``in_proj_bias`` (rows q | k | v) become ``qkv``, ``out_proj`` becomes
        ``proj``; the new layer equals ``mha(x, x, x, attn_mask=causal, key_padding_mask=~mask)``
        (batch first). Configurations the layer cannot represent are errors: separate key/value
        widths (kdim, vdim), ``add_bias_kv``, ``add_zero_attn``. ``bias=False`` and the attention
        dropout probability are kept.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be an nn.MultiheadAttention; got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim:
            raise ValueError(
                f"mha: kdim={mha.kdim} / vdim={mha.vdim} differ from embed_dim={mha.embed_dim}; self-attention "
                "with one fused qkv projection needs kdim == vdim == embed_dim"
            )
        if mha.bias_k is not None or mha.bias_v is not None:
            raise ValueError("mha: add_bias_kv=True (learned extra key and value) cannot be represented by the layer")
        if mha.add_zero_attn:
            raise ValueError("mha: add_zero_attn=True (an extra zero key and value) cannot be represented by the layer")
        has_bias = mha.in_proj_bias is not None
        if has_bias != (mha.out_proj.bias is not None):
            raise ValueError("mha: in_proj_bias and out_proj.bias must both be present or both absent")
        weight = mha.in_proj_weight
        layer = cls(mha.embed_dim, mha.num_heads, backend=backend, bias=has_bias, dropout=float(mha.dropout),
                    device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.qkv.weight.copy_(weight)
            layer.proj.weight.copy_(mha.out_proj.weight)
            if has_bias:
                layer.qkv.bias.copy_(mha.in_proj_bias)
                layer.proj.bias.copy_(mha.out_proj.bias)
        return layer

    def to_multihead_attention(self) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention(dim, n_heads, batch_first=True)`` holding exact copies of the
        weights; call it as ``mha(x, x, x, attn_mask=causal, key_padding_mask=~mask)`` with
        ``causal = torch.ones(T, T, dtype=torch.bool).triu(1)`` (True = not allowed). A grouped-query
        layer (n_kv_heads) has no such twin: ValueError."""
        if self.n_kv_heads is not None and self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"to_multihead_attention: nn.MultiheadAttention has a key/value head per query head; this layer has "
                f"n_kv_heads={self.n_kv_heads} for n_heads={self.n_heads}"
            )
        weight = self.qkv.weight
        has_bias = self.qkv.bias is not None
        mha = nn.MultiheadAttention(
            self.dim, self.n_heads, dropout=self.dropout, bias=has_bias, batch_first=True, device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            mha.in_proj_weight.copy_(weight)
            mha.out_proj.weight.copy_(self.proj.weight)
            if has_bias:
                mha.in_proj_bias.copy_(self.qkv.bias)
                mha.out_proj.bias.copy_(self.proj.bias)
        return mha
