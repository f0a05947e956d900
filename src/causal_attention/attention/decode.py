"""The projections' fast paths: a decode step of few rows streams each weight once instead of
calling BLAS; half precision on a CPU without half arithmetic sums in float32 at float32's speed;
float32 without a gradient goes to oneDNN's inner product, which MKL's sgemm trails on AMD CPUs.

    y = few_rows_linear(layer, x)   # x (..., in): layer(x), streamed when x is a decode step's rows
    y = project(layer, x)           # layer(x), widened where the CPU has no arithmetic in x's dtype
    y = unrounded_matmul(x, w)      # x @ w^T in float32 for half x (a half model's logits)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import forward_ad as _forward_ad
from torch.nn.modules import module as _torch_module

from . import _ops


# Below this many rows (a decode step), a Linear streams its weight: the engine's few_rows_linear
# reads it once at close to copy bandwidth, where BLAS reaches a fraction of that at so few rows;
# without the engine, W x^T, which BLAS streams faster than x W^T.
FEW_ROWS = 8


def _few_rows_step(x: Tensor) -> bool:
    """Whether a product of x's rows (x (..., in)) is a decode step's: not traced, no gradient
    wanted, few rows (few_rows_matmul's and the fused decode step's first condition). Tracing is
    asked first: under torch.compile with dynamic shapes, comparing the row count with FEW_ROWS
    guards on it, and a compiled GPT recompiled whenever B * T crossed it."""
    if _tracing() or torch.is_grad_enabled():
        return False
    return x.numel() // max(1, x.shape[-1]) <= FEW_ROWS


def _engine_streams(x: Tensor, *weights: Tensor | None) -> bool:
    """Whether the engine's weight-streaming kernel takes x against these weights (None: a layer
    without bias): x and every weight on the CPU in x's dtype, no CPU autocast, the engine loaded.
    few_rows_matmul and the fused decode step share it, so that the fused step runs exactly where
    its projections would stream (and gives their bits)."""
    present = [w for w in weights if w is not None]
    return (
        x.device.type == "cpu"
        and all(w.dtype == x.dtype and w.device.type == "cpu" for w in present)
        and not torch.is_autocast_enabled("cpu")
        and _ops.core_loaded()
    )


def few_rows_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """x (..., in) @ weight^T (+ bias) -> (..., out) by a weight-streaming product, when x has few
    rows and no gradient is wanted (inference: a decode step); None otherwise (the caller's usual
    path)."""
    if not _few_rows_step(x):
        return None
    return _streamed_product(x, weight, bias)


def _streamed_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """few_rows_matmul's product, once its step is checked: the engine's few_rows_linear where it
    streams these weights, W x^T by BLAS otherwise."""
    if _engine_streams(x, weight, bias):
        return torch.ops.causal_attention.few_rows_linear.default(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])  # (rows, in)
    y = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())  # (out, rows)
    return y.t().reshape(*x.shape[:-1], weight.shape[0])


def few_rows_linear(layer: nn.Module, x: Tensor) -> Tensor:
    """layer(x) (x: (..., in) -> (..., out)), by the weight-streaming product of few_rows_matmul
    where x is a decode step's few rows and calling the layer would compute only its weight product
    (_linear_weights); otherwise as project(layer, x)."""
    if not _few_rows_step(x) or _global_forward_hooks():
        return project(layer, x)
    weights = _linear_weights(layer)
    if weights is None:
        return layer(x)
    return _streamed_product(x, *weights)


_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _half_arithmetic(dtype: torch.dtype) -> bool:
    return bool(torch.ops.causal_attention.half_arithmetic(dtype))


def widens(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether widened_matmul takes x against these weights: x, weight and bias plain CPU tensors of
    one half dtype this CPU has no arithmetic for (ATen's GEMMs there run at a quarter of float32's
    speed; the engine's read the half values as they are, sum in float32 and round once), in eager
    mode outside torch.func transforms and CPU autocast. Under torch.compile and torch.export the
    graph keeps ATen's product."""
    return not (
        x.dtype not in _HALF
        or type(x) is not Tensor
        or x.device.type != "cpu"
        or type(weight) not in (Tensor, nn.Parameter)
        or weight.dtype != x.dtype
        or weight.device.type != "cpu"
        or (bias is not None and (type(bias) not in (Tensor, nn.Parameter) or bias.dtype != x.dtype
                                  or bias.device.type != "cpu"))
        or _tracing()
        or torch._C._are_functorch_transforms_active()
        or torch.is_autocast_enabled("cpu")
        or not _ops.core_loaded()
        or _half_arithmetic(x.dtype)
    )


def widened_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """x (..., in) @ weight^T (+ bias) -> (..., out) by the engine's project op (differentiable) where
    it widens (widens); None otherwise (the caller's usual path)."""
    return torch.ops.causal_attention.project(x, weight, bias) if widens(x, weight, bias) else None


def _plain_cpu(t: Tensor | None, dtype: torch.dtype) -> bool:
    """Whether t is None or a plain CPU tensor (or parameter) of dtype."""
    return t is None or (type(t) in (Tensor, nn.Parameter) and t.dtype == dtype and t.device.type == "cpu")


