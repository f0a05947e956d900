"""The projections of half-precision models on CPUs without half arithmetic: widened_addmm (half
operands summed in float32, rounded once) and the differentiable project op that the layer and the
GPT route their linear layers through (attention/decode.py: project, widened_matmul); float32
projections without a gradient through oneDNN's inner product (float32_matmul)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from causal_attention.attention import decode
from helpers import isa_env

HALF = (torch.bfloat16, torch.float16)
EPS32 = torch.finfo(torch.float32).eps
ops = torch.ops.causal_attention


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bound(exact: torch.Tensor, magnitude: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """What a product summed in float32 and rounded once to dtype may be off from the exact result:
    half an ulp of dtype, plus float32's summation error over k terms of total size `magnitude`."""
    return torch.finfo(dtype).eps / 2 * exact.abs() + k * EPS32 * magnitude + torch.finfo(dtype).tiny


@contextlib.contextmanager
def _float32_products(backend: str) -> Iterator[None]:
    """widened_addmm's float32 products: oneDNN's inner product (torch's default where it has oneDNN),
    MKL's sgemm with torch.backends.mkldnn disabled, or sgemm because oneDNN's float32 products would
    round to bfloat16 (torch.backends.mkldnn.matmul.fp32_precision = "bf16")."""
    enabled, deterministic, _, precision = torch.backends.mkldnn.set_flags(_fp32_precision=None)
    try:
        if backend == "sgemm":
            torch.backends.mkldnn.set_flags(_enabled=False, _fp32_precision=None)
        elif backend == "onednn_bf16_precision":
            torch.backends.mkldnn.set_flags(_fp32_precision="bf16")
        yield
    finally:  # (allow_tf32 untouched: setting it warns on a torch without Intel GPU support)
        torch.backends.mkldnn.set_flags(enabled, deterministic, None, precision)


