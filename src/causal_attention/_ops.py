"""Loads the compiled engine (libcausal_attention.so), which registers torch.ops.causal_attention.*.

The engine missing (a source checkout that was never built, a platform without a build) is not an
error: the module falls back to the ``sdpa`` backend and warns once (see ``backends.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import reference

_LIBRARY_NAME = "libcausal_attention.so"


def _load() -> str | None:
    """Loads the compiled core; returns why it could not be loaded, or None when it is loaded."""
    path = Path(__file__).with_name(_LIBRARY_NAME)
    if not path.exists():
        return f"{path} does not exist (build the package: make install)"
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:  # a broken or mismatched build
        return f"loading {path} failed: {exc}"
    _register_vmap()
    return None


# The library registers Meta kernels (shapes only) for every op itself (csrc/ops.cpp), so that
# torch.compile and torch.export trace them without this module. Python adds the rest: autograd
# as torch.autograd.Functions with setup_context (torch.func transforms work with those, not with
# an op's C++ or Python Autograd kernel) and vmap rules for the ops.


class _AttentionFunction(torch.autograd.Function):
    """attention_forward's autograd: the fused backward (attention_backward) from the saved lse.

    A torch.autograd.Function with setup_context and a generated vmap rule, so that torch.func
    transforms (grad, vjp, jacrev, vmap) compose with it (an op's own Autograd kernel would not).
    """

    generate_vmap_rule = True  # forward and backward call ops with vmap rules (_register_vmap)

    @staticmethod
    def forward(qkv: Tensor, mask: Tensor | None, n_heads: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        return torch.ops.causal_attention.attention_forward(qkv, mask, n_heads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        qkv, mask, n_heads = inputs
        out, lse = output
        ctx.save_for_backward(qkv, mask, out, lse)
        ctx.n_heads = n_heads
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor, None, None]:  # type: ignore[override]
        qkv, mask, out, lse = ctx.saved_tensors
        return _AttentionBackwardFunction.apply(grad_out, qkv, mask, out, lse, ctx.n_heads), None, None


class _AttentionBackwardFunction(torch.autograd.Function):
    """attention_backward's autograd (double backward: create_graph=True, Hessian-vector products).

    The fused backward has no derivative of its own, so this differentiates the reference, which
    materialises the (B, H, T, T) weights. out and lse are functions of qkv: their part is in d_qkv.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(grad_out: Tensor, qkv: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor, n_heads: int) -> Tensor:  # type: ignore[override]
        return torch.ops.causal_attention.attention_backward(grad_out, qkv, mask, out, lse, n_heads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        grad_out, qkv, mask, _out, _lse, n_heads = inputs
        ctx.save_for_backward(grad_out, qkv, mask)
        ctx.n_heads = n_heads

    @staticmethod
    def backward(ctx: Any, grad_grad_qkv: Tensor) -> tuple[Tensor, Tensor, None, None, None, None]:  # type: ignore[override]
        grad_out, qkv, mask = ctx.saved_tensors
        n_heads = ctx.n_heads

        def first_grad(go: Tensor, q: Tensor) -> Tensor:
            _, vjp = torch.func.vjp(lambda q_: reference.attention_core(q_, mask, n_heads)[0], q)
            return vjp(go)[0]

        _, vjp2 = torch.func.vjp(first_grad, grad_out, qkv)
        d_grad_out, d_qkv = vjp2(grad_grad_qkv)
        return d_grad_out, d_qkv, None, None, None, None


def attention(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int) -> Tensor:
    """The fused attention core with autograd (torch.func-compatible): qkv (B, T, 3 * dim),
    key_padding_mask (B, T) bool or None -> (B, T, dim)."""
    out, _lse = _AttentionFunction.apply(qkv, key_padding_mask, n_heads)
    return out


def _batch_first(x: Tensor, dim: int | None, size: int) -> Tensor:
    """x with its vmap dimension moved to the front (expanded there when x is not batched)."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _fold(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """(N, B, ...) with the vmap dimension first -> (N * B, ...): the vmap batch joins the op's own."""
    if x is None:
        return None
    x = _batch_first(x, dim, size)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _register_vmap() -> None:
    """torch.vmap over the attention ops: the vmapped dimension joins the batch dimension B."""

    def forward_vmap(info: Any, in_dims: tuple[Any, ...], qkv: Tensor, mask: Tensor | None, n_heads: int):  # type: ignore[no-untyped-def]
        N = info.batch_size
        B = _batch_first(qkv, in_dims[0], N).shape[1]
        out, lse = torch.ops.causal_attention.attention_forward(
            _fold(qkv, in_dims[0], N), _fold(mask, in_dims[1], N), n_heads
        )
        return (out.unflatten(0, (N, B)), lse.unflatten(0, (N, B))), (0, 0)

    def backward_vmap(  # type: ignore[no-untyped-def]
        info: Any, in_dims: tuple[Any, ...], grad_out: Tensor, qkv: Tensor, mask: Tensor | None, out: Tensor,
        lse: Tensor, n_heads: int,
    ):
        N = info.batch_size
        B = _batch_first(qkv, in_dims[1], N).shape[1]
        grad_qkv = torch.ops.causal_attention.attention_backward(
            _fold(grad_out, in_dims[0], N), _fold(qkv, in_dims[1], N), _fold(mask, in_dims[2], N),
            _fold(out, in_dims[3], N), _fold(lse, in_dims[4], N), n_heads,
        )
        return grad_qkv.unflatten(0, (N, B)), 0

    torch.library.register_vmap("causal_attention::attention_forward", forward_vmap)
    torch.library.register_vmap("causal_attention::attention_backward", backward_vmap)


_LOAD_ERROR: str | None = _load()  # once, at import: never in the middle of a traced call


def load_error() -> str | None:
    """Why the compiled engine could not be loaded, or None when it is loaded."""
    return _LOAD_ERROR


def core_loaded() -> bool:
    """True when the compiled C++ engine is loaded and its ops are registered."""
    return load_error() is None
