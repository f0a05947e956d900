"""torch.func transforms on the default backend (grad, vjp, jacrev, vmap, jvp, jacfwd, hessian) and
double backward, against the reference; the raw kernel refuses to be differentiated."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from causal_attention import CausalSelfAttention
from causal_attention.attention import _ops, backends, reference
from helpers import rel_err



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