def _operand(rows: int, cols: int, layout: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(rows, cols) in dtype: row-major, a transposed view (column-major), or a strided slice."""
    if layout == "transposed":
        return torch.randn(cols, rows, generator=gen).to(dtype).t()
    if layout == "sliced":
        return torch.randn(rows, 2 * cols + 1, generator=gen).to(dtype)[:, 1 : 2 * cols + 1 : 2]
    return torch.randn(rows, cols, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=_name)
# (40, 16, 80001) and (70001, 8, 70): blocks of columns, of rows (kWidenedBlockBytes), the last one short.
@pytest.mark.parametrize("M,K,N", [(1, 8, 3), (7, 48, 5), (113, 64, 80), (1025, 80, 17), (300, 700, 2100),
                                   (40, 16, 80001), (70001, 8, 70)])
# (contiguous, transposed) is x @ weight^T, the product oneDNN's inner product takes where torch has it.
@pytest.mark.parametrize("layouts", [("contiguous", "contiguous"), ("transposed", "transposed"),
                                     ("contiguous", "transposed"), ("sliced", "transposed"),
                                     ("sliced", "contiguous"), ("contiguous", "sliced")])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("backend", ["onednn", "sgemm"])
def test_widened_addmm_sums_in_float32_and_rounds_once(dtype: torch.dtype, M: int, K: int, N: int,
                                                        layouts: tuple[str, str], with_bias: bool,
                                                        backend: str) -> None:
    gen = torch.Generator().manual_seed(M * 7919 + K * 31 + N)
    a = _operand(M, K, layouts[0], dtype, gen) * 3
    b = _operand(K, N, layouts[1], dtype, gen)
    bias = (torch.randn(N, generator=gen) * 4).to(dtype) if with_bias else None
    with _float32_products(backend):
        out = ops.widened_addmm(a, b, bias)
    assert out.dtype == dtype and out.shape == (M, N) and out.is_contiguous()
    exact = a.double() @ b.double() + (0 if bias is None else bias.double())
    magnitude = a.double().abs() @ b.double().abs()
    err = (out.double() - exact).abs()
    assert bool((err <= _bound(exact, magnitude, K, dtype)).all()), f"worst {err.max().item():.3g}"
    # Rounded once: equal to the float32 product rounded to dtype but where their sums' orders differ.
    once = (a.float() @ b.float() + (0 if bias is None else bias.float())).to(dtype)
    assert int((out != once).sum()) <= max(1, 0.01 * out.numel())


@pytest.mark.parametrize("backend", ["onednn", "sgemm", "onednn_bf16_precision"])
def test_widened_products_names_the_route(backend: str) -> None:
    """The AVX2 and AVX-512 builds widen as their own GEMM packs ("panels", whatever oneDNN's settings);
    the DEFAULT build (test_kernel.PATH_SUITES runs this under it) widens blocks for oneDNN or sgemm."""
    onednn = torch.backends.mkldnn.is_available() and backend == "onednn"
    with _float32_products(backend):
        expected = ("oneDNN+sgemm" if onednn else "sgemm") if ops.cpu_capability() == "DEFAULT" else "panels"
        assert ops.widened_products() == expected


def test_widened_products_keep_to_sgemm_where_onednn_would_round() -> None:
    """oneDNN's environment can make its float32 products round (ONEDNN_DEFAULT_FPMATH_MODE): there the
    widened blocks go to sgemm, and float32 projections to ATen."""
    code = ("import torch, causal_attention; ops = torch.ops.causal_attention; "
            "print(ops.widened_products(), ops.float32_products())")
    onednn = torch.backends.mkldnn.is_available()
    strict = ["oneDNN+sgemm", "oneDNN"] if onednn else ["sgemm", "ATen"]
    # (the DEFAULT build's widened blocks: the AVX2 / AVX-512 builds multiply their own panels)
    for mode, expected in (("BF16", ["sgemm", "ATen"]), ("STRICT", strict)):
        env = {**os.environ, "ONEDNN_DEFAULT_FPMATH_MODE": mode, "ATEN_CPU_CAPABILITY": "default"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[-2:] == expected, (mode, out.stdout, out.stderr)


def _onednn_calls(fn: Callable[[], object]) -> int:
    """How many times fn calls oneDNN's float32 inner product (torch's mkldnn::_linear_pointwise)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


@pytest.mark.parametrize("shape, out", [((1, 16), 24), ((4, 9, 16), 24), ((2, 113, 768), 2304), ((1025, 80), 48),
                                        ((3, 7, 2048), 11)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_float32_project_without_a_gradient_sums_in_float32(shape: tuple[int, ...], out: int,
                                                            with_bias: bool) -> None:
    """float32 without a gradient: oneDNN's inner product where float32_products says so (one call), a
    float32 sum within its bound of the float64 product, whatever the leading dimensions."""
    k = shape[-1]
    gen = torch.Generator().manual_seed(k * 31 + out)
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.randn(out, k, generator=gen)
    b = torch.randn(out, generator=gen) * 4 if with_bias else None
    route = ops.float32_products()
    assert route == ("oneDNN" if torch.backends.mkldnn.is_available() else "ATen")
    with torch.no_grad():
        y = decode.float32_matmul(x, w, b)
        calls = _onednn_calls(lambda: ops.project(x, w, b))
    assert y is not None and y.dtype == torch.float32 and y.shape == (*shape[:-1], out)
    assert calls == (1 if route == "oneDNN" else 0)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    err = (y.double() - exact).abs()
    assert bool((err <= (k + 1) * EPS32 * magnitude + 1e-30).all()), f"worst {err.max().item():.3g}"


def test_float32_matmul_only_where_nothing_is_differentiated() -> None:
    """ATen's product (None from float32_matmul) wherever a gradient is wanted, under CPU autocast, for
    other dtypes; the layer's own call under a gradient, the op's product without one."""
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(5, 16, generator=gen)
    w, b = layer.weight, layer.bias
    assert w.requires_grad and decode.float32_matmul(x, w, b) is None
    assert decode.float32_matmul(x.requires_grad_(), w.detach(), None) is None
    x = x.detach()
    with torch.no_grad():
        assert torch.equal(decode.float32_matmul(x, w, b), ops.project(x, w, b))
        assert torch.equal(decode.project(layer, x), ops.project(x, w, b))
        assert decode.float32_matmul(x.double(), w.double(), b.double()) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert decode.float32_matmul(x, w, b) is None
    y = decode.project(layer, x)
    assert torch.equal(y, layer(x)) and y.grad_fn is not None
    y.sum().backward()
    assert torch.allclose(layer.weight.grad, x.sum(0).expand(8, 16))
    # A row-major weight's transpose is not row-major: the op keeps ATen's product.
    w_columns = w.detach().t().contiguous().t()
    with torch.no_grad():
        assert torch.equal(ops.project(x, w_columns, b), torch.nn.functional.linear(x, w_columns, b))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "right_padded"])
def test_gpt_float32_inference_takes_every_product_through_the_op(arch: str, padded: bool) -> None:
    """A float32 GPT without a gradient: each layer's qkv, output and MLP products and the head go
    through float32_matmul (oneDNN's inner product where float32_products says so), the logits within
    float32's rounding of the float64 model's; with a gradient, none of them."""
    from causal_attention.models import GPT, GPTConfig

    extra = dict(n_kv_heads=2, norm="rmsnorm", gated_mlp=True, positions="rope", activation="silu", bias=False,
                 tie_head=False) if arch == "llama" else {}
    config = GPTConfig(vocab_size=97, max_len=64, dim=64, n_layers=2, n_heads=4, **extra)
    torch.manual_seed(0)
    gpt = GPT(config).eval()
    ref = GPT(config).double().eval()
    ref.load_state_dict({k: v.double() for k, v in gpt.state_dict().items()})
    tokens = torch.randint(0, 97, (2, 33))
    mask = torch.arange(33)[None] < torch.tensor([33, 20])[:, None] if padded else None
    per_layer = 4  # qkv, proj, fc (gate_up), out (down)
    onednn = ops.float32_products() == "oneDNN"
    holder: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        calls = _onednn_calls(lambda: holder.setdefault("y", gpt(tokens, mask)))
        exact = ref(tokens, mask)
    head_calls = 2 if padded else 1  # right padding: the head per sequence
    assert calls == ((per_layer * 2 + head_calls) if onednn else 0)
    err = (holder["y"].double() - exact).abs().max().item()
    assert err <= 1e-4 * exact.abs().max().item(), err
    assert _onednn_calls(lambda: gpt(tokens, mask).sum().backward()) == 0


def test_float32_project_keeps_forward_mode_tangents_and_traces() -> None:
    """A dual tensor (forward-mode AD) is differentiated: ATen's product carries its tangent, where
    oneDNN's op would drop it; torch.jit.trace records ATen's product, not the engine's op."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(6)
    layer = torch.nn.Linear(300, 40)
    x, t = torch.randn(7, 300, generator=gen), torch.randn(7, 300, generator=gen)
    with torch.no_grad(), fwAD.dual_level():
        assert decode.float32_matmul(fwAD.make_dual(x, t), layer.weight, layer.bias) is None
        y = ops.project(fwAD.make_dual(x, t), layer.weight, layer.bias)
        y_mod = decode.project(layer, fwAD.make_dual(x, t))
        tangents = fwAD.unpack_dual(y).tangent, fwAD.unpack_dual(y_mod).tangent
    for tangent in tangents:
        assert tangent is not None
        torch.testing.assert_close(tangent, t @ layer.weight.detach().t())
    class Projected(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return decode.project(self.layer, v)

    with torch.no_grad():
        traced = torch.jit.trace(Projected(), (x,))
    assert "causal_attention::project" not in str(traced.graph) and "aten::linear" in str(traced.graph)


def test_float32_project_edge_cases_fall_back_or_refuse_as_aten_does() -> None:
    """Strided inputs and biases, 1-D inputs, empty sizes and inference mode give ATen's values (within
    float32's rounding); shapes that do not match raise ATen's errors."""
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(24, 40, generator=gen), torch.randn(48, generator=gen)[::2]  # a strided bias
    cases = [torch.randn(5, 80, generator=gen)[:, ::2], torch.randn(40, generator=gen),
             torch.randn(3, 40, 5, generator=gen).transpose(1, 2), torch.randn(0, 40)]
    with torch.no_grad():
        for x in cases:
            y = ops.project(x, w, b)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
            assert y.shape == (*x.shape[:-1], 24)
        assert ops.project(torch.randn(3, 0), torch.randn(5, 0), None).shape == (3, 5)
        assert ops.project(torch.randn(3, 4), torch.randn(0, 4), None).shape == (3, 0)
        with torch.inference_mode():
            x = torch.randn(6, 40, generator=gen)
            torch.testing.assert_close(ops.project(x, w, b), torch.nn.functional.linear(x, w, b),
                                       rtol=1e-5, atol=1e-5)
        for bad_w, bad_b in ((torch.randn(24, 41), None), (w, torch.randn(23))):
            with pytest.raises(RuntimeError) as ours:
                ops.project(torch.randn(2, 40), bad_w, bad_b)
            with pytest.raises(RuntimeError) as aten:
                torch.nn.functional.linear(torch.randn(2, 40), bad_w, bad_b)
            assert str(ours.value).split("\n")[0] == str(aten.value).split("\n")[0]


def test_a_parametrized_weight_is_computed_once_a_call() -> None:
    """project reads a parametrized layer's weight once and multiplies that, with or without a gradient."""
    from torch.nn.utils import parametrize

    class Counted(torch.nn.Module):
        calls = 0

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            Counted.calls += 1
            return w * 2

    layer = torch.nn.Linear(16, 8)
    parametrize.register_parametrization(layer, "weight", Counted())
    x = torch.randn(3, 16)
    for grad in (True, False):
        Counted.calls = 0
        with torch.set_grad_enabled(grad):
            y = decode.project(layer, x)
        assert Counted.calls == 1, grad
        torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.parametrizations.weight.original * 2,
                                                                 layer.bias))


