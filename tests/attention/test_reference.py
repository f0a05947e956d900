"""reference.attention, the spec of transformers' decoder attention (grouped key/value heads, queries
that end a longer key sequence, key masks with holes, any scale, sliding windows, softcapping),
against PyTorch's own SDPA and transformers' eager attention in float64, and against the layer's
spec (attention_core) where the two overlap."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from causal_attention.attention import reference
from helpers import rel_err


def _inputs(B: int, H: int, Hkv: int, Tq: int, Tk: int, hd: int, *, dtype: torch.dtype = torch.float64
            ) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(B, H, Tq, hd, dtype=dtype)
    k = torch.randn(B, Hkv, Tk, hd, dtype=dtype)
    v = torch.randn(B, Hkv, Tk, hd, dtype=dtype)
    return q, k, v


def _holes(B: int, Tk: int) -> Tensor:
    """(B, Tk) bool: left padding in row 0, holes in row 1 (an unfilled static-cache slot), the rest real."""
    mask = torch.ones(B, Tk, dtype=torch.bool)
    mask[0, : Tk // 3] = False
    if B > 1:
        mask[1, Tk // 2] = False
        mask[1, 1] = False
    return mask


def _allowed(B: int, Tq: int, Tk: int, mask: Tensor | None, window: int | None) -> Tensor:
    """(B, 1, Tq, Tk) bool, written independently of the reference: query i sits at Tk - Tq + i."""
    allowed = torch.zeros(B, 1, Tq, Tk, dtype=torch.bool)
    for i in range(Tq):
        position = Tk - Tq + i
        for j in range(Tk):
            ok = j <= position and (window is None or position - j < window)
            allowed[:, 0, i, j] = ok if mask is None else mask[:, j] & ok
    return allowed


CASES = [  # B, H, Hkv, Tq, Tk, hd, window
    (2, 4, 4, 7, 7, 8, None),  # plain multi-head prefill
    (2, 8, 2, 9, 9, 16, None),  # grouped-query prefill
    (3, 6, 1, 5, 5, 8, None),  # multi-query
    (2, 4, 2, 1, 33, 8, None),  # a decode step against a cache
    (2, 4, 2, 6, 40, 48, None),  # a chunk against a longer cache
    (2, 4, 2, 13, 29, 8, 5),  # a sliding window
    (2, 4, 4, 1, 20, 8, 1),  # a window of one key: the query's own
]


@pytest.mark.parametrize("masked", [False, True], ids=["all_real", "holes"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_H{}_Hkv{}_Tq{}_Tk{}_hd{}_w{}".format(*c))
def test_matches_sdpa_with_gqa_in_float64(case: tuple, masked: bool) -> None:
    B, H, Hkv, Tq, Tk, hd, window = case
    q, k, v = _inputs(B, H, Hkv, Tq, Tk, hd)
    mask = _holes(B, Tk) if masked else None
    y, weights = reference.attention(q, k, v, key_mask=mask, window=window, return_weights=True)
    allowed = _allowed(B, Tq, Tk, mask, window)
    has_key = allowed.any(-1, keepdim=True)  # (B, 1, Tq, 1)
    # SDPA's rows without an allowed key are NaN: give them every key, then zero them.
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key, enable_gqa=True) * has_key
    assert y.shape == (B, H, Tq, hd) and weights is not None and weights.shape == (B, H, Tq, Tk)
    assert rel_err(y, expected) <= 1e-12
    assert bool((weights[~allowed.expand(B, H, Tq, Tk)] == 0).all()), "a key that is not allowed has weight"
    sums = weights.sum(-1)  # (B, H, Tq)
    assert torch.allclose(sums, has_key[..., 0].expand_as(sums).double(), atol=1e-12)


def test_rows_with_no_allowed_key_give_zero() -> None:
    q, k, v = _inputs(2, 4, 2, 3, 10, 8)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0] = False  # nothing real
    mask[1, 7:] = False  # the last three queries' own keys are padding, earlier ones real
    y, weights = reference.attention(q, k, v, key_mask=mask, window=2, return_weights=True)
    assert not y.isnan().any() and weights is not None and not weights.isnan().any()
    assert bool((y[0] == 0).all())
    # Query positions 7, 8, 9 with a window of 2: keys 6..7, 7..8, 8..9; only key 6 is real.
    assert bool((y[1, :, 1:] == 0).all()) and bool((y[1, :, 0] != 0).any())


def test_multi_head_prefill_is_the_layer_spec_bit_for_bit() -> None:
    """With H = Hkv, Tq = Tk, the default scale and no window or cap it is attention_core, bit for bit."""
    B, H, T, hd = 2, 3, 11, 8
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    mask = _holes(B, T)
    expected, expected_w = reference.attention_core(qkv, mask, H, return_weights=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.unflatten(2, (3, H, hd)).unbind(2))  # (B, H, T, hd)
    y, weights = reference.attention(q, k, v, key_mask=mask, return_weights=True)
    assert torch.equal(y.transpose(1, 2).reshape(B, T, H * hd), expected)
    assert expected_w is not None and torch.equal(weights, expected_w)


def test_a_nan_in_a_key_no_query_may_see_reaches_nothing() -> None:
    q, k, v = _inputs(1, 2, 1, 4, 12, 8)
    v[0, 0, 11] = math.nan  # the last key: only the last query sees it
    k[0, 0, 0] = math.nan  # outside every query's window of 3
    y, _ = reference.attention(q, k, v, window=3)
    assert not y[:, :, :3].isnan().any() and bool(y[:, :, 3].isnan().all())


@pytest.mark.parametrize("softcap", [None, 50.0, 2.0])
@pytest.mark.parametrize("scale", [None, 0.125, 1.7])
def test_scale_and_softcap_match_transformers_eager_attention(scale: float | None, softcap: float | None) -> None:
    """Gemma 2's attention as transformers writes it (eager_attention_forward: scores * scaling, then
    softcap * tanh(scores / softcap), an additive mask, softmax in float32) with a sliding window
    and GQA. Its softmax in float32 bounds the agreement at float32's rounding."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    B, H, Hkv, Tq, Tk, hd, window = 2, 8, 4, 6, 17, 16, 9
    q, k, v = _inputs(B, H, Hkv, Tq, Tk, hd)
    q = q * 3  # scores of a few units: softcap 2 bends them
    mask = _holes(B, Tk)
    y, _ = reference.attention(q, k, v, key_mask=mask, scale=scale, window=window, softcap=softcap)
    allowed = _allowed(B, Tq, Tk, mask, window)
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)

    class Module(torch.nn.Module):
        head_dim, num_key_value_groups = hd, H // Hkv

    expected, _ = gemma2.eager_attention_forward(Module(), q, k, v, additive, scaling=scale, softcap=softcap)
    assert rel_err(y.transpose(1, 2), expected) <= 1e-6
    if scale is None and softcap is None:  # transformers' default scale is head_dim ** -0.5
        assert rel_err(y, reference.attention(q, k, v, key_mask=mask, scale=hd**-0.5, window=window)[0]) <= 1e-15


