"""The engine as a transformers attention implementation.

    from causal_attention.integrations.huggingface import register
    name = register()                  # "causal_attention"
    model = LlamaForCausalLM(config)   # or any model that uses transformers' attention interface
    model.set_attn_implementation(name)      # or from_pretrained(..., attn_implementation=name)

``register`` adds two functions to transformers under one name:

- a mask function (``AttentionMaskInterface``): where the engine can serve the call (causal or
  sliding-window causal attention, a 2-D padding mask or none) it returns the key padding mask itself,
  an "engine mask": (B, 1, 1, L) uint8, 1 = a real key, L = the keys the last query sees (the past
  and the new tokens: a static cache's unfilled slots are left out), or None when there is no padding
  and every key is seen; never a materialised (B, 1, Tq, Tk) mask. It is 4-D so that transformers
  hands it on as prepared (generate prepares a static cache's masks, then the model asks again), and
  uint8 so that it is never taken for transformers' own bool masks. Everywhere else it returns what
  transformers' ``sdpa_mask`` returns.
- an attention function (``AttentionInterface``): it runs the engine's fused kernel on every call it
  can serve: prefill and training, decode steps against dynamic and static caches, grouped-query and
  multi-query heads (each key/value head read once for its group), any scale, sliding windows, logit
  softcapping and per-head attention sinks (gpt-oss's ``s_aux``). It falls back (``fallback_reasons`` says
  why) to where transformers would go: ``sdpa_attention_forward``, or the model's eager attention where
  sdpa cannot serve (softcap, sinks).

Queries, keys and values are read where transformers left them: the engine takes any layout whose
head rows are dense (a query transposed from (B, T, H, hd), a cache's (B, Hkv, max_len, hd) buffer
cut to its filled length by a view), so no call copies them. GPT-2's q, k, v, split from one c_attn
output, are read as that one buffer.

Importing this module does not import transformers; ``register`` does.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch
from torch import Tensor

from ..attention import _ops, reference
from ..attention.backends import CPP_DTYPES, unsupported_reasons

DEFAULT_NAME = "causal_attention"

# Keyword arguments of an attention call that change what attention computes and that the engine does
# not take: with any of them set (not None, not False) the call falls back. (`sinks`: a logit per query
# row, computed from the hidden states; the engine takes one per head, `s_aux`.)
_UNSERVED_KWARGS = ("position_bias", "sinks", "head_mask")
# Keyword arguments that sdpa_attention_forward does not take (it refuses softcap and ignores sinks): a
# fallback with any of them set goes to the model's eager attention.
_EAGER_KWARGS = ("softcap", "s_aux", "sinks")


def _window_of_mask_function(mask_function: Callable[..., Any]) -> tuple[bool, int | None]:
    """(served, window): whether ``mask_function`` is transformers' causal mask (window None) or its
    sliding-window causal mask (the window), the patterns the engine computes itself."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return True, None
    # sliding_window_causal_mask_function(W) = and_masks(sliding_window_overlay(W), causal_mask_function)
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask" or not mask_function.__closure__:
        return False, None
    parts = mask_function.__closure__[0].cell_contents
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function):
        return False, None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask" or not overlay.__closure__:
        return False, None
    window = overlay.__closure__[0].cell_contents
    return (True, window) if isinstance(window, int) else (False, None)


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

    transformers calls it once per forward (per layer type) with the sizes of the attention (see
    ``masking_utils.create_causal_mask``) and hands its result to every attention call. Query i sits
    at position q_offset + i, key j at kv_offset + j; ``attention_mask`` (B, >= kv_offset + kv_length)
    marks real tokens by position.

    - The engine's case (the causal or sliding-window causal pattern, ``attention_mask`` None or 2-D):
      the last query sees keys 0..L-1 with L = q_offset + q_length - kv_offset. Returns
      ``attention_mask``'s entries for those keys as an engine mask (B, 1, 1, L) uint8, or None when
      there is no padding mask and L = kv_length. A static cache's q_offset is a tensor: read in eager code; under
      torch.compile a single query's mask keeps all kv_length keys with those after the query
      marked unreal (the same attention), and more queries take sdpa's mask.
    - Anything else: exactly what ``sdpa_mask`` returns for these arguments, a
      (B, 1, q_length, kv_length) bool mask or None.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    served, _window = _window_of_mask_function(mask_function)
    if served and (attention_mask is None or attention_mask.ndim == 2):
        if not isinstance(q_offset, Tensor) or not torch.compiler.is_compiling():
            seen = int(q_offset) + q_length - kv_offset  # keys the last query sees
            if 0 < seen <= kv_length:
                if attention_mask is None:
                    if seen == kv_length:
                        return None
                    return engine_mask(torch.ones(batch_size, seen, dtype=torch.bool, device=kwargs.get("device")))
                return engine_mask(_padded(attention_mask, kv_offset + seen)[:, kv_offset:kv_offset + seen])
        elif q_length == 1:
            positions = torch.arange(kv_offset, kv_offset + kv_length, device=q_offset.device)
            seen_keys = (positions <= q_offset).expand(batch_size, kv_length)  # (B, kv_length)
            if attention_mask is None:
                return engine_mask(seen_keys)
            return engine_mask(_padded(attention_mask, kv_offset + kv_length)[:, kv_offset:kv_offset + kv_length]
                               & seen_keys)
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


