"""Loads the compiled engine (libcausal_attention.so), which registers torch.ops.causal_attention.*.

The engine missing (a source checkout that was never built, a platform without a build) is not an
error: the module falls back to the ``sdpa`` backend and warns once (see ``backends.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from . import reference

_LIBRARY_NAME = "libcausal_attention.so"


def _load() -> str | None:
    """Loads the compiled core; returns why it could not be loaded, or None when it is loaded."""
    path = Path(__file__).resolve().parent.parent / _LIBRARY_NAME  # installed at the package's top
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
    Forward mode is _ForwardModeAttention's (eager only: Dynamo refuses a Function with a jvp).
    """

    generate_vmap_rule = True  # forward and backward call ops with vmap rules (_register_vmap)

    @staticmethod
    def forward(  # type: ignore[override]
        qkv: Tensor, mask: Tensor | None, n_heads: int, dropout_p: float, seed: Tensor | None, n_kv_heads: int | None,
    ) -> tuple[Tensor, Tensor]:
        if n_kv_heads is None:  # the multi-head op call (as DTensor's sharding rules and traced graphs know it)
            return torch.ops.causal_attention.attention_forward(qkv, mask, n_heads, dropout_p, seed)
        return torch.ops.causal_attention.attention_forward(qkv, mask, n_heads, dropout_p, seed, n_kv_heads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        qkv, mask, n_heads, dropout_p, seed, n_kv_heads = inputs
        out, lse = output
        ctx.save_for_backward(qkv, mask, out, lse, seed)
        ctx.n_heads = n_heads
        ctx.dropout_p = dropout_p
        ctx.n_kv_heads = n_kv_heads
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qkv, mask, out, lse, seed = ctx.saved_tensors
        grad_qkv = _AttentionBackwardFunction.apply(grad_out, qkv, mask, out, lse, ctx.n_heads, ctx.dropout_p, seed,
                                                    ctx.n_kv_heads)
        return grad_qkv, None, None, None, None, None


class _AttentionBackwardFunction(torch.autograd.Function):
    """attention_backward's autograd (double backward: create_graph=True, Hessian-vector products).

    The fused backward has no derivative of its own, so this differentiates the reference, which
    materialises the (B, H, T, T) weights. out and lse are functions of qkv: their part is in d_qkv.
    With dropout, the reference uses the forward's keep decisions (dropout_keep_mask of its seed).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        grad_out: Tensor, qkv: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor, n_heads: int, dropout_p: float,
        seed: Tensor | None, n_kv_heads: int | None,
    ) -> Tensor:
        if n_kv_heads is None:
            return torch.ops.causal_attention.attention_backward(grad_out, qkv, mask, out, lse, n_heads, dropout_p,
                                                                 seed)
        return torch.ops.causal_attention.attention_backward(grad_out, qkv, mask, out, lse, n_heads, dropout_p, seed,
                                                             n_kv_heads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        grad_out, qkv, mask, _out, _lse, n_heads, dropout_p, seed, n_kv_heads = inputs
        ctx.save_for_backward(grad_out, qkv, mask, seed)
        ctx.n_heads = n_heads
        ctx.dropout_p = dropout_p
        ctx.n_kv_heads = n_kv_heads

    @staticmethod
    def backward(ctx: Any, grad_grad_qkv: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_out, qkv, mask, seed = ctx.saved_tensors
        first_grad = _reference_first_grad(qkv, mask, ctx.n_heads, ctx.dropout_p, seed, ctx.n_kv_heads)
        _, vjp2 = torch.func.vjp(first_grad, grad_out, qkv)
        d_grad_out, d_qkv = vjp2(grad_grad_qkv)
        return d_grad_out, d_qkv, None, None, None, None, None, None, None


def _reference_core(qkv: Tensor, mask: Tensor | None, n_heads: int, dropout_p: float, seed: Tensor | None,
                    n_kv_heads: int | None = None) -> Callable[[Tensor], Tensor]:
    """qkv -> the reference's attention output, with the engine's dropout decisions (those of seed)."""
    keep = None
    if dropout_p > 0:
        B, T = qkv.shape[0], qkv.shape[1]
        keep = torch.ops.causal_attention.dropout_keep_mask(seed, B, n_heads, T, dropout_p)  # (B, H, T, T)
    return lambda q: reference.attention_core(q, mask, n_heads, n_kv_heads=n_kv_heads, dropout_p=dropout_p,
                                              keep=keep)[0]


def _reference_first_grad(qkv: Tensor, mask: Tensor | None, n_heads: int, dropout_p: float, seed: Tensor | None,
                          n_kv_heads: int | None = None) -> Callable[[Tensor, Tensor], Tensor]:
    """(grad_out, qkv) -> the reference's gradient of qkv: what attention_backward computes, differentiable."""
    core = _reference_core(qkv, mask, n_heads, dropout_p, seed, n_kv_heads)

    def first_grad(go: Tensor, q: Tensor) -> Tensor:
        _, vjp = torch.func.vjp(core, q)
        return vjp(go)[0]

    return first_grad


class _ForwardModeAttentionBackward(_AttentionBackwardFunction):
    """_AttentionBackwardFunction with forward mode (hessian = jacfwd(jacrev)): the reference's."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _AttentionBackwardFunction.setup_context(ctx, inputs, output)
        grad_out, qkv, mask, _out, _lse, _n_heads, _dropout_p, seed, _n_kv_heads = inputs
        ctx.save_for_forward(grad_out, qkv, mask, seed)

    @staticmethod
    def jvp(ctx: Any, grad_out_t: Tensor | None, qkv_t: Tensor | None, *_: Any) -> Tensor | None:  # type: ignore[override]
        grad_out, qkv, mask, seed = ctx.saved_tensors  # out and lse are functions of qkv: their part is in qkv's
        if grad_out_t is None and qkv_t is None:
            return None
        first_grad = _reference_first_grad(qkv, mask, ctx.n_heads, ctx.dropout_p, seed, ctx.n_kv_heads)
        tangents = (torch.zeros_like(grad_out) if grad_out_t is None else grad_out_t,
                    torch.zeros_like(qkv) if qkv_t is None else qkv_t)
        return torch.func.jvp(first_grad, (grad_out, qkv), tangents)[1]


class _ForwardModeAttention(_AttentionFunction):
    """_AttentionFunction with forward mode (jvp, jacfwd, hessian), which differentiates the reference
    (it materialises the (B, H, T, T) weights, as the double backward does). Used in eager code only:
    Dynamo does not trace a Function that defines jvp (torch.compile and torch.export take the parent)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        _AttentionFunction.setup_context(ctx, inputs, output)
        qkv, mask, _n_heads, _dropout_p, seed, _n_kv_heads = inputs
        ctx.save_for_forward(qkv, mask, seed)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qkv, mask, out, lse, seed = ctx.saved_tensors
        grad_qkv = _ForwardModeAttentionBackward.apply(grad_out, qkv, mask, out, lse, ctx.n_heads, ctx.dropout_p,
                                                       seed, ctx.n_kv_heads)
        return grad_qkv, None, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, qkv_t: Tensor | None, *_: Any) -> tuple[Tensor | None, None]:  # type: ignore[override]
        qkv, mask, seed = ctx.saved_tensors
        if qkv_t is None:
            return None, None
        core = _reference_core(qkv, mask, ctx.n_heads, ctx.dropout_p, seed, ctx.n_kv_heads)
        return torch.func.jvp(core, (qkv,), (qkv_t,))[1], None


