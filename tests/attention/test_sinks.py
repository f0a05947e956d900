"""Attention sinks (gpt-oss's ``s_aux``): one logit per query head joins every row's softmax with a value
of 0, so a row's weights sum to less than 1. The engine folds the sink into each row's softmax state
before it normalises (the tiled forward and the streaming decode route alike), hands back the lse with the
sink in it (so the fused backward's probabilities are the sink-normalised ones) and takes the sinks'
gradient from out and lse. Held to reference.attention in float64, and at the working dtypes to the
reference's own ops run at that dtype (transformers' eager attention)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from causal_attention.attention import _ops, reference
from helpers import rel_err
from test_heads import OPTIONS, SHAPES, _key_mask, _operands


def _sinks(H: int, dtype: torch.dtype) -> Tensor:
    """Sinks below, among and far above the scores (the last one takes the row's max: the sums rescaled)."""
    s = torch.randn(H, dtype=torch.float64) * 2
    s[-1] = 40.0
    if H > 2:
        s[0] = -30.0
    return s.to(dtype).requires_grad_()


def _engine(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None, g: Tensor,
            **options: object) -> tuple[Tensor, ...]:
    out = _ops.attention_heads(q, k, v, mask, sinks=sinks, **options)
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    return (out.detach(), *torch.autograd.grad(out, inputs, g))


def _reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor, g: Tensor, *,
               dtype: torch.dtype = torch.float64, **options: object) -> tuple[Tensor, ...]:
    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    out = reference.attention(*x[:3], key_mask=mask, sinks=x[3], **options)[0].transpose(1, 2)  # (B, Tq, H, hd)
    return (out.detach(), *torch.autograd.grad(out, x, g.to(dtype)))


@pytest.mark.parametrize("option", ["plain", "window", "all"])
@pytest.mark.parametrize("mask_kind", ["none", "left", "holes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_H{}_Hkv{}_Tq{}_Tk{}_hd{}".format(*s))
def test_float64_matches_the_reference(shape: tuple[int, ...], mask_kind: str, option: str) -> None:
    """Prefill, decode steps (one query: the streaming route) and chunks, GQA and MQA, padding and holes,
    a window, a softcap: output and the gradients of q, k, v and the sinks."""
    B, H, Hkv, Tq, Tk, hd = shape
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, torch.float64, layout="bthd")
    sinks = _sinks(H, torch.float64)
    mask = _key_mask(mask_kind, B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64)
    ours = _engine(q, k, v, mask, sinks, g, **OPTIONS[option])
    exact = _reference(q, k, v, mask, sinks, g, **OPTIONS[option])
    for what, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), ours, exact):
        assert a.shape == e.shape and rel_err(a, e) <= 1e-12, what


@pytest.mark.parametrize("Tq, Tk", [(1, 300), (5, 300), (113, 113)], ids=["decode", "few", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_working_dtypes_are_as_exact_as_eager(dtype: torch.dtype, Tq: int, Tk: int) -> None:
    """Against the float64 reference on the same rounded inputs: within 3x the error of the reference's ops
    run at the dtype (what transformers' eager attention computes), or two units of the dtype's last place;
    values in the tens, a left-padded past."""
    B, H, Hkv, hd = 2, 8, 2, 64
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, dtype, layout="bthd", magnitude=3.0)
    sinks = _sinks(H, dtype)
    mask = _key_mask("left", B, Tk)
    mask[:, -1] = True  # every query sees a key
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64).to(dtype)
    ours = _engine(q, k, v, mask, sinks, g)
    exact = _reference(q, k, v, mask, sinks, g)
    eager = _reference(q, k, v, mask, sinks, g, dtype=dtype)
    floor = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for what, a, e, s in zip(("out", "dq", "dk", "dv", "dsinks"), ours, exact, eager):
        tol = max(floor, 3 * rel_err(s, e))
        assert rel_err(a, e) <= tol, f"{what}: {rel_err(a, e):.3g} > {tol:.3g}"


