"""Half precision: every tile product accumulates in float32 (no float16 overflow), and the error
against the float64 truth is within 1.5x of F.scaled_dot_product_attention's at the same dtype."""

from __future__ import annotations

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import _ops, backends, reference

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





@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_float16_pv_product_does_not_overflow(dtype):
    """q = k = 0, v = 300, T = 512: every weight of row t is 1/(t+1) and the answer is 300 everywhere.
    A P V tile summed in float16 would overflow to inf long before T = 512."""
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


# (T, B, H): short to long sequences, with the batch kept small where T x T is large.
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
