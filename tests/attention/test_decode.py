"""few_rows_linear: the weight-streaming product of a decode step's projections, against float64
F.linear on the same (rounded) operands, and the paths that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import causal_attention  # noqa: F401  (registers the ops)
from causal_attention.attention.decode import FEW_ROWS, few_rows_matmul

op = torch.ops.causal_attention.few_rows_linear

# Tolerance relative to sqrt(in) * max|x| * max|w| (the scale of a sum of `in` products): float32
# and bfloat16/half sum in float32; the half-precision outputs are rounded once (their epsilon).
TOL = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("rows, inp, out", [(1, 1, 1), (1, 768, 2304), (3, 7, 5), (8, 768, 768), (8, 33, 65),
                                             (13, 80, 17)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_float64_linear(dtype: torch.dtype, rows: int, inp: int, out: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + inp + out)
    x = (torch.randn(rows, inp, generator=g) * 3).to(dtype)
    w = torch.randn(out, inp, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    y = op(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, out)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = inp**0.5 * x.double().abs().max() * w.double().abs().max() + (0 if b is None else b.double().abs().max())
    err = ((y.double() - ref).abs().max() / scale).item()
    assert err <= TOL[dtype], err


def test_half_precision_sums_in_float32() -> None:
    # 4096 products of 1 * 1 plus one of 1 * 0.5: a bfloat16 running sum would stall at 256.
    x = torch.ones(2, 4097, dtype=torch.bfloat16)
    w = torch.ones(3, 4097, dtype=torch.bfloat16)
    w[:, -1] = 0.5
    assert torch.equal(op(x, w, None), torch.full((2, 3), 4096.5).to(torch.bfloat16))


def test_leading_dimensions_and_strided_inputs() -> None:
    x = torch.randn(2, 3, 40)[:, :, ::2]  # (2, 3, 20), strided
    w = torch.randn(20, 11).t()  # (11, 20), transposed storage
    b = torch.randn(11)
    torch.testing.assert_close(op(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert op(x, w, b).shape == (2, 3, 11)


def test_empty_inputs() -> None:
    assert op(torch.randn(0, 4), torch.randn(5, 4), None).shape == (0, 5)
    torch.testing.assert_close(op(torch.randn(2, 0), torch.randn(3, 0), torch.arange(3.0)),
                               torch.arange(3.0).expand(2, 3))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.randn(2, 4), torch.randn(3, 5), None), "weight must have shape"),
        ((torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64), None), "weight dtype"),
        ((torch.randn(2, 4), torch.randn(3, 4), torch.randn(4)), "bias must have shape"),
        ((torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, dtype=torch.float64)), "bias dtype"),
        ((torch.tensor(1.0), torch.randn(3, 4), None), "at least one dimension"),
    ],
)
def test_bad_inputs_name_the_argument(args: tuple, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        op(*args)


def test_refuses_autograd() -> None:
    x = torch.randn(2, 4, requires_grad=True)
    y = op(x, torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="derivative|autograd|not implemented"):
        y.sum().backward()


def test_meta_shape() -> None:
    y = op(torch.empty(2, 3, 4, device="meta"), torch.empty(7, 4, device="meta"), None)
    assert y.shape == (2, 3, 7) and y.device.type == "meta"


def test_few_rows_matmul_uses_it_only_when_it_applies() -> None:
    w, b = torch.randn(6, 5), torch.randn(6)
    x = torch.randn(FEW_ROWS, 5)
    with torch.no_grad():
        assert torch.equal(few_rows_matmul(x, w, b), op(x, w, b))
        assert few_rows_matmul(torch.randn(FEW_ROWS + 1, 5), w, b) is None  # BLAS's case
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: its own path
            assert few_rows_matmul(x, w, b).dtype == torch.bfloat16
    assert few_rows_matmul(x, w, b) is None  # gradients wanted: the caller's nn.Linear


def test_decode_step_equals_full_forward_through_it() -> None:
    """A cached decode step (projections by few_rows_linear) equals the full forward's last row."""
    from causal_attention import CausalSelfAttention

    torch.manual_seed(0)
    attn = CausalSelfAttention(96, 4).eval()
    x = torch.randn(3, 9, 96)
    with torch.no_grad():
        full = attn(x)
        cache = attn.make_cache(3, 16)
        attn(x[:, :8], cache=cache)
        step = attn(x[:, 8:], cache=cache)
    torch.testing.assert_close(step, full[:, 8:], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Decode and the thread count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t_new", [1, 4, 40])
def test_decode_is_bitwise_independent_of_the_thread_count(dtype, t_new):
    """B * H small and a long context: the context is split, and the split must not depend on
    at::get_num_threads() (a split that did made 1 and 2 threads differ in the last bits)."""
    B, H, hd, L = 1, 2, 64, 3000
    qkv = torch.randn(B, t_new, 3 * H * hd).to(dtype)
    k, v = torch.randn(B, H, L, hd).to(dtype), torch.randn(B, H, L, hd).to(dtype)
    start = torch.tensor([2900 - t_new])
    end = start + t_new
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(torch.ops.causal_attention.decode_attention(qkv, k, v, start, end, H))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
