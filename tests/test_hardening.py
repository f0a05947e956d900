"""The hardening issue's defects, each with the input that exposed it.

1. half precision: every tile product accumulates in float32 (no float16 overflow), and the error
   against the float64 truth is within 1.5x of F.scaled_dot_product_attention's at the same dtype;
2. checks that guard data hold under torch.compile (fullgraph) as in eager code;
3. the inference-only guard of the cache path covers every parameter and the input;
4. cache capacity is judged per sequence by its real new tokens;
5. decode results do not depend on the thread count;
6. torch.func transforms work on the default backend.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from causal_attention import CausalSelfAttention, _ops, backends, reference
from conftest import rel_err

HALF = [torch.float16, torch.bfloat16]
HALF_IDS = ["f16", "bf16"]


def _adversarial_qkv(B: int, T: int, H: int, hd: int, *, logit_std: float, v_max: float, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, 3 * H * hd): q, k with q.k / sqrt(hd) of standard deviation logit_std; v uniform in [-v_max, v_max]."""
    sigma = logit_std**0.5  # q.k / sqrt(hd) of iid N(0, sigma^2) entries has variance sigma^4
    q = torch.randn(B, T, H * hd) * sigma
    k = torch.randn(B, T, H * hd) * sigma
    v = (torch.rand(B, T, H * hd) * 2 - 1) * v_max
    return torch.cat([q, k, v], 2).to(dtype)


def _right_padding(B: int, T: int) -> torch.Tensor:
    lengths = torch.randint(T // 2 + 1, T + 1, (B,))
    return torch.arange(T)[None, :] < lengths[:, None]


def _forward_backward(fn, qkv: torch.Tensor, mask: torch.Tensor | None, H: int, grad_out: torch.Tensor):  # type: ignore[no-untyped-def]
    x = qkv.detach().clone().requires_grad_()
    y = fn(x, mask, H)
    y.backward(grad_out.to(y.dtype))
    return y.detach(), x.grad


def _err(a: torch.Tensor, truth: torch.Tensor) -> float:
    """max |a - truth| relative to max |truth| (both as float64)."""
    return ((a.double() - truth).abs().max() / truth.abs().max()).item()


def _ours(qkv: torch.Tensor, mask: torch.Tensor | None, H: int) -> torch.Tensor:
    return _ops.attention(qkv, mask, H)


def _truth(qkv: torch.Tensor, mask: torch.Tensor | None, H: int) -> torch.Tensor:
    return reference.attention_core(qkv, mask, H)[0]


# ---------------------------------------------------------------------------------------------
# 1. Half precision


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_float16_pv_product_does_not_overflow(dtype):
    """q = k = 0, v = 300, T = 512: every weight of row t is 1/(t+1) and the answer is 300 everywhere.
    Before the fix float16 gave inf from query 218 on (P V of a 256-key tile summed in float16)."""
    T, H, hd = 512, 2, 32
    qkv = torch.zeros(1, T, 3 * H * hd, dtype=dtype)
    qkv[..., 2 * H * hd :] = 300
    grad_out = torch.ones(1, T, H * hd)
    out, grad_qkv = _forward_backward(_ours, qkv, None, H, grad_out)
    assert torch.equal(out, torch.full_like(out, 300))
    _, grad_truth = _forward_backward(_truth, qkv.double(), None, H, grad_out.double())
    assert torch.isfinite(grad_qkv).all()
    assert _err(grad_qkv, grad_truth) <= 4 * torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_float16_module_and_cache_prefill_stay_finite(dtype, backend):
    """The same input through the whole layer and through a cache prefill (qkv = bias only)."""
    T, dim, H = 512, 64, 2
    attn = CausalSelfAttention(dim, H, backend=backend, dtype=dtype)
    with torch.no_grad():
        attn.qkv.weight.zero_()
        attn.qkv.bias.zero_()
        attn.qkv.bias[2 * dim :] = 300  # q = k = 0, v = 300
        attn.proj.weight.copy_(torch.eye(dim))
        attn.proj.bias.zero_()
    x = torch.randn(2, T, dim, dtype=dtype)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [300]])
    out = attn(x, mask)
    assert torch.equal(out, torch.full_like(out, 300))
    with torch.no_grad():
        prefill = attn(x, mask, cache=attn.make_cache(2, T))
    assert torch.equal(prefill, torch.full_like(prefill, 300))