# An engine mask made in eager code carries its (B, L) bool key mask under this attribute: every layer's
# attention call takes it without a tensor op (a decode step's calls run with the interpreter's memory
# evicted by the cache they just streamed, where each op costs tens of microseconds).
_KEY_MASK_ATTRIBUTE = "_causal_attention_key_mask"


def engine_mask(key_mask: Tensor) -> Tensor:
    """A (B, L) bool key mask as the mask function hands it to the attention calls: (B, 1, 1, L) uint8,
    a view of the same bytes."""
    key_mask = key_mask.contiguous()
    mask = key_mask.view(torch.uint8)[:, None, None, :]
    if not torch.compiler.is_compiling():
        setattr(mask, _KEY_MASK_ATTRIBUTE, key_mask)
    return mask


def engine_key_mask(attention_mask: Tensor | None) -> tuple[bool, Tensor | None]:
    """(is the engine's, key mask): for an engine mask (B, 1, 1, L) uint8, True and the (B, L) bool key
    mask it holds (a view); for None, True and None; for anything else (transformers' own masks),
    False and None."""
    if attention_mask is None:
        return True, None
    if not torch.compiler.is_compiling():
        key_mask = getattr(attention_mask, _KEY_MASK_ATTRIBUTE, None)
        if key_mask is not None:
            return True, key_mask
    shape = attention_mask.shape
    if len(shape) == 4 and attention_mask.dtype == torch.uint8 and shape[1] == 1 and shape[2] == 1:
        return True, attention_mask[:, 0, 0, :].view(torch.bool)
    return False, None


def _padded(attention_mask: Tensor, length: int) -> Tensor:
    """attention_mask (B, n) bool extended with False (no token) to at least length positions."""
    missing = length - attention_mask.shape[-1]
    return torch.nn.functional.pad(attention_mask, (0, missing)) if missing > 0 else attention_mask


