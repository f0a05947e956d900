"""Attention over separate heads (attention_heads_forward / attention_heads_backward, _ops.attention_heads):
the call transformers makes. q (B, H, Tq, hd) ends k, v (B, Hkv, Tk, hd) (query i at key position
Tk - Tq + i), a (B, Tk) key mask with holes anywhere, any scale, a sliding window, a softcap. Held to
reference.attention in float64 and, at the working dtype, to what PyTorch's own SDPA achieves on the same
inputs; the fused qkv kernel is the same computation bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from causal_attention.attention import _ops, reference
from helpers import rel_err

# (B, H, Hkv, Tq, Tk, hd): prefill, decode steps and chunks against a past, GQA, MQA, the odd sizes.
SHAPES = [
    (2, 4, 4, 7, 7, 8),
    (2, 4, 2, 1, 113, 64),
    (3, 8, 2, 5, 300, 48),
    (2, 4, 1, 113, 113, 80),
    (1, 2, 2, 300, 600, 64),
    (2, 4, 2, 1025, 1025, 64),
    (2, 6, 3, 1, 1, 16),
]
OPTIONS = {
    "plain": {},
    "scale": {"scale": 0.3},
    "window": {"window": 37},
    "softcap": {"softcap": 2.0},
    "all": {"scale": 0.2, "window": 300, "softcap": 5.0},
}


def _key_mask(kind: str, B: int, Tk: int) -> Tensor | None:
    """None, left padding (a cache of a left-padded batch), or holes anywhere (unfilled slots)."""
    if kind == "none":
        return None
    if kind == "left":
        starts = torch.randint(0, Tk, (B, 1))
        return torch.arange(Tk)[None, :] >= starts
    return torch.rand(B, Tk) > 0.3


def _operands(B: int, H: int, Hkv: int, Tq: int, Tk: int, hd: int, dtype: torch.dtype, *, layout: str = "bhtd",
              magnitude: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    if layout == "bthd":  # transformers' query: a transposed view of (B, T, H, hd)
        q = torch.randn(B, Tq, H, hd, dtype=torch.float64).transpose(1, 2)
    else:
        q = torch.randn(B, H, Tq, hd, dtype=torch.float64)
    k = torch.randn(B, Hkv, Tk, hd, dtype=torch.float64)
    v = torch.randn(B, Hkv, Tk, hd, dtype=torch.float64)
    return tuple((t * magnitude).to(dtype).requires_grad_() for t in (q, k, v))  # type: ignore[return-value]


def _engine(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Tensor, **options: object) -> tuple[Tensor, ...]:
    out = _ops.attention_heads(q, k, v, mask, **options)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))


def _exact(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Tensor, **options: object) -> tuple[Tensor, ...]:
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference.attention(*x, key_mask=mask, **options)[0].transpose(1, 2)  # (B, Tq, H, hd)
    return (out.detach(), *torch.autograd.grad(out, x, g.double()))


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("mask_kind", ["none", "left", "holes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_H{}_Hkv{}_Tq{}_Tk{}_hd{}".format(*s))
def test_float64_matches_the_reference(shape: tuple[int, ...], mask_kind: str, option: str, layout: str) -> None:
    B, H, Hkv, Tq, Tk, hd = shape
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, torch.float64, layout=layout)
    mask = _key_mask(mask_kind, B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64)
    ours = _engine(q, k, v, mask, g, **OPTIONS[option])
    exact = _exact(q, k, v, mask, g, **OPTIONS[option])
    assert ours[0].shape == (B, Tq, H, hd)
    for what, a, e in zip(("out", "dq", "dk", "dv"), ours, exact):
        assert a.shape == e.shape and rel_err(a, e) <= 1e-12, what


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Tensor, *, scale: float | None = None,
          window: int | None = None) -> tuple[Tensor, ...]:
    """PyTorch's SDPA (enable_gqa) at the inputs' dtype with the same allowed pattern; rows without an
    allowed key given every key, then 0."""
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    position = torch.arange(Tk - Tq, Tk)[:, None]
    keys = torch.arange(Tk)[None, :]
    allowed = (keys <= position).expand(B, Tq, Tk)
    if window is not None:
        allowed = allowed & (position - keys < window)
    if mask is not None:
        allowed = allowed & mask[:, None, :]
    has_key = allowed.any(-1)  # (B, Tq)
    allowed = allowed | ~has_key[..., None]
    out = F.scaled_dot_product_attention(*x, attn_mask=allowed[:, None], scale=scale, enable_gqa=True)
    out = (out * has_key[:, None, :, None].to(out.dtype)).transpose(1, 2)
    return (out.detach(), *torch.autograd.grad(out, x, g))


@pytest.mark.parametrize("option", ["plain", "scale", "window"])
@pytest.mark.parametrize("hd", [8, 48, 64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_working_dtypes_are_as_exact_as_sdpa(dtype: torch.dtype, hd: int, option: str) -> None:
    """Against the float64 reference on the same rounded inputs: within 3x SDPA's error at the dtype, or
    two units of its last place; values in the tens, a left-padded past and a long row."""
    B, H, Hkv, Tq, Tk = 2, 8, 2, 130, 517
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, dtype, layout="bthd", magnitude=3.0)
    mask = _key_mask("left", B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64).to(dtype)
    options = OPTIONS[option]
    ours = _engine(q, k, v, mask, g, **options)
    exact = _exact(q, k, v, mask, g, **options)
    base = _sdpa(q, k, v, mask, g, **options)
    floor = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for what, a, e, s in zip(("out", "dq", "dk", "dv"), ours, exact, base):
        tol = max(floor, 3 * rel_err(s, e))
        assert rel_err(a, e) <= tol, f"{what}: {rel_err(a, e):.3g} > {tol:.3g}"


@pytest.mark.parametrize("Tq", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decode_steps_are_as_exact_as_sdpa(dtype: torch.dtype, Tq: int) -> None:
    """A few queries against a long left-padded past (the streaming route): within 3x SDPA's error at the
    dtype, forward and backward (the backward from the route's lse)."""
    B, H, Hkv, Tk, hd = 3, 8, 2, 700, 64
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, dtype, layout="bthd", magnitude=3.0)
    mask = _key_mask("left", B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64).to(dtype)
    ours = _engine(q, k, v, mask, g)
    exact = _exact(q, k, v, mask, g)
    base = _sdpa(q, k, v, mask, g)
    floor = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for what, a, e, s in zip(("out", "dq", "dk", "dv"), ours, exact, base):
        assert rel_err(a, e) <= max(floor, 3 * rel_err(s, e)), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_softcap_at_the_working_dtype_is_as_exact_as_eager(dtype: torch.dtype) -> None:
    """Gemma 2's softcap against the reference's own ops run at the dtype (transformers' eager)."""
    B, H, Hkv, Tq, Tk, hd = 2, 4, 2, 64, 200, 64
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, dtype, magnitude=3.0)
    mask = _key_mask("holes", B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64).to(dtype)
    options = {"softcap": 30.0, "scale": 0.1}
    ours = _engine(q, k, v, mask, g, **options)
    exact = _exact(q, k, v, mask, g, **options)
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = reference.attention(*x, key_mask=mask, **options)[0].transpose(1, 2)
    base = (eager.detach(), *torch.autograd.grad(eager, x, g))
    floor = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for what, a, e, s in zip(("out", "dq", "dk", "dv"), ours, exact, base):
        assert rel_err(a, e) <= max(floor, 3 * rel_err(s, e)), what


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_views_of_one_qkv_buffer_are_the_fused_kernel_bit_for_bit(dtype: torch.dtype) -> None:
    """q, k, v read as views of a qkv buffer compute what the fused qkv kernel computes, forward and
    backward, with GQA and padding: one kernel behind both entries."""
    B, T, H, Hkv, hd = 2, 300, 6, 2, 32
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd, dtype=torch.float64).to(dtype)
    mask = torch.rand(B, T) < 0.7
    mask[:, 0] = True
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=2)
    q, k, v = q.unflatten(2, (H, hd)).transpose(1, 2), k.unflatten(2, (Hkv, hd)).transpose(1, 2), \
        v.unflatten(2, (Hkv, hd)).transpose(1, 2)
    out, lse = torch.ops.causal_attention.attention_forward(qkv, mask, H, n_kv_heads=Hkv)
    out_h, lse_h = torch.ops.causal_attention.attention_heads_forward(q, k, v, mask)
    assert torch.equal(out_h.flatten(2), out) and torch.equal(lse_h, lse)
    g = torch.randn(B, T, H * hd, dtype=torch.float64).to(dtype)
    grad = torch.ops.causal_attention.attention_backward(g, qkv, mask, out, lse, H, n_kv_heads=Hkv)
    dq, dk, dv = torch.ops.causal_attention.attention_heads_backward(g.unflatten(2, (H, hd)), q, k, v, mask, out_h,
                                                                     lse_h)
    joined = torch.cat([t.transpose(1, 2).flatten(2) for t in (dq, dk, dv)], dim=2)
    assert torch.equal(joined, grad)