@pytest.mark.parametrize("Tq", [1, 4, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_sinks_at_minus_infinity_are_no_sinks_bit_for_bit(dtype: torch.dtype, Tq: int) -> None:
    """A sink of -inf takes no weight: the same output and lse as without sinks, bit for bit, on every route."""
    B, H, Hkv, Tk, hd = 2, 4, 2, 200, 32
    q, k, v = (t.detach() for t in _operands(B, H, Hkv, Tq, Tk, hd, dtype))
    mask = _key_mask("holes", B, Tk)
    none = torch.ops.causal_attention.attention_heads_forward(q, k, v, mask, window=50)
    minus_inf = torch.full((H,), -math.inf, dtype=dtype)
    sunk = torch.ops.causal_attention.attention_heads_forward(q, k, v, mask, window=50, sinks=minus_inf)
    assert torch.equal(none[0], sunk[0]) and torch.equal(none[1], sunk[1])


@pytest.mark.parametrize("Tq", [1, 4])
def test_rows_without_keys_give_zero(Tq: int) -> None:
    """A query with no allowed key gives 0 with sinks too (the sink's value is 0), no NaN, and no gradient
    to anything, the sinks included."""
    B, H, Tk, hd = 1, 2, 10, 8
    q, k, v = _operands(B, H, H, Tq, Tk, hd, torch.float64)
    sinks = _sinks(H, torch.float64)
    mask = torch.zeros(B, Tk, dtype=torch.bool)
    out = _ops.attention_heads(q, k, v, mask, sinks=sinks)
    assert bool((out == 0).all())
    grads = torch.autograd.grad(out.sum(), (q, k, v, sinks))
    assert all(bool((t == 0).all()) for t in grads)


def test_the_comparison_catches_a_sink_left_out() -> None:
    """The float64 comparison can fail: the engine without its sinks is far from the reference with them."""
    B, H, Hkv, Tq, Tk, hd = 2, 4, 2, 1, 50, 16
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, torch.float64)
    sinks = torch.zeros(H, dtype=torch.float64)
    ours = _ops.attention_heads(q, k, v).detach()
    exact = reference.attention(q, k, v, sinks=sinks)[0].transpose(1, 2)
    assert rel_err(ours, exact) > 1e-3


def test_reference_is_gpt_oss_eager_attention() -> None:
    """The reference's sinks are transformers' gpt-oss eager attention (its concatenated logit)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss

    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=1)
    module = modeling_gpt_oss.GptOssAttention(config, 0).double()
    with torch.no_grad():
        module.sinks.copy_(_sinks(4, torch.float64))
    B, Tq, Tk = 2, 5, 12
    q, k, v = (t.detach() for t in _operands(B, 4, 2, Tq, Tk, 16, torch.float64))
    mask = _key_mask("left", B, Tk)
    mask[:, -1] = True
    position = torch.arange(Tk - Tq, Tk)[:, None]
    allowed = (torch.arange(Tk)[None, :] <= position) & mask[:, None, None, :]  # (B, 1, Tq, Tk)
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    eager, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    ours, _ = reference.attention(q, k, v, key_mask=mask, scale=0.25, sinks=module.sinks.detach())
    assert rel_err(ours.transpose(1, 2), eager) <= 1e-14


def test_gradcheck_and_gradgradcheck() -> None:
    """First and second derivatives (the second through the reference), the sinks' included."""
    q, k, v = _operands(1, 4, 2, 3, 6, 2, torch.float64)
    sinks = _sinks(4, torch.float64).detach().mul(0.1).requires_grad_()
    mask = torch.tensor([[False, True, True, False, True, True]])
    fn = lambda a, b, c, s: _ops.attention_heads(a, b, c, mask, window=3, softcap=1.5, scale=0.7, sinks=s)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, sinks), fast_mode=True)