def draw_seed() -> Tensor:
    """A dropout seed: a 0-d int64 tensor from torch's default CPU generator (torch.manual_seed
    reproduces it; torch.compile traces it as graph randomness)."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)


def attention(
    qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int, dropout_p: float = 0.0, seed: Tensor | None = None,
    *, n_kv_heads: int | None = None,
) -> Tensor:
    """The fused attention core with autograd (torch.func-compatible): qkv (B, T, 3 * dim),
    key_padding_mask (B, T) bool or None -> (B, T, dim).

    dropout_p in [0, 1): attention-weight dropout (P_drop = P * keep / (1 - p)), the keep decisions
    a pure function of seed (a 0-d int64 CPU tensor; drawn with draw_seed() when None) and the
    weight's (b, h, i, j): torch.ops.causal_attention.dropout_keep_mask gives them.

    n_kv_heads: grouped-query attention, qkv (B, T, (n_heads + 2 * n_kv_heads) * hd) split q | k | v,
    query head h reading key/value head h // (n_heads / n_kv_heads) -> (B, T, n_heads * hd).
    """
    if dropout_p > 0 and seed is None:
        seed = draw_seed()
    function = _AttentionFunction if torch.compiler.is_compiling() else _ForwardModeAttention
    out, _lse = function.apply(qkv, key_padding_mask, n_heads, dropout_p, seed if dropout_p > 0 else None, n_kv_heads)
    return out


class _HeadsFunction(torch.autograd.Function):
    """attention_heads_forward's autograd: the fused backward (attention_heads_backward) from the saved lse,
    the sinks' gradient from out and lse. A double backward differentiates the reference
    (_HeadsBackwardFunction)."""

    @staticmethod
    def forward(  # type: ignore[override]
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None, window: int | None,
        softcap: float | None, dropout_p: float, seed: Tensor | None, sinks: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        return torch.ops.causal_attention.attention_heads_forward(q, k, v, mask, scale, window, softcap, dropout_p,
                                                                  seed, sinks)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, mask, scale, window, softcap, dropout_p, seed, sinks = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, mask, out, lse, seed, sinks)
        ctx.options = (scale, window, softcap, dropout_p)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, mask, out, lse, seed, sinks = ctx.saved_tensors
        grads = _HeadsBackwardFunction.apply(grad_out, q, k, v, mask, out, lse, *ctx.options, seed, sinks)
        d_sinks = grads[3] if sinks is not None else None
        return *grads[:3], None, None, None, None, None, None, d_sinks


def _reference_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None, scale: float | None,
                     window: int | None, softcap: float | None, dropout_p: float, seed: Tensor | None) -> Tensor:
    """reference.attention in the op's layout (B, Tq, H, hd), with the engine's dropout decisions."""
    keep = None
    if dropout_p > 0:
        B, H, T = q.shape[0], q.shape[1], q.shape[2]
        keep = torch.ops.causal_attention.dropout_keep_mask(seed, B, H, T, dropout_p)  # (B, H, T, T)
    y, _ = reference.attention(q, k, v, key_mask=mask, scale=scale, window=window, softcap=softcap, sinks=sinks,
                               dropout_p=dropout_p, keep=keep)
    return y.transpose(1, 2)


class _HeadsBackwardFunction(torch.autograd.Function):
    """attention_heads_backward's autograd: (dq, dk, dv) from the fused backward (sinks, where given, are in
    out and lse), then the sinks' gradient from attention_sinks_backward; a double backward differentiates
    the reference."""

    @staticmethod
    def forward(  # type: ignore[override]
        grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
        scale: float | None, window: int | None, softcap: float | None, dropout_p: float, seed: Tensor | None,
        sinks: Tensor | None,
    ) -> tuple[Tensor, ...]:
        grads = torch.ops.causal_attention.attention_heads_backward(grad_out, q, k, v, mask, out, lse, scale, window,
                                                                    softcap, dropout_p, seed)
        if sinks is None:
            return grads
        return *grads, torch.ops.causal_attention.attention_sinks_backward(grad_out, out, lse, sinks)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        grad_out, q, k, v, mask, _out, _lse, scale, window, softcap, dropout_p, seed, sinks = inputs
        ctx.save_for_backward(grad_out, q, k, v, mask, seed, sinks)
        ctx.options = (scale, window, softcap, dropout_p)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_out, q, k, v, mask, seed, sinks = ctx.saved_tensors
        with_sinks = () if sinks is None else (sinks,)

        def first_grad(go: Tensor, *inputs: Tensor) -> tuple[Tensor, ...]:
            def reference(q_: Tensor, k_: Tensor, v_: Tensor, *sinks_: Tensor) -> Tensor:
                return _reference_heads(q_, k_, v_, mask, sinks_[0] if sinks_ else None, *ctx.options, seed)

            _, vjp = torch.func.vjp(reference, *inputs)
            return vjp(go)

        _, vjp2 = torch.func.vjp(first_grad, grad_out, q, k, v, *with_sinks)
        d_grad_out, dq, dk, dv, *d_sinks = vjp2(grads)
        return d_grad_out, dq, dk, dv, None, None, None, None, None, None, None, None, *(d_sinks or [None])


def attention_heads(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None = None, *, scale: float | None = None,
    window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None, dropout_p: float = 0.0,
    seed: Tensor | None = None,
) -> Tensor:
    """The fused attention over separate heads, with autograd: transformers' attention call.

    q (B, H, Tq, hd), k and v (B, Hkv, Tk, hd) (Hkv dividing H, Tq <= Tk: query i at key position
    Tk - Tq + i), key_mask (B, Tk) bool (True = a real key) or None -> (B, Tq, H, hd). scale (default
    1 / sqrt(hd)), window (keys per query, its own included), softcap and sinks (H,) (one logit per
    query head in every row's softmax, differentiable) as reference.attention. dropout_p needs Tq = Tk;
    its keep decisions are those of attention() (seed drawn when None).
    """
    if dropout_p > 0 and seed is None:
        seed = draw_seed()
    seed = seed if dropout_p > 0 else None
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad or (sinks is not None and sinks.requires_grad))):
        # Nothing to differentiate (generate's decode steps): the op alone, without autograd.Function's
        # bookkeeping (0.1 ms a call, as much as a short decode step's attention), by its overload (the
        # packet's resolution costs as much again right after a step streamed the cache).
        return torch.ops.causal_attention.attention_heads_forward.default(q, k, v, key_mask, scale, window, softcap,
                                                                          dropout_p, seed, sinks)[0]
    out, _lse = _HeadsFunction.apply(q, k, v, key_mask, scale, window, softcap, dropout_p, seed, sinks)
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


def _slice(xs: tuple[Tensor | None, ...], dims: tuple[Any, ...], n: int) -> list[Tensor | None]:
    """Slice n of each vmapped argument (an argument without a vmap dimension as it is)."""
    return [x.select(d, n) if (x is not None and d is not None) else x for x, d in zip(xs, dims)]


def _register_vmap() -> None:
    """torch.vmap over the attention ops: the vmapped dimension joins the batch dimension B."""

    # With dropout the keep decisions depend on the batch index b, which folding would change: each
    # vmapped slice runs on its own (its seed too, when the seed is batched: randomness="different").

    def forward_vmap(  # type: ignore[no-untyped-def]
        info: Any, in_dims: tuple[Any, ...], qkv: Tensor, mask: Tensor | None, n_heads: int, dropout_p: float = 0.0,
        seed: Tensor | None = None, n_kv_heads: int | None = None,
    ):
        N = info.batch_size
        if dropout_p > 0:
            slices = [
                torch.ops.causal_attention.attention_forward(
                    *_slice((qkv, mask), in_dims[:2], n), n_heads, dropout_p, *_slice((seed,), in_dims[4:5], n),
                    *(() if n_kv_heads is None else (n_kv_heads,)),
                )
                for n in range(N)
            ]
            return (torch.stack([o for o, _ in slices]), torch.stack([lse for _, lse in slices])), (0, 0)
        B = _batch_first(qkv, in_dims[0], N).shape[1]
        heads = (n_heads,) if n_kv_heads is None else (n_heads, 0.0, None, n_kv_heads)
        out, lse = torch.ops.causal_attention.attention_forward(_fold(qkv, in_dims[0], N), _fold(mask, in_dims[1], N),
                                                                *heads)
        return (out.unflatten(0, (N, B)), lse.unflatten(0, (N, B))), (0, 0)

    def backward_vmap(  # type: ignore[no-untyped-def]
        info: Any, in_dims: tuple[Any, ...], grad_out: Tensor, qkv: Tensor, mask: Tensor | None, out: Tensor,
        lse: Tensor, n_heads: int, dropout_p: float = 0.0, seed: Tensor | None = None, n_kv_heads: int | None = None,
    ):
        N = info.batch_size
        if dropout_p > 0:
            grads = [
                torch.ops.causal_attention.attention_backward(
                    *_slice((grad_out, qkv, mask, out, lse), in_dims[:5], n), n_heads, dropout_p,
                    *_slice((seed,), in_dims[7:8], n), *(() if n_kv_heads is None else (n_kv_heads,)),
                )
                for n in range(N)
            ]
            return torch.stack(grads), 0
        B = _batch_first(qkv, in_dims[1], N).shape[1]
        heads = (n_heads,) if n_kv_heads is None else (n_heads, 0.0, None, n_kv_heads)
        grad_qkv = torch.ops.causal_attention.attention_backward(
            _fold(grad_out, in_dims[0], N), _fold(qkv, in_dims[1], N), _fold(mask, in_dims[2], N),
            _fold(out, in_dims[3], N), _fold(lse, in_dims[4], N), *heads,
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