# (T, B, H): the range of lengths, with the batch kept small where T x T is large.
HALF_SHAPES = [(1, 2, 2), (7, 2, 2), (113, 2, 2), (1025, 2, 2)]


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("logit_std, v_max", [(1.0, 1.0), (8.0, 1.0), (1.0, 1e3), (8.0, 1e3)])
@pytest.mark.parametrize("T, B, H", HALF_SHAPES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_half_precision_error_within_sdpa(dtype, T, B, H, logit_std, v_max, padded):
    """Forward and backward error against the float64 truth (same rounded inputs) <= 1.5x SDPA's."""
    _check_half_error(dtype, T, B, H, logit_std, v_max, padded)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_half_precision_error_within_sdpa_at_4096(dtype):
    _check_half_error(dtype, 4096, 1, 1, 8.0, 1e3, True)


def _check_half_error(dtype: torch.dtype, T: int, B: int, H: int, logit_std: float, v_max: float, padded: bool) -> None:
    hd = 64
    qkv = _adversarial_qkv(B, T, H, hd, logit_std=logit_std, v_max=v_max, dtype=dtype)
    mask = _right_padding(B, T) if padded else None
    grad_out = torch.randn(B, T, H * hd)
    out_t, grad_t = _forward_backward(_truth, qkv.double(), mask, H, grad_out.double())
    out_o, grad_o = _forward_backward(_ours, qkv, mask, H, grad_out)
    out_s, grad_s = _forward_backward(backends.RUN["sdpa"], qkv, mask, H, grad_out)
    assert out_o.dtype == dtype and grad_o.dtype == dtype
    assert torch.isfinite(out_o).all() and torch.isfinite(grad_o).all()
    assert _err(out_o, out_t) <= 1.5 * _err(out_s, out_t)
    assert _err(grad_o, grad_t) <= 1.5 * _err(grad_s, grad_t)


# ---------------------------------------------------------------------------------------------
# 2. Checks that guard data, eager and compiled


def _eager_and_compiled(fn):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    return [("eager", fn), ("compiled", torch.compile(fn, fullgraph=True))]


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_integer_mask_values_are_checked_compiled_too(backend):
    attn = CausalSelfAttention(16, 2, backend=backend)
    x = torch.randn(2, 3, 16)
    for mode, fn in _eager_and_compiled(lambda x, m: attn(x, m)):
        with pytest.raises(ValueError, match="must hold only 0 \\(padding\\) and 1"):
            fn(x, torch.tensor([[1, 2, 1], [1, 1, 0]]))
        ok = fn(x, torch.tensor([[1, 1, 1], [1, 1, 0]]))
        assert rel_err(ok, attn(x, torch.tensor([[True, True, True], [True, True, False]]))) <= 1e-6, mode


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_cache_checks_hold_compiled_too(backend):
    """Left padding with a cache was accepted when compiled (length 2, the padding's key kept as real);
    an overflowing cache indexed out of bounds inside inductor on the sdpa path."""
    attn = CausalSelfAttention(16, 2, backend=backend)
    for mode, step in _eager_and_compiled(lambda x, m, c: attn(x, m, cache=c)):
        with torch.no_grad():
            cache = attn.make_cache(1, 4)
            with pytest.raises(ValueError, match="must be right padding"):
                step(torch.randn(1, 3, 16), torch.tensor([[False, True, True]]), cache)
            assert cache.lengths.tolist() == [0] and torch.count_nonzero(cache.k) == 0, mode
            step(torch.randn(1, 3, 16), torch.tensor([[True, True, True]]), cache)
            before = cache.k.clone()
            with pytest.raises(ValueError, match="KV cache overflow: sequence 0 holds 3 tokens and 2 more"):
                step(torch.randn(1, 2, 16), torch.tensor([[True, True]]), cache)
            assert cache.lengths.tolist() == [3] and torch.equal(cache.k, before), mode


def test_gpt_position_check_holds_compiled_too():
    from causal_attention.gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2))
    for _, fn in _eager_and_compiled(lambda t: model(t)):
        with pytest.raises(RuntimeError, match="sequence longer than max_len=8"):
            fn(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# 3. The inference-only guard


@pytest.mark.parametrize("trainable", ["qkv.bias", "proj.weight", "proj.bias", "x"])
def test_cache_refuses_grad_mode_whatever_wants_a_gradient(trainable):
    """BitFit-style: qkv.weight frozen, a bias trainable. Before the fix the cache call ran and the
    bias silently got no gradient."""
    attn = CausalSelfAttention(16, 2)
    for p in attn.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 1, 16)
    if trainable == "x":
        x.requires_grad_()
    else:
        attn.get_parameter(trainable).requires_grad_()
    with pytest.raises(ValueError, match=f"the KV cache is for inference, but {trainable} require"):
        attn(x, cache=attn.make_cache(2, 4))
    with torch.no_grad():
        attn(x, cache=attn.make_cache(2, 4))  # fine without grad mode


