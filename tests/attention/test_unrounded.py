"""unrounded_linear: x @ weight^T (+ bias) with the float32 sums of half operands returned as they
are (a half model's logits in float32; decode.unrounded_matmul is its Python front).

Run on every instruction-set path (test_kernel.PATH_SUITES): the streaming kernel of a decode step's
rows has an AVX-512 bfloat16 pair kernel, and widened-FMA kernels elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from causal_attention.attention import decode

HALF = (torch.bfloat16, torch.float16)
EPS32 = torch.finfo(torch.float32).eps
ops = torch.ops.causal_attention


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, *, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.5).to(dtype)
    b = (torch.randn(n, generator=gen) * 2).to(dtype) if bias else None
    return x, w, b


def _exact(x: Tensor, w: Tensor, b: Tensor | None) -> tuple[Tensor, Tensor]:
    """The float64 product and the magnitude sum |x| |w|^T + |b| that bounds float32's summation error."""
    exact = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    if b is not None:
        exact, magnitude = exact + b.double(), magnitude + b.double().abs()
    return exact, magnitude


# Rows 1-8: a decode step; 9-64: still the streaming kernel; 65, 70: the widened blocks by columns; 140
# (more rows than the 131 outputs): by rows.
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33, 64, 65, 70, 140])
@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("bias", [False, True])
def test_half_sums_are_float32_within_its_summation_bound(rows: int, dtype: torch.dtype, bias: bool) -> None:
    k, n = 77, 131  # odd sizes: every kernel's tails
    x, w, b = _inputs(rows, k, n, dtype, bias=bias, seed=rows)
    y = ops.unrounded_linear(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    exact, magnitude = _exact(x, w, b)
    # Each product of two half values is exact in float32: only the k + 1 additions round.
    assert bool(((y.double() - exact).abs() <= (k + 1) * EPS32 * magnitude).all())
    # Not rounded to the dtype: some output is not a half value (a rounded one would be).
    assert not torch.equal(y, y.to(dtype).float())


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_step_rounds_to_few_rows_linear_bit_for_bit(rows: int, dtype: torch.dtype, bias: bool) -> None:
    """The streaming kernel's sums before their rounding: rounded, they are few_rows_linear's output."""
    x, w, b = _inputs(rows, 200, 97, dtype, bias=bias, seed=rows + 10)
    assert torch.equal(ops.unrounded_linear(x, w, b).to(dtype), ops.few_rows_linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("rows", [2, 40])
def test_float_dtypes_are_their_own_product(dtype: torch.dtype, rows: int) -> None:
    x, w, b = _inputs(rows, 48, 30, dtype, bias=True)
    y = ops.unrounded_linear(x, w, b)
    assert y.dtype == dtype
    expected = ops.few_rows_linear(x, w, b) if rows <= 8 else torch.nn.functional.linear(x, w, b)
    assert torch.equal(y, expected)


def test_any_leading_shape_and_empty_sizes() -> None:
    x, w, b = _inputs(6, 16, 10, torch.bfloat16, bias=True)
    y = ops.unrounded_linear(x.view(2, 3, 16), w, b)
    assert y.shape == (2, 3, 10) and torch.equal(y.view(6, 10), ops.unrounded_linear(x, w, b))
    empty_in = ops.unrounded_linear(torch.zeros(3, 0, dtype=torch.bfloat16), w[:, :0], b)
    assert torch.equal(empty_in, b.float().expand(3, 10))  # an empty sum: the bias
    assert ops.unrounded_linear(x[:0], w, b).shape == (0, 10)


def test_bad_arguments_are_named() -> None:
    x, w, b = _inputs(2, 16, 10, torch.bfloat16, bias=True)
    with pytest.raises(TypeError, match=r"weight dtype \(Half\) must match x's \(BFloat16\)"):
        ops.unrounded_linear(x, w.half(), None)
    with pytest.raises(ValueError, match=r"weight must have shape \(out, in\) with in = x.size\(-1\) = 16"):
        ops.unrounded_linear(x, w[:, :8], None)
    with pytest.raises(ValueError, match=r"bias must have shape \(out,\) = \(10,\)"):
        ops.unrounded_linear(x, w, b[:4])
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        ops.unrounded_linear(torch.ones(2, 16, dtype=torch.int64), w.long(), None)


def test_meta_kernel_gives_the_float32_shape() -> None:
    x, w, b = _inputs(5, 16, 10, torch.float16, bias=True)
    y = ops.unrounded_linear(x.to("meta"), w.to("meta"), b.to("meta"))
    assert y.device.type == "meta" and y.dtype == torch.float32 and y.shape == (5, 10)
    torch.library.opcheck(ops.unrounded_linear.default, (x, w, b), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", HALF, ids=_name)
def test_unrounded_matmul_differentiates_through_the_widenings(dtype: torch.dtype) -> None:
    """With a gradient to record, unrounded_matmul is F.linear on the float32 widenings: the same
    values within float32's summation order, and gradients that reach the half leaves."""
    x, w, b = _inputs(4, 32, 12, dtype, bias=True)
    w.requires_grad_(True)
    y = decode.unrounded_matmul(x, w, b)
    assert y.dtype == torch.float32 and y.requires_grad
    exact, magnitude = _exact(x, w.detach(), b)
    assert bool(((y.detach().double() - exact).abs() <= 33 * EPS32 * magnitude).all())
    (g,) = torch.autograd.grad(y.sum(), w)
    assert g.dtype == dtype
    expected = x.double().sum(0).expand(12, 32).float()  # d(sum y)/dw: each row the sum of x's rows
    torch.testing.assert_close(g.float(), expected, rtol=torch.finfo(dtype).eps, atol=0)
    with torch.no_grad():  # the engine's op, the same values
        assert bool(((decode.unrounded_matmul(x, w, b).double() - exact).abs() <= 33 * EPS32 * magnitude).all())