def test_compile_export_and_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _operands(2, 4, 2, 3, 20, 16, torch.float32, layout="bthd")
    sinks = _sinks(4, torch.float32)
    mask = _key_mask("left", 2, 20)
    fn = lambda a, b, c, m, s: _ops.attention_heads(a, b, c, m, window=8, sinks=s)  # noqa: E731
    eager = fn(q, k, v, mask, sinks)
    g = torch.randn_like(eager)
    expected = torch.autograd.grad(eager, (q, k, v, sinks), g)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)(q, k, v, mask, sinks)
    assert torch.equal(compiled, eager)
    *grads, d_sinks = torch.autograd.grad(compiled, (q, k, v, sinks), g)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert rel_err(d_sinks, expected[3]) <= 1e-6  # a reduction Inductor compiles: its own summation order
    torch._dynamo.reset()
    dynamic = torch.compile(fn, fullgraph=True, dynamic=True)(q, k, v, mask, sinks)  # symbolic B, T
    assert torch.equal(dynamic, eager)
    assert rel_err(torch.autograd.grad(dynamic, sinks, g)[0], expected[3]) <= 1e-6

    class Layer(torch.nn.Module):
        def forward(self, a: Tensor, b: Tensor, c: Tensor, m: Tensor, s: Tensor) -> Tensor:
            return fn(a, b, c, m, s)

    exported = torch.export.export(Layer(), tuple(t.detach() for t in (q, k, v)) + (mask, sinks.detach()))
    assert torch.equal(exported.module()(q.detach(), k.detach(), v.detach(), mask, sinks.detach()), eager.detach())
    with FakeTensorMode():
        fq, fk = torch.empty(2, 8, 5, 64, dtype=torch.bfloat16), torch.empty(2, 2, 9, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.causal_attention.attention_heads_forward(fq, fk, fk, None, sinks=torch.empty(8))
        ds = torch.ops.causal_attention.attention_sinks_backward(out, out, lse, torch.empty(8))
    assert out.shape == (2, 5, 8, 64) and lse.shape == (2, 8, 5) and ds.shape == (8,)


@pytest.mark.parametrize(
    "sinks, message",
    [
        (torch.zeros(3), r"sinks must be a floating tensor of shape \(H,\) = \(4,\)"),
        (torch.zeros(1, 4), r"sinks must be a floating tensor of shape \(H,\) = \(4,\)"),
        (torch.zeros(4, dtype=torch.long), r"sinks must be a floating tensor of shape \(H,\) = \(4,\)"),
    ],
    ids=["length", "2-D", "integer"],
)
def test_bad_sinks_are_named(sinks: Tensor, message: str) -> None:
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=message):
        torch.ops.causal_attention.attention_heads_forward(q, k, k, None, sinks=sinks)
    with pytest.raises(ValueError, match="sinks must be a floating"):
        reference.attention(q, k, k, sinks=sinks)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    sizes=st.tuples(st.integers(1, 3), st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3)]), st.integers(1, 40),
                    st.integers(0, 90), st.integers(1, 24)),
    window=st.one_of(st.none(), st.integers(1, 50)),
    sink_scale=st.sampled_from([0.0, 1.0, 30.0]),
    data=st.data(),
)
def test_drawn_shapes_match_the_reference(sizes: tuple[Any, ...], window: int | None, sink_scale: float,
                                          data: st.DataObject) -> None:
    """Drawn sizes (queries ending a past of any length, the streaming and the tiled route), windows, sink
    magnitudes and key masks with holes: float64 output and gradients equal the reference's."""
    B, (H, Hkv), Tq, past, hd = sizes
    Tk = Tq + past
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, torch.float64)
    sinks = (torch.randn(H, dtype=torch.float64) * sink_scale).requires_grad_()
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=Tk, max_size=Tk), min_size=B,
                                           max_size=B)), dtype=torch.bool).view(B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64)
    options = {} if window is None else {"window": window}
    ours = _engine(q, k, v, mask, sinks, g, **options)
    exact = _reference(q, k, v, mask, sinks, g, **options)
    for what, a, e in zip(("out", "dq", "dk", "dv", "dsinks"), ours, exact):
        assert rel_err(a, e) <= 1e-12, what
