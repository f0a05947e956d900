"""The engine as a transformers attention implementation.

    from causal_attention.integrations.huggingface import register
    name = register()                  # "causal_attention"
    model = GPT2LMHeadModel(config)    # or any model that uses transformers' attention interface
    model.set_attn_implementation(name)      # or from_pretrained(..., attn_implementation=name)

``register`` adds two functions to transformers under one name:

- a mask function (``AttentionMaskInterface``): where the engine can serve the call (no past
  cache, plain causal attention, mask as long as the input) it hands on the (B, T) key padding
  mask itself (bool, True = real token) or None, never a materialised (B, 1, T, T) mask;
  everywhere else it returns exactly what transformers' ``sdpa_mask`` returns.
- an attention function (``AttentionInterface``): it runs the engine's fused core when it can and
  transformers' own ``sdpa_attention_forward`` (with the mask sdpa would have had) otherwise;
  ``fallback_reasons`` says why a call falls back.

GPT-2 makes q, k and v by splitting one ``c_attn`` output (B, T, 3 * dim): they arrive as strided
views of one buffer, and the engine reads that buffer as it is (no copy). Separate projections
(Llama's q_proj, k_proj, v_proj, or keys returned by a cache) are joined with one copy.

Importing this module does not import transformers; ``register`` does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..attention import _ops
from ..attention.backends import unsupported_reasons

DEFAULT_NAME = "causal_attention"

# Keyword arguments of an attention call that change what attention computes: with any of them set
# (not None, not False) the call falls back to sdpa (which raises or handles them as it does).
_UNSERVED_KWARGS = ("softcap", "sliding_window", "position_bias", "s_aux", "sinks", "head_mask", "output_attentions")


def key_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """The mask function registered with transformers' ``AttentionMaskInterface``.

    transformers calls it once per forward with the sizes of the attention (see
    ``masking_utils.create_causal_mask``) and hands its result to every attention call.

    - The engine's case: no past (``q_offset == kv_offset == 0``), ``q_length == kv_length`` = T,
      the plain causal pattern (``mask_function`` is ``causal_mask_function``: no packed
      sequences, no sliding window, no overlay) and ``attention_mask`` None or (B, T). Returns
      that (B, T) bool mask (True = real token; transformers has already made it bool) or None.
    - Anything else: exactly what ``sdpa_mask`` returns for these arguments, a
      (B, 1, q_length, kv_length) bool mask or None (then sdpa's ``is_causal`` serves).
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    plain_causal = (
        mask_function is causal_mask_function
        and isinstance(q_offset, int)
        and q_offset == 0
        and kv_offset == 0
        and q_length == kv_length
        and (attention_mask is None or (attention_mask.ndim == 2 and attention_mask.shape == (batch_size, kv_length)))
    )
    if plain_causal:
        return attention_mask
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def fused_view(query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """The (B, T, 3 * dim) buffer that query, key and value (each (B, H, T, hd)) are views of, as
    a view of its own, or None when they are not laid out as one such buffer.

    GPT-2's ``c_attn(x).split(dim, 2)`` followed by ``.view(B, T, H, hd).transpose(1, 2)`` gives
    exactly this layout: one storage, k at q's offset + dim, v at + 2 * dim, strides
    (T * 3 * dim, hd, 3 * dim, 1). The buffer is taken from ``query._base`` (the tensor the views
    were made from), so autograd carries the gradient of the engine's output straight to that
    buffer (and on to c_attn) in one piece.

    Under torch.compile it is None: Dynamo does not trace ``_base`` and storage offsets (each
    read is a graph break), so compiled graphs take the copy of ``joined_qkv``.
    """
    if torch.compiler.is_compiling():
        return None
    B, H, T, hd = query.shape
    dim = H * hd
    base = query._base
    if base is None or key._base is not base or value._base is not base:
        return None
    expected_strides = (T * 3 * dim, hd, 3 * dim, 1)
    if not (query.stride() == key.stride() == value.stride() == expected_strides):
        return None
    start = base.storage_offset()
    if not (
        base.is_contiguous()
        and base.numel() == B * T * 3 * dim
        and query.storage_offset() == start
        and key.storage_offset() == start + dim
        and value.storage_offset() == start + 2 * dim
    ):
        return None
    return base.view(B, T, 3 * dim)  # (B, T, 3 * dim): [q | k | v] per token, heads inside each


def joined_qkv(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """query, key, value (each (B, H, T, hd)) joined into (B, T, 3 * dim) with one copy."""
    B, H, T, hd = query.shape
    qkv = torch.stack([t.transpose(1, 2) for t in (query, key, value)], dim=2)  # (B, T, 3, H, hd)
    return qkv.view(B, T, 3 * H * hd)


def fallback_reasons(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> list[str]:
    """Why the engine cannot serve this attention call (empty when it can).

    query (B, H, Tq, hd), key and value (B, Hkv, Tk, hd), attention_mask as the mask function
    left it: None, (B, T) bool (the engine's case) or (B, 1, Tq, Tk) (transformers' own).
    """
    reasons = unsupported_reasons("cpp", query)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return reasons + [f"query, key, value must be 4-D; got {query.ndim}, {key.ndim}, {value.ndim}"]
    B, H, Tq, hd = query.shape
    if key.dtype != query.dtype or value.dtype != query.dtype:
        reasons.append(f"mixed dtypes: query {query.dtype}, key {key.dtype}, value {value.dtype}")
    if key.shape[1] != H or value.shape[1] != H:
        reasons.append(f"grouped-query attention: {H} query heads, {key.shape[1]} key/value heads")
    if key.shape[2] != Tq:
        reasons.append(f"query length {Tq} != key length {key.shape[2]} (decoding against a past cache)")
    if key.shape[0] != B or value.shape[0] != B or value.shape[2] != key.shape[2]:
        reasons.append(f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not match")
    if key.shape[3] != hd or value.shape[3] != hd:
        reasons.append(f"head sizes differ: query {hd}, key {key.shape[3]}, value {value.shape[3]}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        reasons.append("not causal (is_causal=False)")
    if scaling is not None and not math.isclose(scaling, hd**-0.5, rel_tol=1e-12):
        reasons.append(f"scaling {scaling} is not 1/sqrt(head_dim) = {hd**-0.5}")
    for name in _UNSERVED_KWARGS:
        if kwargs.get(name) not in (None, False):
            reasons.append(f"{name} is set")
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            reasons.append(f"a {attention_mask.ndim}-D attention mask (only a (B, T) key padding mask is served)")
        elif attention_mask.dtype != torch.bool or attention_mask.shape != (B, Tq):
            reasons.append(
                f"a 2-D attention mask must be bool (B, T) = {(B, Tq)}; got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )
    return reasons


def causal_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention function registered with transformers' ``AttentionInterface``.

    query (B, H, Tq, hd), key and value (B, Hkv, Tk, hd) -> ((B, Tq, H, hd), None), the layout of
    transformers' ``sdpa_attention_forward`` (the caller joins the heads by a reshape); no weights.
    Runs the engine where ``fallback_reasons`` is empty, else ``sdpa_attention_forward``.
    """
    reasons = fallback_reasons(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )
    if reasons:
        return _sdpa_fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)
    B, H, T, hd = query.shape
    qkv = fused_view(query, key, value)
    if qkv is None:
        qkv = joined_qkv(query, key, value)  # (B, T, 3 * dim), one copy
    # Attention dropout in the fused kernel (transformers passes dropout=0.0 in eval mode).
    out = _ops.attention(qkv, attention_mask, H, dropout_p=float(dropout))  # (B, T, dim)
    return out.view(B, T, H, hd), None  # (B, T, H, hd): heads as the engine wrote them, no copy


def _sdpa_fallback(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' sdpa_attention_forward, given the mask sdpa_mask would have made."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    if attention_mask is not None and attention_mask.ndim == 2:
        # Our mask function's (B, T) key padding mask: q_offset = kv_offset = 0 and Tq = Tk = T.
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask: a 2-D mask must be a bool key padding mask (True = real token); got {attention_mask.dtype}"
            )
        B, T = attention_mask.shape
        attention_mask = sdpa_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=attention_mask,
                                   device=attention_mask.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register(name: str = DEFAULT_NAME) -> str:
    """Registers the engine with transformers as attention implementation ``name`` (the attention
    function and its mask function, under the same name) and returns the name.

    Then ``Model.from_pretrained(..., attn_implementation=name)``,
    ``Model._from_config(config, attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` use it. Idempotent.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str; got {name!r}")
    if "sdpa" in name or "flash" in name or "flex" in name or name == "eager" or name.startswith("paged"):
        raise ValueError(f"name {name!r} would be taken for one of transformers' own implementations; choose another")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, causal_attention_forward)
    AttentionMaskInterface.register(name, key_padding_mask)
    return name