def test_softcap_bounds_every_score() -> None:
    """Capped at 1, every score lies in (-1, 1): no two weights of a row differ by more than e^2,
    however large q . k."""
    q, k, v = _inputs(1, 2, 2, 5, 5, 4)
    q = q * 100
    _, weights = reference.attention(q, k, v, softcap=1.0, return_weights=True)
    assert weights is not None
    row = weights[0, :, -1]  # (H, Tk): the last query sees every key
    ratios = row.max(-1).values / row.min(-1).values  # (H,)
    assert float(ratios.max()) <= math.exp(2)
    _, uncapped = reference.attention(q, k, v, return_weights=True)
    assert uncapped is not None and float((uncapped[0, :, -1].max(-1).values / uncapped[0, :, -1].min(-1).values).max()) > 1e3


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (((1, 4, 3, 8), (1, 3, 3, 8), (1, 3, 3, 8)), {}, r"k's heads \(3\) must divide q's heads \(4\)"),
        (((1, 4, 5, 8), (1, 2, 3, 8), (1, 2, 3, 8)), {}, r"q's length \(5\) must not exceed k's \(3\)"),
        (((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 4, 8)), {}, r"k and v must be"),
        (((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8)), {"key_mask": torch.ones(1, 4, dtype=torch.bool)},
         r"key_mask must be a \(1, 3\) bool tensor"),
        (((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8)), {"window": 0}, r"window must be a positive number"),
        (((1, 4, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8)), {"softcap": -1.0}, r"softcap must be positive"),
    ],
)
def test_bad_arguments_are_named(shapes: tuple, kwargs: dict, message: str) -> None:
    q, k, v = (torch.randn(s, dtype=torch.float64) for s in shapes)
    with pytest.raises(ValueError, match=message):
        reference.attention(q, k, v, **kwargs)