# ---------------------------------------------------------------------------------------------
# 4. Capacity per sequence


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_a_full_sequence_does_not_block_the_batch(backend):
    """lengths [4, 1], max_len 4; a step with mask [[False], [True]] leaves sequence 0 untouched.
    Before the fix: "sequence 0 holds 4 tokens and 1 more do not fit"."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, backend=backend, dtype=torch.float64)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.make_cache(2, 4)
        attn(x, torch.tensor([[True] * 4, [True, False, False, False]]), cache=cache)
        k0, v0 = cache.k[0].clone(), cache.v[0].clone()
        y = attn(x[:, 1:2], torch.tensor([[False], [True]]), cache=cache)
        assert cache.lengths.tolist() == [4, 2]
        assert torch.equal(cache.k[0], k0) and torch.equal(cache.v[0], v0)
        full = attn(x[1:, :2])  # sequence 1 alone: tokens 0 and 1
        assert rel_err(y[1, 0], full[0, 1]) <= 1e-12
        with pytest.raises(ValueError, match="sequence 0 holds 4 tokens and 1 more do not fit in max_len=4"):
            attn(x[:, :1], cache=cache)
        assert cache.lengths.tolist() == [4, 2]


def test_kv_cache_write_writes_only_real_tokens():
    B, H, hd, L, t = 2, 2, 4, 6, 3
    qkv = torch.randn(B, t, 3 * H * hd)
    k, v = torch.zeros(B, H, L, hd), torch.zeros(B, H, L, hd)
    start, end = torch.tensor([0, 5]), torch.tensor([2, 5])
    torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, end, H)
    new_k = qkv[..., H * hd : 2 * H * hd].view(B, t, H, hd).transpose(1, 2)
    assert torch.equal(k[0, :, :2], new_k[0, :, :2]) and torch.count_nonzero(k[0, :, 2:]) == 0
    assert torch.count_nonzero(k[1]) == 0
    with pytest.raises(ValueError, match="KV cache overflow: sequence 1 holds 5 tokens and 2 more"):
        torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, torch.tensor([2, 7]), H)
    with pytest.raises(ValueError, match="must satisfy 0 <= start <= end <= start \\+ new tokens"):
        torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, torch.tensor([4, 5]), H)


# ---------------------------------------------------------------------------------------------
# 5. Decode and the thread count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t_new", [1, 4, 40])
def test_decode_is_bitwise_independent_of_the_thread_count(dtype, t_new):
    """B * H small and a long context: the context is split. Before the fix the split came from
    at::get_num_threads() and 1 and 2 threads differed by 6e-8."""
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


# ---------------------------------------------------------------------------------------------
# 6. torch.func


def _layer_and_reference(dtype: torch.dtype = torch.float64):  # type: ignore[no-untyped-def]
    attn = CausalSelfAttention(24, 3, dtype=dtype)
    params = {k: v.detach() for k, v in attn.named_parameters()}

    def ours(p, x, mask=None):  # type: ignore[no-untyped-def]
        return functional_call(attn, p, (x, mask))

    def spec(p, x, mask=None):  # type: ignore[no-untyped-def]
        return reference.causal_self_attention(x, p["qkv.weight"], p["qkv.bias"], p["proj.weight"], p["proj.bias"], 3, mask)

    return attn, params, ours, spec


def test_func_grad_and_vjp_match_the_reference():
    attn, params, ours, spec = _layer_and_reference()
    assert attn.backend == "auto" and backends.select_backend(torch.zeros(1, 1, 72, dtype=torch.float64), "auto") == "cpp"
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mask = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]]).bool()
    loss = lambda f: lambda p, x: f(p, x, mask).pow(2).sum()  # noqa: E731
    g, g_ref = grad(loss(ours), argnums=(0, 1))(params, x), grad(loss(spec), argnums=(0, 1))(params, x)
    for name in params:
        assert rel_err(g[0][name], g_ref[0][name]) <= 1e-10, name
    assert rel_err(g[1], g_ref[1]) <= 1e-10
    out, pullback = vjp(lambda x: ours(params, x, mask), x)
    out_ref, pullback_ref = vjp(lambda x: spec(params, x, mask), x)
    cotangent = torch.randn_like(out)
    assert rel_err(out, out_ref) <= 1e-10
    assert rel_err(pullback(cotangent)[0], pullback_ref(cotangent)[0]) <= 1e-10


def test_func_jacrev_matches_the_reference_and_is_causal():
    _, params, ours, spec = _layer_and_reference()
    x = torch.randn(1, 5, 24, dtype=torch.float64)
    J = jacrev(lambda x: ours(params, x))(x)  # (1, 5, 24, 1, 5, 24)
    assert rel_err(J, jacrev(lambda x: spec(params, x))(x)) <= 1e-10
    for t in range(5):
        assert torch.count_nonzero(J[0, t, :, 0, t + 1 :]) == 0  # no output depends on a later input


def test_vmap_over_the_layer():
    attn, params, ours, spec = _layer_and_reference()
    xs = torch.randn(3, 2, 6, 24, dtype=torch.float64)
    masks = torch.rand(3, 2, 6) < 0.7
    masks[..., 0] = True
    y = vmap(lambda x, m: attn(x, m))(xs, masks)
    assert rel_err(y, torch.stack([spec(params, x, m) for x, m in zip(xs, masks)])) <= 1e-10
    # Per-example gradients: vmap over grad.
    per_example = vmap(grad(lambda p, x: ours(p, x[None]).sum()), in_dims=(None, 0))(params, xs[0])
    for i in range(2):
        one = grad(lambda p: ours(p, xs[0, i : i + 1]).sum())(params)
        assert rel_err(per_example["qkv.weight"][i], one["qkv.weight"]) <= 1e-10


def test_double_backward_matches_the_reference():
    """create_graph=True differentiates the reference (documented: it materialises T x T)."""
    attn, params, _, spec = _layer_and_reference()
    x = torch.randn(2, 9, 24, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(attn(x).pow(2).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.pow(2).sum(), x)
    x_ref = x.detach().requires_grad_()
    (g_ref,) = torch.autograd.grad(spec(params, x_ref).pow(2).sum(), x_ref, create_graph=True)
    (h_ref,) = torch.autograd.grad(g_ref.pow(2).sum(), x_ref)
    assert rel_err(h, h_ref) <= 1e-10


def test_forward_mode_jvp_and_jacfwd_match_the_reference():
    """Forward-mode AD differentiates the reference (as the double backward does), with and without a mask."""
    _, params, ours, spec = _layer_and_reference()
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [0, 1, 1, 1, 0, 0]]).bool()  # a row with no key, and padding
    tangent = torch.randn_like(x)
    out, out_t = jvp(lambda x: ours(params, x, mask), (x,), (tangent,))
    ref, ref_t = jvp(lambda x: spec(params, x, mask), (x,), (tangent,))
    assert rel_err(out, ref) <= 1e-10 and rel_err(out_t, ref_t) <= 1e-10
    x1, mask1 = x[1:], mask[1:]
    J = jacfwd(lambda x: ours(params, x, mask1))(x1)  # (1, 6, 24, 1, 6, 24)
    assert rel_err(J, jacfwd(lambda x: spec(params, x, mask1))(x1)) <= 1e-10
    assert rel_err(J, jacrev(lambda x: ours(params, x, mask1))(x1)) <= 1e-10
    for t in range(5):
        assert torch.count_nonzero(J[0, t, :, 0, t + 1 :]) == 0  # no output depends on a later input
    # The parameters' tangents too.
    p_t = {k: torch.randn_like(v) for k, v in params.items()}
    _, ours_pt = jvp(lambda p: ours(p, x, mask), (params,), (p_t,))
    _, spec_pt = jvp(lambda p: spec(p, x, mask), (params,), (p_t,))
    assert rel_err(ours_pt, spec_pt) <= 1e-10


def test_hessian_matches_the_reference():
    """hessian = jacfwd(jacrev): forward mode over the fused backward."""
    _, params, ours, spec = _layer_and_reference()
    x = torch.randn(1, 4, 24, dtype=torch.float64)
    loss = lambda f: lambda x: f(params, x).pow(2).sum()  # noqa: E731
    H = hessian(loss(ours))(x)  # (1, 4, 24, 1, 4, 24)
    assert rel_err(H, hessian(loss(spec))(x)) <= 1e-10


def test_forward_mode_with_dropout_uses_the_forward_decisions():
    torch.manual_seed(5)
    qkv = torch.randn(2, 9, 3 * 16, dtype=torch.float64)
    seed = torch.tensor(1234)
    tangent = torch.randn_like(qkv)
    _, out_t = jvp(lambda q: _ops.attention(q, None, 2, 0.3, seed), (qkv,), (tangent,))
    keep = torch.ops.causal_attention.dropout_keep_mask(seed, 2, 2, 9, 0.3)
    _, ref_t = jvp(lambda q: reference.attention_core(q, None, 2, dropout_p=0.3, keep=keep)[0], (qkv,), (tangent,))
    assert rel_err(out_t, ref_t) <= 1e-10


def test_raw_kernel_refuses_to_be_differentiated():
    """The raw forward op has no derivative of its own: differentiating it is an error, not zeros."""
    qkv = torch.randn(1, 4, 24, requires_grad=True)
    out, _ = torch.ops.causal_attention.attention_forward(qkv, None, 2)
    with pytest.raises(RuntimeError, match="not implemented"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# Meta kernels live in the library: tracing needs only torch.ops.load_library


def test_ops_trace_with_only_the_library_loaded(tmp_path):
    """A user of torch.ops.load_library (no causal_attention import) compiles (fullgraph) and
    exports code that calls every op: the Meta kernels are registered by the library itself."""
    import subprocess
    import sys
    from pathlib import Path

    import causal_attention

    library = Path(causal_attention.__file__).with_name("libcausal_attention.so")
    script = f"""
