"""Grouped-query attention in the fused CPU kernel (attention_forward / attention_backward with
n_kv_heads): qkv (B, T, (H + 2 Hkv) * hd) split q | k | v, query head h reading key/value head
h // (H / Hkv). Held to the reference (reference.attention_core with n_kv_heads) in float64 and, at the
working dtype, to what PyTorch's own SDPA (enable_gqa) achieves on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from causal_attention.attention import _ops, reference
from helpers import make_mask, rel_err

GROUPS = [(4, 2), (6, 1), (8, 4), (3, 3)]  # (H, Hkv): grouped, multi-query, pairs, and Hkv = H given explicitly


def _qkv(B: int, T: int, H: int, Hkv: int, hd: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    return (torch.randn(B, T, (H + 2 * Hkv) * hd, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def _engine(qkv: Tensor, mask: Tensor | None, H: int, Hkv: int, g: Tensor) -> tuple[Tensor, Tensor]:
    y = _ops.attention(qkv, mask, H, n_kv_heads=Hkv)
    (grad,) = torch.autograd.grad(y, qkv, g)
    return y.detach(), grad


def _exact(qkv: Tensor, mask: Tensor | None, H: int, Hkv: int, g: Tensor) -> tuple[Tensor, Tensor]:
    x = qkv.detach().double().requires_grad_()
    y = reference.attention_core(x, mask, H, n_kv_heads=Hkv)[0]
    (grad,) = torch.autograd.grad(y, x, g.double())
    return y.detach(), grad


def _sdpa(qkv: Tensor, mask: Tensor | None, H: int, Hkv: int, g: Tensor) -> tuple[Tensor, Tensor]:
    """PyTorch's SDPA with enable_gqa at qkv's dtype; rows without an allowed key given every key, then 0."""
    x = qkv.detach().requires_grad_()
    B, T, width = x.shape
    hd = width // (H + 2 * Hkv)
    q, k, v = x.split([H * hd, Hkv * hd, Hkv * hd], dim=2)
    q = q.unflatten(2, (H, hd)).transpose(1, 2)
    k = k.unflatten(2, (Hkv, hd)).transpose(1, 2)
    v = v.unflatten(2, (Hkv, hd)).transpose(1, 2)
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    if mask is not None:
        allowed = allowed & mask[:, None, :]
    has_key = allowed.any(-1)  # (B, T)
    allowed = allowed | ~has_key[..., None]
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    y = (y * has_key[:, None, :, None].to(y.dtype)).transpose(1, 2).reshape(B, T, H * hd)
    (grad,) = torch.autograd.grad(y, x, g)
    return y.detach(), grad


@pytest.mark.parametrize("mask_kind", ["none", "right", "random"])
@pytest.mark.parametrize("T", [1, 7, 113, 300])
@pytest.mark.parametrize("groups", GROUPS, ids=lambda g: f"H{g[0]}_Hkv{g[1]}")
def test_float64_forward_and_backward_match_the_reference(groups: tuple[int, int], T: int, mask_kind: str) -> None:
    H, Hkv = groups
    qkv = _qkv(2, T, H, Hkv, 16, torch.float64)
    mask = make_mask(mask_kind, 2, T)
    g = torch.randn(2, T, H * 16, dtype=torch.float64)
    y, grad = _engine(qkv, mask, H, Hkv, g)
    y64, grad64 = _exact(qkv, mask, H, Hkv, g)
    assert y.shape == (2, T, H * 16) and grad.shape == qkv.shape
    assert rel_err(y, y64) <= 1e-12 and rel_err(grad, grad64) <= 1e-12


@pytest.mark.parametrize("hd", [8, 48, 64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_working_dtypes_are_as_exact_as_sdpa(dtype: torch.dtype, hd: int) -> None:
    """Against the float64 reference on the same rounded inputs: within 3x SDPA's (enable_gqa) error at
    the dtype, or two units of the dtype's last place, with padding and a long row."""
    H, Hkv, B, T = 8, 2, 2, 257
    qkv = _qkv(B, T, H, Hkv, hd, dtype, scale=3.0)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [190]])
    g = torch.randn(B, T, H * hd, dtype=torch.float64).to(dtype)
    ours = _engine(qkv, mask, H, Hkv, g)
    exact = _exact(qkv, mask, H, Hkv, g)
    base = _sdpa(qkv, mask, H, Hkv, g)
    floor = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 1e-5
    for what, a, e, s in zip(("out", "grad qkv"), ours, exact, base):
        tol = max(floor, 3 * rel_err(s, e))
        assert rel_err(a, e) <= tol, f"{what}: {rel_err(a, e):.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_forward_equals_multi_head_with_each_head_its_own_copy_bit_for_bit(dtype: torch.dtype) -> None:
    """A query head reads its group's key/value head exactly as multi-head attention reads its own: the
    forward of GQA equals the multi-head forward on k and v repeated for every query head, bit for bit."""
    H, Hkv, hd, B, T = 6, 2, 32, 2, 300
    qkv = _qkv(B, T, H, Hkv, hd, dtype).detach()
    mask = make_mask("random", B, T)
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=2)
    repeat = lambda t: t.unflatten(2, (Hkv, hd)).repeat_interleave(H // Hkv, dim=2).flatten(2)  # noqa: E731
    mha = torch.cat([q, repeat(k), repeat(v)], dim=2)  # (B, T, 3 * H * hd)
    out, lse = torch.ops.causal_attention.attention_forward(qkv, mask, H, n_kv_heads=Hkv)
    out_mha, lse_mha = torch.ops.causal_attention.attention_forward(mha, mask, H)
    assert torch.equal(out, out_mha) and torch.equal(lse, lse_mha)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_in_waves_of_key_panels(dtype: torch.dtype) -> None:
    """The forward packs the key panels of a few (batch, key/value head)s at a time (2 MB of them, a
    wave) and runs their queries: at T = 1100 and head_dim 64 three heads fit a wave, so GQA's 4 and the
    multi-head copy's 12 heads take 2 and 4 waves, the heads ordered by their padded lengths. Each query
    head must read its own key/value head's panels: outputs equal the copy's bit for bit, the float64
    reference within the dtype's rounding, and the same bits on 1 and 3 threads (other waves)."""
    H, Hkv, hd, B, T = 6, 2, 64, 2, 1100
    qkv = _qkv(B, T, H, Hkv, hd, dtype).detach()
    mask = torch.arange(T)[None, :] < torch.tensor([[700], [T]])  # the second sequence's heads go first
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=2)
    repeat = lambda t: t.unflatten(2, (Hkv, hd)).repeat_interleave(H // Hkv, dim=2).flatten(2)  # noqa: E731
    mha = torch.cat([q, repeat(k), repeat(v)], dim=2)
    out, lse = torch.ops.causal_attention.attention_forward(qkv, mask, H, n_kv_heads=Hkv)
    out_mha, lse_mha = torch.ops.causal_attention.attention_forward(mha, mask, H)
    assert torch.equal(out, out_mha) and torch.equal(lse, lse_mha)
    exact = reference.attention_core(qkv.double(), mask, H, n_kv_heads=Hkv)[0]
    assert rel_err(out, exact) <= (1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(torch.ops.causal_attention.attention_forward(qkv, mask, H, n_kv_heads=Hkv)[0], out)
    finally:
        torch.set_num_threads(threads)


def test_n_kv_heads_equal_to_n_heads_is_the_multi_head_kernel_bit_for_bit() -> None:
    qkv = _qkv(2, 130, 4, 4, 24, torch.float32)
    mask = make_mask("right", 2, 130)
    g = torch.randn(2, 130, 96)
    y, grad = _engine(qkv, mask, 4, 4, g)
    y_mha = _ops.attention(qkv, mask, 4)
    (grad_mha,) = torch.autograd.grad(y_mha, qkv, g)
    assert torch.equal(y, y_mha) and torch.equal(grad, grad_mha)


def test_gradcheck_and_gradgradcheck() -> None:
    qkv = _qkv(2, 6, 4, 2, 2, torch.float64)
    mask = torch.tensor([[True] * 6, [False, True, True, False, True, True]])
    fn = lambda x: _ops.attention(x, mask, 4, n_kv_heads=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (qkv,))
    assert torch.autograd.gradgradcheck(fn, (qkv,), fast_mode=True)


def test_a_row_with_no_key_gives_zero_and_no_gradient() -> None:
    qkv = _qkv(1, 6, 4, 1, 8, torch.float32)
    mask = torch.tensor([[False, False, True, True, True, True]])
    y = _ops.attention(qkv, mask, 4, n_kv_heads=1)
    (grad,) = torch.autograd.grad(y.sum(), qkv)
    assert bool((y[0, :2] == 0).all()) and not y.isnan().any()
    assert bool((grad[0, :2] == 0).all()) and not grad.isnan().any()


def test_vmap_and_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    qkv = torch.randn(3, 2, 11, (4 + 2 * 2) * 8, dtype=torch.float64)
    batched = torch.vmap(lambda x: _ops.attention(x, None, 4, n_kv_heads=2))(qkv)
    one_by_one = torch.stack([_ops.attention(x, None, 4, n_kv_heads=2) for x in qkv])
    assert torch.equal(batched, one_by_one)
    with FakeTensorMode():
        fake = torch.empty(2, 5, (8 + 2 * 2) * 16, dtype=torch.bfloat16)
        out, lse = torch.ops.causal_attention.attention_forward(fake, None, 8, n_kv_heads=2)
        grad = torch.ops.causal_attention.attention_backward(out, fake, None, out, lse, 8, n_kv_heads=2)
    assert out.shape == (2, 5, 128) and lse.shape == (2, 8, 5) and grad.shape == fake.shape


def test_compiled_matches_eager() -> None:
    qkv = _qkv(2, 40, 4, 2, 16, torch.float32)
    mask = make_mask("right", 2, 40)
    fn = lambda x, m: _ops.attention(x, m, 4, n_kv_heads=2)  # noqa: E731
    eager = fn(qkv, mask)
    compiled = torch.compile(fn, fullgraph=True)(qkv, mask)
    assert torch.equal(compiled, eager)


@pytest.mark.parametrize(
    "width, H, Hkv, message",
    [
        (8 * 16, 4, 3, r"n_kv_heads must be positive and divide n_heads \(4\); got 3"),
        (8 * 16, 4, 0, r"n_kv_heads must be positive"),
        (8 * 16 + 1, 4, 2, r"must be \(n_heads \+ 2 \* n_kv_heads\) \* head_dim"),
    ],
)
def test_bad_head_counts_are_named(width: int, H: int, Hkv: int, message: str) -> None:
    qkv = torch.randn(1, 3, width)
    with pytest.raises(ValueError, match=message):
        torch.ops.causal_attention.attention_forward(qkv, None, H, n_kv_heads=Hkv)
