"""ONNX translations of the engine's ops, for exporting a ``torch.export`` program to ONNX.

``torch.onnx.export(model, args, dynamo=True)`` of the layer or the GPT needs nothing from here:
while the exporter traces a module, the layer writes its attention in plain torch
(backends.onnx_exporting). A program that was already exported with ``torch.export`` holds the
engine's ops themselves; pass their translations:

    ep = torch.export.export(model, (tokens, mask))
    torch.onnx.export(ep, dynamo=True, custom_translation_table=causal_attention.integrations.onnx_export.translation_table())

The translations are standard ONNX (opset 18 primitives, ``onnxscript`` is the exporter's own
dependency), with the op's contract: causal, key padding mask True = real, a query row with no
allowed key gives 0.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..attention import _ops


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """``{torch.ops.causal_attention.<op>.default: onnxscript translation}`` for the ops a forward
    program holds: ``attention_forward`` (out and lse) and ``mask_to_bool``; for
    ``torch.onnx.export(..., custom_translation_table=...)``. Needs the engine loaded."""
    if not _ops.core_loaded():
        raise RuntimeError(f"causal_attention.integrations.onnx_export: the compiled engine is not loaded ({_ops.load_error()})")
    from onnxscript import opset18 as op  # the exporter's own dependency, imported only here

    def ints(*values: int) -> Any:
        return op.Constant(value_ints=list(values))

    def attention_forward(qkv: Any, key_padding_mask: Any = None, n_heads: int = 1, dropout_p: float = 0.0,
                          seed: Any = None) -> tuple[Any, Any]:
        """qkv (B, T, 3 * dim), key_padding_mask (B, T) bool or None -> out (B, T, dim), lse (B, H, T)."""
        if dropout_p != 0.0:
            raise ValueError(f"causal_attention.integrations.onnx_export: attention dropout (dropout_p={dropout_p}) cannot be exported; "
                             "export the model in eval mode")
        width = qkv.shape[2]
        if not isinstance(width, int):
            raise ValueError(f"causal_attention.integrations.onnx_export: qkv's last dimension must be static; got {width}")
        head_dim = width // 3 // n_heads
        heads = op.Reshape(qkv, ints(0, 0, 3, n_heads, head_dim))  # (B, T, 3, H, hd)
        q = op.Transpose(op.Gather(heads, op.Constant(value_int=0), axis=2), perm=[0, 2, 1, 3])  # (B, H, T, hd)
        k_t = op.Transpose(op.Gather(heads, op.Constant(value_int=1), axis=2), perm=[0, 2, 3, 1])  # (B, H, hd, T)
        v = op.Transpose(op.Gather(heads, op.Constant(value_int=2), axis=2), perm=[0, 2, 1, 3])  # (B, H, T, hd)
        scale = op.CastLike(op.Constant(value_float=1.0 / math.sqrt(head_dim)), qkv)
        scores = op.Mul(op.MatMul(q, k_t), scale)  # (B, H, T, T)
        T = op.Squeeze(op.Shape(qkv, start=1, end=2))  # scalar
        pos = op.Range(op.Constant(value_int=0), T, op.Constant(value_int=1))  # (T,)
        allowed = op.LessOrEqual(op.Unsqueeze(pos, ints(0)), op.Unsqueeze(pos, ints(1)))  # (T, T): key j <= query i
        if key_padding_mask is not None:
            allowed = op.And(allowed, op.Unsqueeze(key_padding_mask, ints(1, 2)))  # (B, 1, T, T)
        has_key = op.Cast(op.ReduceMax(op.Cast(allowed, to=1), ints(-1), keepdims=1), to=9)  # (.., T, 1) bool
        first = op.Equal(op.Unsqueeze(pos, ints(0)), op.Constant(value_int=0))  # (1, T): key 0
        allowed = op.Or(allowed, op.And(op.Not(has_key), first))  # an empty row sees key 0, zeroed below
        minus_inf = op.CastLike(op.Constant(value_float=-math.inf), qkv)
        masked = op.Where(allowed, scores, minus_inf)
        lse = op.ReduceLogSumExp(masked, ints(-1), keepdims=0)  # (B, H, T)
        out = op.MatMul(op.Softmax(masked, axis=-1), v)  # (B, H, T, hd)
        out = op.Where(has_key, out, op.CastLike(op.Constant(value_float=0.0), qkv))
        return op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), ints(0, 0, -1)), lse  # (B, T, dim)

    def mask_to_bool(key_padding_mask: Any) -> Any:
        """An integer 0/1 mask (B, T) -> bool (the value check is an assertion, which ONNX drops)."""
        return op.Not(op.Equal(key_padding_mask, op.CastLike(op.Constant(value_int=0), key_padding_mask)))

    return {
        torch.ops.causal_attention.attention_forward.default: attention_forward,
        torch.ops.causal_attention.mask_to_bool.default: mask_to_bool,
    }