def test_the_gradient_keeps_transformers_query_layout() -> None:
    """A query transposed from (B, T, H, hd) gets its gradient in that layout (no copy to undo it)."""
    q, k, v = _operands(2, 4, 2, 9, 9, 16, torch.float32, layout="bthd")
    out = _ops.attention_heads(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.stride() == q.stride()


def test_dropout_takes_the_fused_kernels_decisions() -> None:
    """Training through transformers: dropout with Tq = Tk keeps the weights attention() keeps for the
    same seed, so both entries train alike."""
    B, T, H, hd = 2, 40, 4, 16
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.unflatten(2, (H, hd)).transpose(1, 2) for t in qkv.split(H * hd, dim=2))
    seed = torch.tensor(1234)
    fused = _ops.attention(qkv, None, H, dropout_p=0.3, seed=seed)
    heads = _ops.attention_heads(q, k, v, dropout_p=0.3, seed=seed).flatten(2)
    assert torch.equal(fused, heads)
    g = torch.randn_like(fused)
    (a,) = torch.autograd.grad(fused, qkv, g)
    (b,) = torch.autograd.grad(heads, qkv, g)
    assert rel_err(a, b) <= 1e-14


def test_rows_with_no_key_give_zero_and_masked_nan_does_not_leak() -> None:
    """Values that a query may not see (padding, later, older than the window) add exactly nothing to its
    output, even NaN; a query with no allowed key gives 0 and no gradient."""
    B, H, Tq, Tk, hd = 1, 2, 4, 10, 8
    q, k, v = (t.detach() for t in _operands(B, H, H, Tq, Tk, hd, torch.float32))
    mask = torch.ones(B, Tk, dtype=torch.bool)
    mask[0, :7] = False  # query 0 (position 6) sees nothing
    v[0, :, 2] = math.nan  # padding
    v[0, :, 9] = math.nan  # later than every query but the last (position 9), which sees it
    q.requires_grad_()
    out = _ops.attention_heads(q, k, v, mask, window=3)
    assert bool((out[0, 0] == 0).all())
    assert not out[0, 1:3].isnan().any()  # positions 7, 8: key 9 is later, key 2 padding
    assert out[0, 3].isnan().all()  # position 9 sees its own NaN key: NaN, as the reference
    v[0, :, 2] = v[0, :, 9] = 0  # (the backward's dP = dO v^T reads every value of a tile: finite ones here)
    out = _ops.attention_heads(q, k, v, mask, window=3)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert bool((dq[0, :, 0] == 0).all()) and dq.isfinite().all()


