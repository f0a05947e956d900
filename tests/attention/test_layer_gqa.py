"""CausalSelfAttention(dim, n_heads, n_kv_heads=...): the grouped-query layer.

qkv = Linear(dim, (n_heads + 2 * n_kv_heads) * head_dim) split q | k | v, query head h reading key/value
head h // (n_heads // n_kv_heads), the cache holding n_kv_heads. Held to reference.attention_core (float64,
each backend), forward and backward; the cache path equals the whole-sequence forward; n_kv_heads=None is
the contract's layer, and n_kv_heads=n_heads computes it bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import reference
from helpers import make_mask, rel_err

GROUPS = [(8, 2), (6, 1), (4, 4)]  # grouped, multi-query, and n_kv_heads = n_heads given explicitly


def _reference(layer: CausalSelfAttention, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    qkv = torch.nn.functional.linear(x, layer.qkv.weight, layer.qkv.bias)
    y, _ = reference.attention_core(qkv, mask, layer.n_heads, n_kv_heads=layer.n_kv_heads)
    return torch.nn.functional.linear(y, layer.proj.weight, layer.proj.bias)


def test_state_holds_the_grouped_projection_and_nothing_else() -> None:
    layer = CausalSelfAttention(64, 8, n_kv_heads=2)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        "qkv.weight": (96, 64), "qkv.bias": (96,), "proj.weight": (64, 64), "proj.bias": (64,)}
    assert CausalSelfAttention(64, 8).qkv.weight.shape == (192, 64)  # the contract's layer
    assert "n_kv_heads=2" in repr(layer)


@pytest.mark.parametrize("mask_kind", ["none", "right", "random"])
@pytest.mark.parametrize("T", [1, 7, 113])
@pytest.mark.parametrize("groups", GROUPS, ids=lambda g: f"H{g[0]}_Hkv{g[1]}")
@pytest.mark.parametrize("backend", ["cpp", "sdpa", "reference"])
def test_float64_forward_and_backward_match_the_reference(backend: str, groups: tuple[int, int], T: int,
                                                           mask_kind: str) -> None:
    H, Hkv = groups
    layer = CausalSelfAttention(H * 8, H, n_kv_heads=Hkv, backend=backend, dtype=torch.float64)  # type: ignore[arg-type]
    x = torch.randn(3, T, H * 8, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_kind, 3, T)
    g = torch.randn(3, T, H * 8, dtype=torch.float64)
    y = layer(x, mask)
    grads = torch.autograd.grad(y, (x, layer.qkv.weight, layer.proj.weight), g)
    ref = _reference(layer, x, mask)
    ref_grads = torch.autograd.grad(ref, (x, layer.qkv.weight, layer.proj.weight), g)
    real = mask if mask is not None else torch.ones(3, T, dtype=torch.bool)
    assert rel_err(y[real], ref[real]) <= 1e-12
    for a, b in zip(grads, ref_grads):
        assert rel_err(a, b) <= 1e-12


def test_float32_is_as_exact_as_the_multi_head_layer() -> None:
    layer = CausalSelfAttention(256, 8, n_kv_heads=2)
    x = torch.randn(2, 300, 256)
    mask = make_mask("right", 2, 300)
    y = layer(x, mask)
    ref = _reference(layer.double(), x.double(), mask)
    real = mask if mask is not None else torch.ones(2, 300, dtype=torch.bool)
    assert rel_err(y[real], ref[real]) <= 2e-5


def test_n_kv_heads_equal_to_n_heads_is_the_multi_head_layer_bit_for_bit() -> None:
    torch.manual_seed(0)
    plain = CausalSelfAttention(96, 4)
    explicit = CausalSelfAttention(96, 4, n_kv_heads=4)
    explicit.load_state_dict(plain.state_dict())
    x = torch.randn(2, 70, 96, requires_grad=True)
    mask = make_mask("random", 2, 70)
    a, b = plain(x, mask), explicit(x, mask)
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a.sum(), x)[0], torch.autograd.grad(b.sum(), x)[0])


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cache_holds_the_key_value_heads_and_decodes_as_the_forward(backend: str, dtype: torch.dtype) -> None:
    """Prefill 5 tokens then one token per step (right-padded sequences of lengths 13, 9, 3): the outputs
    at the real positions equal the whole-sequence forward's."""
    torch.manual_seed(1)
    layer = CausalSelfAttention(64, 8, n_kv_heads=2, backend=backend, dtype=dtype)  # type: ignore[arg-type]
    x = torch.randn(3, 13, 64, dtype=dtype)
    mask = torch.arange(13)[None, :] < torch.tensor([[13], [9], [3]])
    with torch.no_grad():
        full = layer(x, mask)
        cache = layer.make_cache(3, 20)
        assert cache.k.shape == cache.v.shape == (3, 2, 20, 8)
        steps = [layer(x[:, :5], mask[:, :5], cache=cache)]
        steps += [layer(x[:, t:t + 1], mask[:, t:t + 1], cache=cache) for t in range(5, 13)]
    assert cache.lengths.tolist() == [13, 9, 3]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(torch.cat(steps, 1)[mask], full[mask]) <= tol


def test_compiled_matches_eager() -> None:
    layer = CausalSelfAttention(64, 8, n_kv_heads=2)
    x = torch.randn(2, 40, 64)
    mask = make_mask("right", 2, 40)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x, mask), layer(x, mask))


def test_bad_head_counts_are_named() -> None:
    with pytest.raises(ValueError, match=r"n_kv_heads \(got 3\) must divide n_heads \(got 8\)"):
        CausalSelfAttention(64, 8, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        CausalSelfAttention(64, 8, n_kv_heads=0)
    with pytest.raises(ValueError, match="n_kv_heads=2 for n_heads=8"):
        CausalSelfAttention(64, 8, n_kv_heads=2).to_multihead_attention()
    layer = CausalSelfAttention(64, 8, n_kv_heads=2)
    wrong = CausalSelfAttention(64, 8).make_cache(1, 4)  # (1, 8, 4, 8): a multi-head layer's
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache must hold \(B, n_kv_heads, max_len, head_dim\)"):
        layer(torch.randn(1, 1, 64), cache=wrong)