@pytest.mark.parametrize("backend", ["onednn", "sgemm", "onednn_bf16_precision"])
def test_float32_products_never_round(backend: str) -> None:
    """Where oneDNN is off or would round its float32 products to bfloat16, the float32 projections are
    ATen's, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(64, 300, generator=gen), torch.randn(200, 300, generator=gen), torch.randn(200, generator=gen)
    with _float32_products(backend), torch.no_grad():
        onednn = torch.backends.mkldnn.is_available() and backend == "onednn"
        assert ops.float32_products() == ("oneDNN" if onednn else "ATen")
        y = ops.project(x, w, b)
        if not onednn:
            assert torch.equal(y, torch.nn.functional.linear(x, w, b))
        assert (y.double() - (x.double() @ w.double().t() + b.double())).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", HALF, ids=_name)
def test_widened_addmm_never_rounds_its_float32_products(dtype: torch.dtype) -> None:
    """With oneDNN's float32 products set to round to bfloat16 (fp32_precision), widened_addmm takes
    sgemm: its sums stay float32's, bit for bit those of the sgemm path."""
    gen = torch.Generator().manual_seed(3)
    a = (torch.randn(300, 700, generator=gen) * 3).to(dtype)
    w = (torch.randn(2100, 700, generator=gen) * 0.7).to(dtype)  # (out, in): b = w^T
    with _float32_products("sgemm"):
        expected = ops.widened_addmm(a, w.t(), None)
    with _float32_products("onednn_bf16_precision"):
        assert torch.equal(ops.widened_addmm(a, w.t(), None), expected)