def fused_view(query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """The (B, T, 3 * dim) buffer that query, key and value (each (B, H, T, hd)) are views of, as
    a view of its own, or None when they are not laid out as one such buffer.

    GPT-2's ``c_attn(x).split(dim, 2)`` followed by ``.view(B, T, H, hd).transpose(1, 2)`` gives
    exactly this layout: one storage, k at q's offset + dim, v at + 2 * dim, strides
    (T * 3 * dim, hd, 3 * dim, 1). The buffer is taken from ``query._base`` (the tensor the views
    were made from), so autograd carries the gradient of the engine's output straight to that
    buffer (and on to c_attn) in one piece.

    Under torch.compile it is None: Dynamo does not trace ``_base`` and storage offsets (each
    read is a graph break), so compiled graphs read q, k, v as three tensors (attention_heads).
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

    query (B, H, Tq, hd), key and value (B, Hkv, Tk, hd), attention_mask as the mask function left
    it: None, an engine mask (B, 1, 1, L) uint8 (the engine's case) or transformers' own.
    """
    return _plan(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)[0]


def _plan(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> tuple[list[str], Tensor | None]:
    """(fallback_reasons, the (B, L) bool key mask or None). A decode step's attention runs this on
    every layer right after streaming the cache, with the interpreter's own memory evicted: it keeps
    to few tensor attributes and no tensor ops where the call is served."""
    reasons = [] if query.is_cpu and query.dtype in CPP_DTYPES and _ops.core_loaded() else unsupported_reasons(
        "cpp", query)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        return reasons + [f"query, key, value must be 4-D; got {query.ndim}, {key.ndim}, {value.ndim}"], None
    B, H, Tq, hd = query.shape
    kshape = key.shape
    Hkv, Tk = kshape[1], kshape[2]
    dtype = query.dtype
    if key.dtype != dtype or value.dtype != dtype:
        reasons.append(f"mixed dtypes: query {dtype}, key {key.dtype}, value {value.dtype}")
    if not (query.is_cpu and key.is_cpu and value.is_cpu) and (key.device != query.device
                                                                or value.device != query.device):
        reasons.append(f"mixed devices: query {query.device}, key {key.device}, value {value.device}")
    if kshape[0] != B or value.shape != kshape or kshape[3] != hd:
        reasons.append(f"query {tuple(query.shape)}, key {tuple(kshape)}, value {tuple(value.shape)} do not match")
    elif Hkv == 0 or H % Hkv != 0:
        reasons.append(f"{Hkv} key/value heads do not divide {H} query heads")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        reasons.append("not causal (is_causal=False)")
    if scaling is not None and not (math.isfinite(scaling) and scaling > 0):
        reasons.append(f"scaling {scaling} is not a positive finite number")
    if kwargs:
        softcap = kwargs.get("softcap")
        if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
            reasons.append(f"softcap {softcap} is not a positive finite number")
        window = kwargs.get("sliding_window")
        if window is not None and not (isinstance(window, int) and window > 0):
            reasons.append(f"sliding_window {window!r} is not a positive int")
        for name in _UNSERVED_KWARGS:
            if kwargs.get(name) is not None and kwargs.get(name) is not False:
                reasons.append(f"{name} is set")
        s_aux = kwargs.get("s_aux")
        if s_aux is not None and not (isinstance(s_aux, Tensor) and s_aux.shape == (H,) and s_aux.is_floating_point()
                                      and s_aux.device == query.device):
            shape = tuple(s_aux.shape) if isinstance(s_aux, Tensor) else type(s_aux).__name__
            reasons.append(f"s_aux must be one floating logit per query head ({H},) on the query's device; got {shape}")
    seen = Tk
    ours, key_mask = engine_key_mask(attention_mask)
    if not ours:
        reasons.append(f"a {attention_mask.dtype} attention mask of shape {tuple(attention_mask.shape)} (transformers' "
                       "own: the mask function did not serve this pattern)")
    elif key_mask is not None:
        if key_mask.shape[0] != B or key_mask.shape[1] > Tk:
            reasons.append(f"the key mask must be (B, L) with L <= Tk = {Tk}; got {tuple(key_mask.shape)}")
        else:
            seen = key_mask.shape[1]
    if seen < Tq:
        reasons.append(f"the queries ({Tq}) do not end the {seen} keys they see")
    if dropout > 0 and seen != Tq:
        reasons.append(f"attention dropout with a past ({seen} keys, {Tq} queries)")
    return reasons, key_mask


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
) -> tuple[Tensor, Tensor | None]:
    """The attention function registered with transformers' ``AttentionInterface``.

    query (B, H, Tq, hd), key and value (B, Hkv, Tk, hd) -> ((B, Tq, H, hd), weights), the layout of
    transformers' ``sdpa_attention_forward`` (the caller joins the heads by a reshape); weights
    (B, H, Tq, Tk) with ``output_attentions``, else None. Runs the engine where
    ``fallback_reasons`` is empty; the mask's length L cuts the keys to those the queries see.
    """
    reasons, key_mask = _plan(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    if reasons:
        return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    B, H, Tq, hd = query.shape
    Tk = key.shape[2]
    seen = Tk if key_mask is None else key_mask.shape[1]
    if seen != Tk:  # views: a static cache's filled slots
        key, value = key.narrow(2, 0, seen), value.narrow(2, 0, seen)
    window = softcap = sinks = None
    if kwargs:
        window = kwargs.get("sliding_window")
        window = window if window is not None and window < seen else None  # a window holding every key is none
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")  # (H,): gpt-oss
    plain = (Tq == seen and key.shape[1] == H and window is None and softcap is None and sinks is None
             and (scaling is None or scaling == hd**-0.5))
    qkv = fused_view(query, key, value) if plain else None
    if qkv is not None:  # GPT-2: one c_attn buffer, read as it is
        out = _ops.attention(qkv, key_mask, H, dropout_p=float(dropout)).view(B, Tq, H, hd)
    else:
        out = _ops.attention_heads(query, key, value, key_mask, scale=scaling, window=window, softcap=softcap,
                                   sinks=sinks, dropout_p=float(dropout))  # (B, Tq, H, hd)
    weights = None
    if kwargs and kwargs.get("output_attentions"):  # on request only: (B, H, Tq, seen), materialised
        _, weights = reference.attention(query, key, value, key_mask=key_mask, scale=scaling, window=window,
                                         softcap=softcap, sinks=sinks, return_weights=True)
    return out, weights


def _dense_mask(attention_mask: Tensor | None, query: Tensor, key: Tensor, window: int | None) -> Tensor | None:
    """An engine mask as transformers' (B, 1, Tq, Tk) bool mask (the keys past L unseen), with the causal
    pattern and the window; transformers' own masks and None as they are."""
    ours, key_mask = engine_key_mask(attention_mask)
    if not ours or key_mask is None:
        return attention_mask
    Tq, Tk = query.shape[2], key.shape[2]
    seen = key_mask.shape[1]
    position = torch.arange(seen - Tq, seen, device=key.device)[:, None]  # (Tq, 1)
    keys = torch.arange(Tk, device=key.device)[None, :]  # (1, Tk)
    allowed = keys <= position
    if window is not None:
        allowed = allowed & (position - keys < window)
    real = torch.nn.functional.pad(key_mask, (0, max(0, Tk - seen)))[:, None, None, :Tk]  # (B, 1, 1, Tk)
    return allowed & real  # (B, 1, Tq, Tk)


def _fallback(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Where transformers itself would go: its sdpa_attention_forward, or where sdpa cannot serve the call
    (a softcap, sinks) the model's own eager attention, given the mask either would have had."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = _dense_mask(attention_mask, query, key, kwargs.get("sliding_window"))
    eager_only = [name for name in _EAGER_KWARGS if kwargs.get(name) is not None]
    if not eager_only:
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{', '.join(eager_only)} set and {type(module).__name__}'s module has no "
                         "eager_attention_forward to fall back to (sdpa cannot serve it)")
    if mask is not None and mask.dtype == torch.bool:  # eager adds its mask to the scores
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    kwargs.setdefault("scaling", module.head_dim**-0.5 if hasattr(module, "head_dim") else query.shape[-1]**-0.5)
    if kwargs["scaling"] is None:
        kwargs["scaling"] = query.shape[-1] ** -0.5
    return eager(module, query, key, value, mask, **kwargs)


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