def float32_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """x (..., in) @ weight^T (+ bias) -> (..., out) by the engine's project op where x, weight and
    bias are plain float32 CPU tensors and no gradient is wanted, in eager mode (not compiling,
    exporting or jit-tracing) outside torch.func transforms, forward-mode AD and CPU autocast (the op
    takes oneDNN's inner product where torch has it with IEEE float32, else ATen's); None otherwise
    (the caller's usual path). Training keeps ATen's product, whose gradients autograd knows."""
    wanted = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                          or (bias is not None and bias.requires_grad))
    if (wanted or type(x) is not Tensor or not _plain_cpu(x, torch.float32) or not _plain_cpu(weight, torch.float32)
            or not _plain_cpu(bias, torch.float32) or _tracing() or torch.jit.is_tracing()
            or torch._C._are_functorch_transforms_active() or _forward_ad._current_level >= 0
            or torch.is_autocast_enabled("cpu") or not _ops.core_loaded()):
        return None
    return torch.ops.causal_attention.project(x, weight, bias)


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """layer(x) (x: (..., in) -> (..., out)): by widened_matmul (half) or float32_matmul (float32)
    where calling the layer would compute only its weight product (_linear_weights) and they take x
    against its weights, by calling the layer otherwise."""
    if (x.dtype not in _HALF and x.dtype != torch.float32) or _global_forward_hooks():
        return layer(x)
    weights = _linear_weights(layer)
    if weights is None:
        return layer(x)
    product = widened_matmul if x.dtype in _HALF else float32_matmul
    y = product(x, *weights)
    # (The weights as read: a parametrized weight is computed once, not again by the layer's call.)
    return F.linear(x, *weights) if y is None else y


def unrounded_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight^T (+ bias) -> (..., out) with the sums returned unrounded: float32 for
    bfloat16/half x (each product of two exact widenings, summed in float32), x's dtype otherwise.
    Without a gradient to record, in eager mode on the CPU, the engine's unrounded_linear (a decode
    step's rows stream the weight once, as few_rows_matmul, with no conversion of it); otherwise
    F.linear on the float32 widenings (differentiable; compiled and exported graphs keep it)."""
    if (
        type(x) is Tensor
        and x.device.type == "cpu"
        and type(weight) in (Tensor, nn.Parameter)
        and weight.device.type == "cpu"
        and (bias is None or (type(bias) in (Tensor, nn.Parameter) and bias.device.type == "cpu"))
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))
        and not _tracing()
        and not torch._C._are_functorch_transforms_active()
        and not torch.is_autocast_enabled("cpu")
        and _ops.core_loaded()
    ):
        return torch.ops.causal_attention.unrounded_linear(x, weight, bias)
    wide = torch.float32 if x.dtype in _HALF else x.dtype
    with torch.autocast(x.device.type, enabled=False):  # (autocast would round the product back to half)
        return torch.nn.functional.linear(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide))


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


_LINEAR_FORWARD = nn.Linear.forward


def _global_forward_hooks() -> bool:
    """Whether forward hooks that every module call runs are registered (torch's
    register_module_forward_hook / _pre_hook)."""
    return bool(getattr(_torch_module, "_global_forward_hooks", None)
                or getattr(_torch_module, "_global_forward_pre_hooks", None))


def _linear_weights(module: object) -> tuple[Tensor, Tensor | None] | None:
    """(weight, bias) of a layer whose call computes x @ weight^T + bias and nothing else, so that
    a decode step may stream its weight instead of calling it: an nn.Linear (a parametrized one
    included, whose weight is then computed here) with nn.Linear's forward, no forward of its own
    set on the instance (accelerate's hooks set one) and no forward hooks or pre-hooks of its own
    (prune and the hook-based weight_norm recompute the weight in one, tensor parallelism
    redistributes in them; global hooks are the caller's to ask, _global_forward_hooks). None for
    anything else (quantized and QAT layers, adapters wrapping a Linear, hooked layers): the caller
    calls the module.

    For a plain nn.Linear whose weight and bias are registered parameters (a bias registered as
    None included) and not instance attributes, they are read from its parameter dict, which is
    what attribute access returns there, and cheaper than nn.Module.__getattr__ with the cold
    caches a decode step's Python runs in."""
    cls = type(module)
    if cls is not nn.Linear and not isinstance(module, nn.Linear):
        return None
    attributes = module.__dict__
    if (
        cls.forward is not _LINEAR_FORWARD
        or "forward" in attributes
        or attributes["_forward_hooks"]
        or attributes["_forward_pre_hooks"]
    ):
        return None
    if cls is nn.Linear:
        parameters = attributes["_parameters"]
        if "weight" in parameters and "bias" in parameters and "weight" not in attributes and "bias" not in attributes:
            return parameters["weight"], parameters["bias"]
    weight, bias = module.weight, module.bias
    if not isinstance(weight, Tensor) or not (bias is None or isinstance(bias, Tensor)):
        return None
    return weight, bias