@pytest.mark.parametrize("dtype", HALF, ids=_name)
def test_widened_addmm_empty_sizes(dtype: torch.dtype) -> None:
    bias = torch.arange(3, dtype=dtype)
    assert ops.widened_addmm(torch.ones(0, 4, dtype=dtype), torch.ones(4, 3, dtype=dtype), bias).shape == (0, 3)
    out = ops.widened_addmm(torch.ones(2, 0, dtype=dtype), torch.ones(0, 3, dtype=dtype), bias)
    assert torch.equal(out, bias.expand(2, 3))  # K = 0: the bias alone
    torch.library.opcheck(ops.widened_addmm.default, (torch.ones(5, 4, dtype=dtype), torch.ones(4, 3, dtype=dtype),
                                                      bias), test_utils=("test_schema", "test_faketensor"))
    assert torch.equal(ops.widened_addmm(torch.ones(2, 0, dtype=dtype), torch.ones(0, 3, dtype=dtype), None),
                       torch.zeros(2, 3, dtype=dtype))


@pytest.mark.parametrize("dtype", HALF, ids=_name)
# (40, 80001, 16): b widened in blocks of columns, the last one short; (20, 70001, 8): b widened whole.
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (7, 113, 5), (80, 4096, 48), (40, 80001, 16), (20, 70001, 8)])
def test_widened_addmm_sums_adds_b_column_sums(dtype: torch.dtype, M: int, K: int, N: int) -> None:
    """A weight gradient a @ g and its bias gradient g.sum(0) in one pass: the product is widened_addmm's,
    bit for bit; the sums are float32 sums of the exact widenings (float32, not rounded to the dtype)."""
    gen = torch.Generator().manual_seed(M + K + N)
    a = (torch.randn(K, M, generator=gen) * 2).to(dtype).t()  # column-major, as x^T is
    b = (torch.randn(K, N, generator=gen) * 3).to(dtype)
    out, sums = ops.widened_addmm_sums(a, b)
    assert torch.equal(out, ops.widened_addmm(a, b, None))
    exact_product = a.double() @ b.double()
    err = (out.double() - exact_product).abs()
    assert bool((err <= _bound(exact_product, a.double().abs() @ b.double().abs(), K, dtype)).all())
    assert sums.dtype == torch.float32 and sums.shape == (N,)
    exact = b.double().sum(0)
    bound = K * EPS32 * b.double().abs().sum(0) + torch.finfo(torch.float32).tiny
    assert bool(((sums.double() - exact).abs() <= bound).all())
    if K > 100:  # not rounded to the dtype: long sums need float32's bits
        assert not torch.equal(sums, sums.to(dtype).float())
    if K < 1000:  # its meta kernel: shapes and dtypes under FakeTensor, as torch.compile traces it
        torch.library.opcheck(ops.widened_addmm_sums.default, (a, b), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", HALF, ids=_name)
def test_widened_addmm_sums_empty_and_wrong_shapes(dtype: torch.dtype) -> None:
    out, sums = ops.widened_addmm_sums(torch.ones(3, 0, dtype=dtype), torch.ones(0, 2, dtype=dtype))
    assert torch.equal(out, torch.zeros(3, 2, dtype=dtype)) and torch.equal(sums, torch.zeros(2))
    out, sums = ops.widened_addmm_sums(torch.ones(0, 4, dtype=dtype), torch.ones(4, 2, dtype=dtype))
    assert out.shape == (0, 2) and torch.equal(sums, torch.full((2,), 4.0))
    with pytest.raises(ValueError, match=r"a must be \(M, K\) and b \(K, N\)"):
        ops.widened_addmm_sums(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))


