"""Non-finite values at positions a row may not see: later positions and padding add exactly nothing.

A NaN or inf in x at position s reaches every output that attends s (as the spec's sums give it), and
no other: outputs before s, and real rows of a sequence whose padding holds it, are what they are with a
finite value there. The engine's P V product sums a whole tile of keys for every row, so a masked key
there would add 0 * NaN without the guard in flash.cpp; the reference sums allowed keys only
(reference.attend).
"""

from __future__ import annotations

import math

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import backends, reference
from helpers import rel_err

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _layer(dim: int, n_heads: int, dtype: torch.dtype, backend: str = "cpp") -> CausalSelfAttention:
    torch.manual_seed(0)
    return CausalSelfAttention(dim, n_heads, backend=backend, dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("hd", [8, 64])  # float32: BLAS products below a panel's width, the micro-kernel above
def test_a_later_non_finite_input_leaves_earlier_outputs_alone(dtype, poison, hd):
    """T = 300, x[250] poisoned; positions 192-249 share its diagonal tile."""
    attn = _layer(2 * hd, 2, dtype)
    x = torch.randn(2, 300, 2 * hd, dtype=dtype)
    poisoned = x.clone()
    poisoned[:, 250] = poison
    with torch.no_grad():
        clean, out = attn(x), attn(poisoned)
        exact = reference.causal_self_attention(x.double(), *(p.double() for p in attn.parameters()), 2)
    assert out[:, :250].isfinite().all()
    assert rel_err(out[:, :250], clean[:, :250]) <= TOL[dtype]
    assert rel_err(out[:, :250], exact[:, :250]) <= max(TOL[dtype], 2 * rel_err(clean[:, :250], exact[:, :250]))
    assert not out[:, 250:].isfinite().all(dim=-1).any()  # every later row attends it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunks", [[300], [200, 100], [249, 51], [240, 60], [249, 2, 49], [245, 6, 49]],
                         ids=lambda c: "+".join(map(str, c)))
def test_a_later_non_finite_input_leaves_earlier_outputs_alone_through_the_cache(dtype, chunks):
    """Prefill and steps through a KV cache, in chunks of many rows (tiles over the cache) and of a
    few (rows streamed one by one), with the poisoned position inside a chunk."""
    attn = _layer(64, 4, dtype)
    x = torch.randn(2, 300, 64, dtype=dtype)
    poisoned = x.clone()
    poisoned[:, 250] = math.nan
    outs = []
    with torch.no_grad():
        for inputs in (x, poisoned):
            cache, start, parts = attn.make_cache(2, 300), 0, []
            for n in chunks:
                parts.append(attn(inputs[:, start:start + n], cache=cache))
                start += n
            outs.append(torch.cat(parts, 1))
    clean, out = outs
    assert out[:, :250].isfinite().all()
    assert rel_err(out[:, :250], clean[:, :250]) <= TOL[dtype]
    assert out[:, 250:].isnan().any(-1).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_core_rows_before_a_poisoned_key_are_unchanged(dtype, backend):
    """The attention core on a qkv whose key and value at s hold NaN: rows before s equal the rows of
    the same qkv with finite values there, and the rows after s are NaN."""
    torch.manual_seed(1)
    B, T, H, hd, s = 2, 300, 2, 16, 250
    qkv = torch.randn(B, T, 3 * H * hd, dtype=dtype)
    poisoned = qkv.clone()
    poisoned[:, s, H * hd:] = math.nan  # its keys and values, not its queries
    run = backends.RUN[backend]
    clean, out = run(qkv, None, H), run(poisoned, None, H)
    assert out[:, :s].isfinite().all()
    assert rel_err(out[:, :s], clean[:, :s]) <= TOL[dtype]
    assert out[:, s:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["hole", "right"])
def test_a_non_finite_padded_position_leaves_real_rows_finite_in_engine_and_reference(dtype, where):
    """Padding holds NaN in x (a hole in the middle, or right padding inside the last real key's block):
    the real rows of the engine and of the reference are finite and agree with a finite padding."""
    attn = _layer(64, 4, dtype)
    x = torch.randn(2, 200, 64, dtype=dtype)
    mask = torch.ones(2, 200, dtype=torch.bool)
    pad = [90, 91, 150] if where == "hole" else list(range(170, 200))
    mask[0, pad] = False
    poisoned = x.clone()
    poisoned[0, pad] = math.nan
    params = [p.detach().double() for p in attn.parameters()]
    with torch.no_grad():
        out, clean = attn(poisoned, mask), attn(x, mask)
    ref = reference.causal_self_attention(poisoned.double(), *params, 4, mask)
    ref_clean = reference.causal_self_attention(x.double(), *params, 4, mask)
    real = mask.clone()
    real[1] = True
    assert out[real].isfinite().all() and ref[real].isfinite().all()
    assert torch.equal(ref[real], ref_clean[real])
    assert rel_err(out[real], clean[real]) <= TOL[dtype]
    assert rel_err(out[real], ref[real]) <= max(TOL[dtype], 2 * rel_err(clean[real], ref_clean[real]))


def _attend_by_rows(weights: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """reference.attend written as the sum it defines: row by row, allowed keys only."""
    B, H, T, _ = weights.shape
    allowed = allowed.expand(B, H, T, T)
    y = torch.zeros(B, H, T, v.shape[-1], dtype=v.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = allowed[b, h, i].nonzero().flatten()
                y[b, h, i] = (weights[b, h, i, keys, None] * v[b, h, keys]).sum(0)
    return y


def test_reference_attend_sums_allowed_keys_as_ieee_does():
    """Each kind of non-finite value, at allowed keys (with a weight and with a weight of 0) and at
    masked ones."""
    torch.manual_seed(2)
    T, hd = 6, 5
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[:, 1] = False  # key 1 is padding
    weights = torch.rand(1, 1, T, T, dtype=torch.float64).masked_fill(~allowed, 0)
    weights[0, 0, 4, 2] = 0.0  # an allowed key of weight 0 (an underflowed exp)
    v = torch.randn(1, 1, T, hd, dtype=torch.float64)
    v[0, 0, 1] = math.nan  # padding: never seen
    v[0, 0, 5, 0] = math.nan  # the last key: only row 5 sees it
    v[0, 0, 3, 1], v[0, 0, 4, 1] = math.inf, -math.inf  # +inf alone for row 3, with -inf from row 4 on
    v[0, 0, 2, 2] = math.inf  # times row 4's weight of 0
    got = reference.attend(weights, allowed, v)
    want = _attend_by_rows(weights, allowed, v)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12)
    assert got[0, 0, :5, 0].isfinite().all() and got[0, 0, 5, 0].isnan()
    assert got[0, 0, 3, 1] == math.inf and got[0, 0, 4:, 1].isnan().all()
    assert got[0, 0, 4, 2].isnan() and got[0, 0, 5, 2] == math.inf
