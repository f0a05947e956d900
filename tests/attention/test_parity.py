"""Parity: every backend against nn.MultiheadAttention and against the reference, outputs and grads."""

from __future__ import annotations

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import reference
from helpers import BACKENDS, MASK_KINDS, TOL, make_mask, mha_forward, rel_err

# (B, T, H, hd): B 1..4, T in {1, 2, 7, 64, 113, 257}, H 1..12, hd 4..80.
SHAPES = [
    (1, 1, 1, 4),
    (2, 2, 3, 8),
    (3, 7, 12, 16),
    (4, 64, 4, 48),
    (2, 113, 6, 64),
    (1, 257, 2, 80),
    (4, 257, 12, 8),
    (3, 113, 5, 20),
    (2, 7, 7, 36),
]


def _grads(attn: CausalSelfAttention, x: torch.Tensor) -> list[torch.Tensor]:
    assert x.grad is not None
    return [x.grad, attn.qkv.weight.grad, attn.qkv.bias.grad, attn.proj.weight.grad, attn.proj.bias.grad]


def _mha_grads(mha: torch.nn.MultiheadAttention, x: torch.Tensor) -> list[torch.Tensor]:
    assert x.grad is not None
    return [x.grad, mha.in_proj_weight.grad, mha.in_proj_bias.grad, mha.out_proj.weight.grad, mha.out_proj.bias.grad]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}hd{}".format(*s))
def test_matches_multihead_attention(shape, dtype, mask_kind, backend):
    B, T, H, hd = shape
    attn = CausalSelfAttention(H * hd, H, backend=backend, dtype=dtype)
    mha = attn.to_multihead_attention().train(attn.training)
    x = torch.randn(B, T, H * hd, dtype=dtype)
    mask = make_mask(mask_kind, B, T)
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    y1 = attn(x1, mask)
    y2 = mha_forward(mha, x2, mask)
    assert y1.shape == (B, T, H * hd) and y1.dtype == dtype
    assert rel_err(y1, y2) <= TOL[dtype]  # every position, padded ones included
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    for ours, theirs in zip(_grads(attn, x1), _mha_grads(mha, x2)):
        assert rel_err(ours, theirs) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("shape", [(2, 113, 3, 48), (3, 64, 2, 80), (1, 7, 4, 8)], ids=str)
def test_matches_reference_core(shape, mask_kind, backend):
    """The attention core of each backend against reference.attention_core, float64."""
    B, T, H, hd = shape
    attn = CausalSelfAttention(H * hd, H, backend=backend, dtype=torch.float64)
    x = torch.randn(B, T, H * hd, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_kind, B, T)
    qkv = attn.qkv(x)
    from causal_attention.attention import backends

    y = backends.RUN[backend](qkv, mask, H)
    y_ref, _ = reference.attention_core(qkv, mask, H)
    assert rel_err(y, y_ref) <= 1e-12
    g = torch.randn_like(y)
    (gq,) = torch.autograd.grad(y, qkv, g)
    (gq_ref,) = torch.autograd.grad(y_ref, qkv, g)
    assert rel_err(gq, gq_ref) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_modes(backend, training, grad):
    """train/eval and grad/no_grad do not change the result (MultiheadAttention takes its fast path)."""
    B, T, H, hd = 3, 65, 4, 16
    attn = CausalSelfAttention(H * hd, H, backend=backend).train(training)
    mha = attn.to_multihead_attention().train(attn.training)
    x = torch.randn(B, T, H * hd)
    mask = make_mask("right", B, T)
    with torch.set_grad_enabled(grad):
        y1 = attn(x, mask)
        y2 = mha_forward(mha, x, mask)
    assert y1.requires_grad == grad
    assert rel_err(y1, y2) <= TOL[torch.float32]


def test_whole_layer_reference_matches_module():
    """reference.causal_self_attention (the spec end to end) against the module's default path."""
    attn = CausalSelfAttention(48, 6, dtype=torch.float64)
    x = torch.randn(2, 30, 48, dtype=torch.float64)
    mask = make_mask("right", 2, 30)
    ref = reference.causal_self_attention(
        x, attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias, 6, mask
    )
    assert rel_err(attn(x, mask), ref) <= 1e-12