def test_widened_addmm_errors_name_the_argument() -> None:
    a, b = torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a must be \(M, K\) and b \(K, N\)"):
        ops.widened_addmm(a, b.t(), None)
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        ops.widened_addmm(a.float(), b.float(), None)
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        ops.widened_addmm(a, b.half(), None)
    with pytest.raises(ValueError, match=r"bias must have shape \(N,\) = \(3,\)"):
        ops.widened_addmm(a, b, torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bias dtype"):
        ops.widened_addmm(a, b, torch.ones(3))


@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
# Without a graph the bias gradient is summed in the weight gradient's product (widened_addmm_sums).
@pytest.mark.parametrize("create_graph", [True, False], ids=["graph", "no_graph"])
def test_project_gradients_by_the_same_products(dtype: torch.dtype, with_bias: bool, create_graph: bool) -> None:
    """project's gradients (dx = g W, dW = g^T x, db = sum g in float32) against float64 autograd of the
    same half values, to the bound of one float32 sum rounded once; and its double backward."""
    gen = torch.Generator().manual_seed(5)
    B, T, n_in, n_out = 3, 37, 48, 80
    x = torch.randn(B, T, n_in, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n_out, n_in, generator=gen) / 4).to(dtype).requires_grad_()
    b = torch.randn(n_out, generator=gen).to(dtype).requires_grad_() if with_bias else None
    g = torch.randn(B, T, n_out, generator=gen).to(dtype)
    y = ops.project(x, w, b)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], g, create_graph=create_graph)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, w64, b64)
    exact = torch.autograd.grad(y64, [t for t in (x64, w64, b64) if t is not None], g.double())
    g64, xa, wa = g.double().abs(), x64.detach().abs(), w64.detach().abs()
    magnitudes = [(g64 @ wa, n_out), (g64.flatten(0, 1).t() @ xa.flatten(0, 1), B * T), (g64.sum((0, 1)), B * T)]
    out_bound = _bound(y64.detach(), xa @ wa.t(), n_in, dtype)
    assert bool(((y.detach().double() - y64.detach()).abs() <= out_bound).all())
    for got, want, (magnitude, k) in zip(grads, exact, magnitudes):
        assert got.dtype == dtype
        assert bool(((got.detach().double() - want).abs() <= _bound(want, magnitude, k, dtype)).all())

    if not create_graph:
        return
    # Double backward: d/dW sum(h * dx) = g^T h, since dx = g W.
    h = torch.randn(B, T, n_in, generator=gen).to(dtype)
    (ggw,) = torch.autograd.grad((grads[0] * h).sum(), [w])
    want = g.double().flatten(0, 1).t() @ h.double().flatten(0, 1)
    bound = _bound(want, g64.flatten(0, 1).t() @ h.double().abs().flatten(0, 1), B * T, dtype)
    assert bool(((ggw.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, *HALF), ids=_name)
def test_project_is_aten_linear_or_the_widened_product(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((4, 9, 16), (24, 16), (24,)))
    if dtype in HALF and not ops.half_arithmetic(dtype):  # this CPU widens: the widened product, bit for bit
        widened = ops.widened_addmm(x.reshape(-1, 16), w.t(), b).view(4, 9, 24)
        assert torch.equal(ops.project(x, w, b), widened)
        assert torch.equal(decode.widened_matmul(x, w, b), widened)
        with torch.inference_mode():  # the op below autograd
            assert torch.equal(ops.project(x, w, b), widened)
        return
    if dtype == torch.float32:  # without a gradient: test_float32_project_without_a_gradient_sums_in_float32
        x.requires_grad_()
    assert torch.equal(ops.project(x, w, b), torch.nn.functional.linear(x, w, b))
    assert decode.widened_matmul(x, w, b) is None


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_half_arithmetic_follows_the_cpu_and_the_engine_path() -> None:
    assert ops.half_arithmetic(torch.float32) and ops.half_arithmetic(torch.float64)
    flags, avx512 = _cpu_flags(), ops.cpu_capability() == "AVX512"
    if flags:
        assert ops.half_arithmetic(torch.bfloat16) == (avx512 and "avx512_bf16" in flags)
        assert ops.half_arithmetic(torch.float16) == (avx512 and "avx512_fp16" in flags)
    with pytest.raises(ValueError, match="floating type"):
        ops.half_arithmetic(torch.int32)


# On the AVX2 path (where this CPU has it) half products widen: the layer and the GPT route every
# projection through widened_addmm, forward and backward, and match float64 as closely as ATen does.
_ROUTED = r"""
import json, sys, torch
from torch import nn
from causal_attention import CausalSelfAttention
from causal_attention.attention import decode, reference
from causal_attention.models import GPT, GPTConfig

half_arithmetic = decode._half_arithmetic

torch.set_num_threads(2)
out = {"half_arithmetic": [bool(torch.ops.causal_attention.half_arithmetic(d)) for d in (torch.bfloat16, torch.float16)]}

def widened_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("causal_attention::widened_addmm", "causal_attention::widened_addmm_sums")
    return sum(e.count for e in prof.key_averages() if e.key in names)

def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1)).item()

gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16):
    name = str(dtype).removeprefix("torch.")
    layer = CausalSelfAttention(64, 4)
    x = torch.randn(2, 33, 64, generator=gen)
    mask = torch.arange(33)[None] < torch.tensor([33, 20])[:, None]
    g = torch.randn(2, 33, 64, generator=gen)
    # The half layer's weights, exactly, in float64.
    weights = [t.to(dtype).double() for t in (layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias)]
    x64 = x.to(dtype).double().requires_grad_()
    y64 = reference.causal_self_attention(x64, *weights, 4, mask)
    (gx64,) = torch.autograd.grad(y64, x64, g.double())
    errors = {}
    for route in ("widened", "aten"):
        half = CausalSelfAttention(64, 4).to(dtype)
        half.load_state_dict(layer.state_dict())
        if route == "aten":  # a forward hook on the projections: they are called as modules
            for lin in (half.qkv, half.proj):
                lin.register_forward_hook(lambda m, i, o: None)
        xh = x.to(dtype).requires_grad_()
        holder = {}
        def step():
            holder["y"] = half(xh, mask)
            holder["y"].backward(g.to(dtype))
        calls = widened_calls(step)
        errors[route] = {"calls": calls, "out": rel(holder["y"], y64.detach()), "grad_x": rel(xh.grad, gx64)}
    out[name] = errors
    gpt = GPT(GPTConfig(vocab_size=50, max_len=16, dim=32, n_layers=2, n_heads=2)).to(dtype)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    with torch.no_grad():
        ref = GPT(GPTConfig(vocab_size=50, max_len=16, dim=32, n_layers=2, n_heads=2)).double()
        ref.load_state_dict({k: v.double() for k, v in gpt.state_dict().items()})
        exact = ref(tokens)
        holder = {}
        calls = widened_calls(lambda: holder.setdefault("widened", gpt(tokens)))
        decode._half_arithmetic = lambda dtype: True  # as on a CPU with half arithmetic: ATen's products
        aten_calls = widened_calls(lambda: holder.setdefault("aten", gpt(tokens)))
        decode._half_arithmetic = half_arithmetic
        out[name]["gpt"] = {"calls": calls, "aten_calls": aten_calls, "widened": rel(holder["widened"], exact),
                            "aten": rel(holder["aten"], exact)}
print(json.dumps(out))
"""


def test_layer_and_gpt_widen_their_projections_on_the_avx2_path() -> None:
    if "avx2" not in _cpu_flags():
        pytest.skip("this CPU has no AVX2 path to force")
    env = isa_env("avx2", OMP_NUM_THREADS="2")
    run = subprocess.run([sys.executable, "-c", _ROUTED], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["half_arithmetic"] == [False, False]
    for dtype in HALF:
        r = result[_name(dtype)]
        # forward: qkv and proj; backward: dx and dW (with the bias's gradient) of each
        assert r["widened"]["calls"] == 6 and r["aten"]["calls"] == 0, r
        for what in ("out", "grad_x"):
            # As close to float64 as ATen's own half products (2x: the two round differently).
            assert r["widened"][what] <= 2 * r["aten"][what] + torch.finfo(dtype).eps, (what, r)
        # 2 layers x (qkv, proj, fc, out) + the head
        gpt = r["gpt"]
        assert gpt["calls"] == 9 and gpt["aten_calls"] == 0, gpt
        assert gpt["widened"] <= 2 * gpt["aten"] + torch.finfo(dtype).eps, gpt


def test_bench_half_quick(tmp_path: Path) -> None:
    """bench-half at tiny sizes: a layer row and a prefill row per dtype, each section naming the ISA
    and the projections' route as half_arithmetic says (the prefill's also its float32 twin's), the
    files written."""
    from causal_attention.tools.bench import half as bench_half

    report = bench_half.main(out_dir=tmp_path, repeats=1, quick=True)
    rows = report["rows"]
    assert len(rows) == 4 and all(r["ours_ms"] > 0 and r["theirs_ms"] > 0 for r in rows)
    for dtype in HALF:
        widened = not ops.half_arithmetic(dtype)
        assert ("widened" in report["routes"][_name(dtype)]) == widened
        assert sum(f" {_name(dtype)} vs float32 ({report['cpu_capability']}" in r["section"] for r in rows) == 2
    prefill = [r["section"] for r in rows if "prefill" in r["name"]]
    assert len(prefill) == 2 and all(s.endswith(f"float32: {ops.float32_products()})") for s in prefill), prefill
    assert (tmp_path / "bench_half.json").stat().st_size > 0 and (tmp_path / "bench_half.png").stat().st_size > 0
    with pytest.raises(ValueError, match="dtypes must be a non-empty selection"):
        bench_half.main(out_dir=tmp_path, repeats=1, quick=True, dtypes=(torch.float32,))