def test_key_blocks_older_than_the_window_are_never_read() -> None:
    """A window of 64 over 4096 keys: the key blocks that end before the first query's window (keys
    0..3839; query 4032, the first, sees 3969..4032) holding inf change neither the output nor the
    gradients: the passes skip them. (Read and masked, inf values would give NaN: 0 * inf.)"""
    q, k, v = _operands(1, 4, 2, 64, 4096, 64, torch.float32)
    g = torch.randn(1, 64, 4, 64)
    clean = _engine(q, k, v, None, g, window=64)
    with torch.no_grad():
        k[:, :, :3840] = math.inf
        v[:, :, :3840] = math.inf
    poisoned = _engine(q, k, v, None, g, window=64)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a[..., 3840:, :] if a.shape[-2] == 4096 else a, b[..., 3840:, :] if b.shape[-2] == 4096 else b)
    assert bool((poisoned[2][:, :, :3840] == 0).all()) and bool((poisoned[3][:, :, :3840] == 0).all())


def test_gradcheck_and_gradgradcheck() -> None:
    q, k, v = _operands(1, 4, 2, 3, 6, 2, torch.float64)
    mask = torch.tensor([[False, True, True, False, True, True]])
    fn = lambda a, b, c: _ops.attention_heads(a, b, c, mask, window=3, softcap=1.5, scale=0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True)