import sys, torch
torch.ops.load_library({str(library)!r})
assert "causal_attention" not in sys.modules
ops = torch.ops.causal_attention

def step(qkv, mask, k, v, lengths):
    out, lse = ops.attention_forward(qkv, ops.mask_to_bool(mask), 2)
    end = ops.cache_end(lengths, None, qkv.shape[1], k.shape[2])
    ops.kv_cache_write(qkv, k, v, lengths, end, 2)
    return out, lse, ops.decode_attention(qkv, k, v, lengths, end, 2), ops.attention(qkv, None, 2)

qkv = torch.randn(2, 3, 24)
mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
args = lambda: (qkv, mask, torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4), torch.tensor([0, 2]))
eager = step(*args())
compiled = torch.compile(step, fullgraph=True)(*args())
assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
class M(torch.nn.Module):
    def forward(self, qkv, mask):
        return ops.attention_forward(qkv, ops.mask_to_bool(mask), 2)[0]
B = torch.export.Dim("B")
T = torch.export.Dim("T")
ep = torch.export.export(M(), (qkv, mask), dynamic_shapes=({{0: B, 1: T}}, {{0: B, 1: T}}))
x = torch.randn(3, 5, 24)
m = torch.ones(3, 5, dtype=torch.int64)
assert torch.equal(ep.module()(x, m), M()(x, m))
print("traced")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("traced")
