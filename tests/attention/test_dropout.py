"""Attention-weight dropout (CausalSelfAttention(..., dropout=p)) inside the fused kernels.

The keep decisions are a pure function of (seed, b, h, i, j); torch.ops.causal_attention.dropout_keep_mask
gives them, so the engine is checked exactly against the reference with the same mask, and the
mask itself statistically.
"""

from __future__ import annotations

import math

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import _ops, reference
from helpers import TOL, rel_err

ops = torch.ops.causal_attention


def _seed(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def _mask(kind: str, B: int, T: int) -> torch.Tensor | None:
    """'none'; 'right': sequence 1 padded from T // 2 on; 'empty': sequence 1 starts with padding
    (its first queries have no allowed key) and the last sequence is all padding."""
    if kind == "none":
        return None
    mask = torch.ones(B, T, dtype=torch.bool)
    if kind == "right":
        mask[1, max(1, T // 2) :] = False
    elif kind == "empty":
        mask[1, : (T + 1) // 2] = False
        mask[-1] = False
    return mask


def _engine_and_reference(qkv, mask, H, p, seed, *, op=_ops.attention, grad_out=None):  # type: ignore[no-untyped-def]
    """(out, grad_qkv) of the engine and of the reference with the engine's keep mask, same dtype."""
    B, T = qkv.shape[:2]
    keep = ops.dropout_keep_mask(seed, B, H, T, p)
    if grad_out is None:
        grad_out = torch.randn(B, T, qkv.shape[2] // 3)
    grad_out = grad_out.to(qkv.dtype)
    results = []
    for fn in (lambda x: op(x, mask, H, p, seed), lambda x: reference.attention_core(x, mask, H, dropout_p=p, keep=keep)[0]):
        x = qkv.detach().clone().requires_grad_()
        y = fn(x)
        y.backward(grad_out)
        results.append((y.detach(), x.grad))
    return results


@pytest.mark.parametrize("mask_kind", ["none", "right", "empty"])
@pytest.mark.parametrize("hd", [8, 64])
@pytest.mark.parametrize("T", [1, 7, 113, 300])
def test_float64_equals_reference_with_the_same_mask(T, hd, mask_kind):
    B, H, p = 3, 2, 0.3
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    mask = _mask(mask_kind, B, T)
    for op in (_ops.attention, ops.attention):  # the torch.library autograd and the C++ one
        (y, g), (y_ref, g_ref) = _engine_and_reference(qkv, mask, H, p, _seed(T * hd), op=op)
        assert rel_err(y, y_ref) <= 1e-12
        assert rel_err(g, g_ref) <= 1e-12
        if mask_kind == "empty":  # rows with no allowed key: zero output and zero gradient
            assert (y[-1] == 0).all() and (g[-1] == 0).all()
            assert (y[1, : (T + 1) // 2] == 0).all()


@pytest.mark.parametrize("mask_kind", ["none", "right"])
@pytest.mark.parametrize("T", [113, 300])
def test_float32_equals_reference_with_the_same_mask(T, mask_kind):
    B, H, hd, p = 2, 2, 64, 0.2
    qkv = torch.randn(B, T, 3 * H * hd)
    (y, g), (y_ref, g_ref) = _engine_and_reference(qkv, _mask(mask_kind, B, T), H, p, _seed(T))
    assert rel_err(y, y_ref) <= TOL[torch.float32]
    assert rel_err(g, g_ref) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("T", [113, 300])
def test_half_precision_error_within_the_reference_at_that_precision(dtype, T):
    """Error against the float64 truth with the same mask <= 1.5x the reference run in dtype."""
    B, H, hd, p = 2, 2, 64, 0.1
    qkv = torch.randn(B, T, 3 * H * hd).to(dtype)
    mask = _mask("right", B, T)
    grad_out = torch.randn(B, T, H * hd)
    (y, g), (y_low, g_low) = _engine_and_reference(qkv, mask, H, p, _seed(T), grad_out=grad_out)
    _, (y_t, g_t) = _engine_and_reference(qkv.double(), mask, H, p, _seed(T), grad_out=grad_out)
    assert y.dtype == dtype and torch.isfinite(y).all() and torch.isfinite(g).all()

    def err(a: torch.Tensor, truth: torch.Tensor) -> float:
        return ((a.double() - truth).abs().max() / truth.abs().max()).item()

    assert err(y, y_t) <= 1.5 * err(y_low, y_t)
    assert err(g, g_t) <= 1.5 * err(g_low, g_t)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    """The keep rate over 2^21 decisions (several seeds, batches, heads, rows, columns) is within
    5 binomial standard deviations of 1 - p, overall and for each of the four Philox words."""
    B, H, T = 2, 4, 512
    keeps = torch.stack([ops.dropout_keep_mask(_seed(s), B, H, T, p) for s in (1, 2)])  # (2, B, H, T, T)
    n = keeps.numel()
    assert abs(keeps.double().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)
    by_word = keeps.unflatten(3, (T // 4, 4)).double().mean((0, 1, 2, 3, 5))  # rows i % 4
    assert (by_word - (1 - p)).abs().max().item() <= 5 * math.sqrt(p * (1 - p) / (n / 4))
    # Different seeds, batches and heads give different masks.
    assert not torch.equal(keeps[0], keeps[1])
    assert not torch.equal(keeps[0, 0, 0], keeps[0, 0, 1]) and not torch.equal(keeps[0, 0, 0], keeps[0, 1, 0])


def test_keep_mask_does_not_depend_on_the_sequence_length():
    """keep[b, h, i, j] is a function of (seed, b, h, i, j): a shorter T gives the leading block."""
    long = ops.dropout_keep_mask(_seed(9), 2, 3, 300, 0.4)
    short = ops.dropout_keep_mask(_seed(9), 2, 3, 113, 0.4)
    assert torch.equal(long[..., :113, :113], short)


def test_expected_output_is_the_no_dropout_output():
    """E over seeds of the output is the output without dropout (the 1 / (1 - p) scaling).

    out[i] = sum_j P_ij keep_ij v_j / (1 - p) with independent keeps has mean sum_j P_ij v_j and
    variance p / (1 - p) * sum_j P_ij^2 v_j^2. The mean over S seeds, standardised by that exact
    variance, is ~ N(0, 1) per element; among ~8e3 elements the largest |z| stays below 6 (a
    normal exceeds 6 with probability 2e-9 per element).
    """
    B, T, H, hd, p, S = 2, 64, 2, 32, 0.3, 400
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    mask = _mask("empty", B, T)
    exact, weights = reference.attention_core(qkv, mask, H, return_weights=True)
    mean = sum(ops.attention(qkv, mask, H, p, _seed(s)) for s in range(S)) / S
    v = qkv[..., 2 * H * hd :].view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
    var = p / (1 - p) * (weights**2 @ v**2)  # (B, H, T, hd)
    var = var.transpose(1, 2).reshape(B, T, H * hd)
    z = torch.where(var > 0, (mean - exact) / (var / S).sqrt(), mean - exact)
    assert z.abs().max().item() < 6
    assert z.abs().mean().item() < 1.0  # E|N(0, 1)| = 0.8: a biased scaling would shift every z


def _layer(dropout: float, dtype: torch.dtype = torch.float64, **kwargs) -> CausalSelfAttention:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return CausalSelfAttention(32, 4, dropout=dropout, dtype=dtype, **kwargs)


def _out_and_grads(attn: CausalSelfAttention, x: torch.Tensor, mask: torch.Tensor | None):  # type: ignore[no-untyped-def]
    attn.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = attn(x, mask)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad.clone() for p in attn.parameters()]


def test_eval_mode_and_zero_probability_are_bitwise_the_exact_path():
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    mask = _mask("right", 2, 70)
    exact = _out_and_grads(_layer(0.0), x, mask)
    assert all(torch.equal(a, b) for a, b in zip(_out_and_grads(_layer(0.0), x, mask), exact))
    assert all(torch.equal(a, b) for a, b in zip(_out_and_grads(_layer(0.5).eval(), x, mask), exact))
    qkv = torch.randn(2, 70, 96)
    assert torch.equal(ops.attention(qkv, None, 4, 0.0, _seed(1)), ops.attention(qkv, None, 4))
    assert torch.equal(_ops.attention(qkv, None, 4, 0.0), _ops.attention(qkv, None, 4))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_manual_seed_reproduces_outputs_and_gradients(backend):
    attn = _layer(0.2, backend=backend)
    x = torch.randn(2, 50, 32, dtype=torch.float64)
    mask = _mask("right", 2, 50)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(_out_and_grads(attn, x, mask))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(_out_and_grads(attn, x, mask)[0], runs[0][0])  # the next call: a new mask
    assert not torch.equal(runs[0][0], _out_and_grads(attn.eval(), x, mask)[0])


def test_cpp_and_reference_backends_draw_the_same_mask():
    """Both draw the seed from torch's generator at the same point: the same dropout, to rounding."""
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    mask = _mask("right", 2, 40)
    torch.manual_seed(7)
    ours = _out_and_grads(_layer(0.3, backend="cpp"), x, mask)
    torch.manual_seed(7)
    ref = _out_and_grads(_layer(0.3, backend="reference"), x, mask)
    assert all(rel_err(a, b) <= 1e-12 for a, b in zip(ours, ref))


def test_thread_count_does_not_change_the_result():
    """The dropout draws and the attention with its gradient, bit for bit at 1, 2 and 3 threads; and the
    layer's output. (Not the projections' gradients: those are MKL's sums over the tokens, which on
    Intel CPUs split between the threads: torch's own x^T g differs at 3 threads.)"""
    attn = _layer(0.1, torch.float32)
    x = torch.randn(2, 300, 32)
    qkv = torch.randn(2, 300, 96, requires_grad=True)
    mask = _mask("right", 2, 300)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            layer_out = _out_and_grads(attn, x, mask)[0]
            torch.manual_seed(5)
            out = torch.ops.causal_attention.attention(qkv, mask, 4, 0.1)
            (grad,) = torch.autograd.grad(out, qkv, torch.ones_like(out))
            runs.append([layer_out, out.detach(), grad])
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


@pytest.mark.parametrize("mask_kind", ["none", "right", "empty"])
def test_gradcheck_with_a_fixed_seed(mask_kind):
    B, T, H, hd, p = 2, 9, 2, 4, 0.4
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64, requires_grad=True)
    mask = _mask(mask_kind, B, T)
    seed = _seed(42)
    assert torch.autograd.gradcheck(lambda t: _ops.attention(t, mask, H, p, seed), (qkv,))
    assert torch.autograd.gradcheck(lambda t: ops.attention(t, mask, H, p, seed), (qkv,))


def test_gradgradcheck_with_a_fixed_seed():
    B, T, H, hd, p = 2, 5, 2, 2, 0.4
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64, requires_grad=True)
    mask = _mask("empty", B, T)
    seed = _seed(42)
    assert torch.autograd.gradgradcheck(lambda t: _ops.attention(t, mask, H, p, seed), (qkv,))
    assert torch.autograd.gradgradcheck(lambda t: ops.attention(t, mask, H, p, seed), (qkv,))


def test_double_backward_uses_the_forward_mask():
    """create_graph=True: the second derivative is the reference's with the same keep mask."""
    B, T, H, hd, p = 2, 11, 2, 4, 0.3
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    seed = _seed(3)
    keep = ops.dropout_keep_mask(seed, B, H, T, p)

    def second(fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = qkv.clone().requires_grad_()
        (g,) = torch.autograd.grad((fn(x) ** 2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g**2).sum(), x)
        return gg

    ref = second(lambda x: reference.attention_core(x, None, H, dropout_p=p, keep=keep)[0])
    for op in (_ops.attention, ops.attention):
        assert rel_err(second(lambda x: op(x, None, H, p, seed)), ref) <= 1e-10


def test_vmap_with_an_explicit_seed_equals_a_loop():
    """With the seed passed in, vmap is a loop over the slices (each slice's b is its own)."""
    N, B, T, H, hd, p = 3, 2, 20, 2, 8, 0.25
    qkv = torch.randn(N, B, T, 3 * H * hd, dtype=torch.float64)
    seed = _seed(8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return _ops.attention(x, None, H, p, seed)

    looped = torch.stack([f(x) for x in qkv])
    assert torch.equal(torch.vmap(f)(qkv), looped)
    g = torch.randn_like(looped)
    grads = torch.vmap(lambda x, go: torch.func.vjp(f, x)[1](go)[0])(qkv, g)
    assert torch.equal(grads, torch.stack([torch.func.vjp(f, x)[1](go)[0] for x, go in zip(qkv, g)]))


def test_vmap_drawing_the_seed_follows_torch_randomness_modes():
    qkv = torch.randn(3, 2, 20, 48, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        return _ops.attention(x, None, 2, 0.5)  # draws its seed from torch's generator

    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(f)(qkv)
    same = torch.vmap(f, randomness="same")(qkv[[0, 0, 0]])
    assert torch.equal(same[0], same[1])
    different = torch.vmap(f, randomness="different")(qkv[[0, 0, 0]])
    assert not torch.equal(different[0], different[1])


def test_compiled_layer_trains_with_dropout():
    """torch.compile(fullgraph=True) in training mode: runs, finite gradients, reproducible under
    torch.manual_seed, and equal to eager when inductor draws the seed with torch's own generator."""
    torch._dynamo.reset()
    attn = _layer(0.2, torch.float32)
    x = torch.randn(2, 40, 32)
    mask = _mask("right", 2, 40)
    compiled = torch.compile(attn, fullgraph=True)
    runs = []
    for _ in range(2):
        torch.manual_seed(1)
        runs.append(_out_and_grads(compiled, x, mask))
    assert all(torch.isfinite(t).all() for t in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][0], _out_and_grads(attn.eval(), x, mask)[0])
    attn.train()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(1)
        compiled_run = _out_and_grads(torch.compile(attn, fullgraph=True), x, mask)
    torch.manual_seed(1)
    eager_run = _out_and_grads(attn, x, mask)
    assert all(rel_err(a, b) <= TOL[torch.float32] for a, b in zip(compiled_run, eager_run))
    torch._dynamo.reset()


def test_sdpa_backend_drops_in_training_only():
    attn = _layer(0.5, backend="sdpa")
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    mask = _mask("right", 2, 30)
    train = attn(x, mask)
    exact = attn.eval()(x, mask)
    assert not torch.equal(train, exact)
    assert torch.equal(exact, _layer(0.0, backend="sdpa")(x, mask))


def test_cache_path_never_drops():
    attn = _layer(0.5)  # training mode
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        prefill = attn(x, cache=attn.make_cache(2, 16))
        exact = attn.eval()(x)
    assert rel_err(prefill, exact) <= 1e-12


def test_return_weights_are_the_dropped_weights():
    attn = _layer(0.3)
    x = torch.randn(2, 25, 32, dtype=torch.float64)
    torch.manual_seed(4)
    out, weights = attn(x, return_weights=True)
    torch.manual_seed(4)
    assert rel_err(out, attn(x)) <= 1e-12  # the same seed: the engine's mask
    assert (weights == 0).sum() > (torch.ones(25, 25).triu(1) == 1).sum() * 2 * 4  # dropped ones too


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_outside_zero_one_is_a_value_error(bad):
    with pytest.raises(ValueError, match="dropout"):
        CausalSelfAttention(32, 4, dropout=bad)
    qkv = torch.randn(1, 4, 96)
    with pytest.raises(ValueError, match="dropout"):
        ops.attention_forward(qkv, None, 4, bad, _seed(0))
    with pytest.raises(ValueError, match="dropout"):
        ops.attention(qkv, None, 4, bad)
    with pytest.raises(ValueError, match="dropout"):
        reference.attention_core(qkv, None, 4, dropout_p=bad, keep=torch.ones(1, 4, 4, 4, dtype=torch.bool))


def test_dropout_argument_errors():
    with pytest.raises(TypeError, match="dropout"):
        CausalSelfAttention(32, 4, dropout="0.1")  # type: ignore[arg-type]
    qkv = torch.randn(1, 4, 96)
    with pytest.raises(ValueError, match="seed"):
        ops.attention_forward(qkv, None, 4, 0.1)
    with pytest.raises(ValueError, match="one element"):
        ops.attention_forward(qkv, None, 4, 0.1, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        ops.attention_forward(qkv, None, 4, 0.1, torch.zeros(()))
    assert "dropout=0.1" in repr(CausalSelfAttention(32, 4, dropout=0.1))