def test_compile_export_and_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _operands(2, 4, 2, 3, 20, 16, torch.float32, layout="bthd")
    mask = _key_mask("left", 2, 20)
    fn = lambda a, b, c, m: _ops.attention_heads(a, b, c, m, window=8, scale=0.25)  # noqa: E731
    eager = fn(q, k, v, mask)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)(q, k, v, mask)
    assert torch.equal(compiled, eager)

    class Layer(torch.nn.Module):
        def forward(self, a: Tensor, b: Tensor, c: Tensor, m: Tensor) -> Tensor:
            return fn(a, b, c, m)

    exported = torch.export.export(Layer(), tuple(t.detach() for t in (q, k, v)) + (mask,))
    assert torch.equal(exported.module()(q.detach(), k.detach(), v.detach(), mask), eager.detach())
    with FakeTensorMode():
        fq, fk = torch.empty(2, 8, 5, 64, dtype=torch.bfloat16), torch.empty(2, 2, 9, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.causal_attention.attention_heads_forward(fq, fk, fk, None)
        dq, dk, dv = torch.ops.causal_attention.attention_heads_backward(out, fq, fk, fk, None, out, lse)
    assert out.shape == (2, 5, 8, 64) and lse.shape == (2, 8, 5) and lse.dtype == torch.float32
    assert dq.shape == fq.shape and dk.shape == dv.shape == fk.shape


@pytest.mark.parametrize(
    "shapes, options, message",
    [
        (((1, 4, 3, 8), (1, 3, 5, 8)), {}, r"k's heads \(Hkv\) must divide q's heads"),
        (((1, 4, 6, 8), (1, 2, 5, 8)), {}, r"q's length \(6\) must not exceed k's \(5\)"),
        (((1, 4, 3, 8), (1, 2, 5, 4)), {}, r"k and v must both be \(B, Hkv, Tk, head_dim\)"),
        (((1, 4, 3), (1, 2, 5, 8)), {}, r"q, k, v must be 4-D"),
        (((1, 4, 3, 8), (1, 2, 5, 8)), {"window": 0}, r"window must be a positive number of keys; got 0"),
        (((1, 4, 3, 8), (1, 2, 5, 8)), {"softcap": -1.0}, r"softcap must be a positive finite number"),
        (((1, 4, 3, 8), (1, 2, 5, 8)), {"scale": math.inf}, r"scale must be a positive finite number"),
        (((1, 4, 3, 8), (1, 2, 5, 8)), {"dropout_p": 0.1, "seed": torch.tensor(1)}, r"dropout needs q and k of one"),
        (((1, 4, 3, 8), (1, 2, 5, 8)), {"key_mask": torch.ones(1, 3, dtype=torch.bool)},
         r"key_mask must be a bool tensor of shape \(B, Tk\) = \(1, 5\)"),
    ],
)
def test_bad_arguments_are_named(shapes: tuple[tuple[int, ...], ...], options: dict[str, object],
                                 message: str) -> None:
    q, k = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    key_mask = options.pop("key_mask", None)
    with pytest.raises(ValueError, match=message):
        torch.ops.causal_attention.attention_heads_forward(q, k, k, key_mask, **options)


def test_mixed_dtypes_are_named() -> None:
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="q, k, v must share one floating-point dtype"):
        torch.ops.causal_attention.attention_heads_forward(q, q.double(), q, None)


def test_nothing_to_differentiate_runs_the_op_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (generate's decode steps) the call is the op alone, bit for bit, without the autograd
    Function's per-call bookkeeping; with a tensor that requires grad it goes through the Function."""
    q, k, v = _operands(2, 4, 2, 1, 40, 16, torch.float32, layout="bthd")
    expected = torch.ops.causal_attention.attention_heads_forward(q.detach(), k.detach(), v.detach(), None)[0]
    calls = []
    apply = _ops._HeadsFunction.apply
    monkeypatch.setattr(_ops._HeadsFunction, "apply", lambda *args: calls.append(1) or apply(*args))
    with torch.no_grad():
        assert torch.equal(_ops.attention_heads(q, k, v), expected) and calls == []
    assert torch.equal(_ops.attention_heads(q.detach(), k.detach(), v.detach()), expected) and calls == []
    out = _ops.attention_heads(q, k, v)
    assert torch.equal(out.detach(), expected) and out.grad_fn is not None and calls == [1]


@pytest.mark.parametrize("window", [1, 3, 16, 17, 700, 5000])
@pytest.mark.parametrize("Tq", [2, 5, 16])
def test_a_few_queries_with_a_window_stream_as_the_reference(Tq: int, window: int) -> None:
    """A few queries against a long past with a sliding window take the streaming route: each query's keys
    start at its own window (the keys older than the last query's window row by row), windows shorter and
    longer than the queries, a context split across work items (B * H small), holes in the key mask."""
    B, H, Hkv, Tk, hd = 1, 2, 1, 4000, 32
    q, k, v = _operands(B, H, Hkv, Tq, Tk, hd, torch.float64, layout="bthd")
    mask = _key_mask("holes", B, Tk)
    g = torch.randn(B, Tq, H, hd, dtype=torch.float64)
    ours = _engine(q, k, v, mask, g, window=window)
    exact = _exact(q, k, v, mask, g, window=window)
    for what, a, e in zip(("out", "dq", "dk", "dv"), ours, exact):
        assert rel_err(a, e) <= 1e-12, what
    with torch.no_grad():  # float32 and bfloat16 through the same route, against the float64 reference
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            out = _ops.attention_heads(*(t.to(dtype) for t in (q, k, v)), mask, window=window).double()
            assert rel_err(out, exact[0]) <= tol, dtype
