"""Bad input: a ValueError or TypeError that names the argument, what it got and what was expected."""

from __future__ import annotations

import pytest
import torch

from causal_attention import CausalSelfAttention


def test_dim_not_divisible_by_heads_names_both():
    with pytest.raises(ValueError, match=r"dim \(got 10\).*n_heads \(got 3\)"):
        CausalSelfAttention(10, 3)


@pytest.mark.parametrize("dim, n_heads", [(0, 1), (8, 0), (-8, 2)])
def test_non_positive_sizes(dim, n_heads):
    with pytest.raises(ValueError, match="must be positive"):
        CausalSelfAttention(dim, n_heads)


def test_non_int_sizes():
    with pytest.raises(TypeError, match="dim must be an int; got float"):
        CausalSelfAttention(16.0, 4)  # type: ignore[arg-type]


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        CausalSelfAttention(16, 4, "cpp")  # type: ignore[misc]


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of .*'cuda-magic'"):
        CausalSelfAttention(16, 4, backend="cuda-magic")  # type: ignore[arg-type]


@pytest.fixture
def attn() -> CausalSelfAttention:
    return CausalSelfAttention(16, 4)


def test_x_not_3d(attn):
    with pytest.raises(ValueError, match=r"x must be 3-D \(B, T, dim\); got shape \(5, 16\)"):
        attn(torch.randn(5, 16))


def test_x_wrong_last_dim(attn):
    with pytest.raises(ValueError, match=r"x must have last dimension dim=16; got shape \(2, 5, 8\)"):
        attn(torch.randn(2, 5, 8))


def test_x_integer(attn):
    with pytest.raises(TypeError, match="x must be a floating-point tensor; got dtype torch.int64"):
        attn(torch.ones(2, 5, 16, dtype=torch.long))


@pytest.mark.parametrize("shape", [(2, 4), (5, 2), (2, 5, 1), (10,)])
def test_mask_wrong_shape(attn, shape):
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, T\) = \(2, 5\); got shape"):
        attn(torch.randn(2, 5, 16), torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_mask(attn, dtype):
    with pytest.raises(TypeError, match="key_padding_mask must be bool .* got dtype torch"):
        attn(torch.randn(2, 5, 16), torch.ones(2, 5, dtype=dtype))


def test_integer_mask_outside_0_1(attn):
    with pytest.raises(ValueError, match="key_padding_mask of integer dtype must hold only 0"):
        attn(torch.randn(2, 5, 16), torch.full((2, 5), 2))


def test_mask_on_another_device(attn):
    with pytest.raises(ValueError, match=r"key_padding_mask must be on the same device as x \(cpu\); got meta"):
        attn(torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.bool, device="meta"))


def test_mask_not_a_tensor(attn):
    with pytest.raises(TypeError, match="key_padding_mask must be a Tensor or None; got list"):
        attn(torch.randn(2, 5, 16), [[1] * 5] * 2)


def test_integer_mask_means_the_same_as_bool(attn):
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.equal(attn(x, mask), attn(x, mask.bool()))
        assert torch.equal(attn(x, mask.to(torch.uint8)), attn(x, mask.bool()))


def test_op_checks_its_own_inputs():
    """The registered op validates too (C++ TORCH_CHECK_VALUE surfaces as ValueError)."""
    op = torch.ops.causal_attention.attention
    with pytest.raises(ValueError, match=r"qkv last dimension \(got 10\)"):
        op(torch.randn(2, 5, 10), None, 4)
    with pytest.raises(ValueError, match=r"qkv must be 3-D"):
        op(torch.randn(5, 12), None, 4)
    with pytest.raises(ValueError, match="n_heads must be positive"):
        op(torch.randn(2, 5, 12), None, 0)


def test_x_of_another_dtype_than_the_parameters_names_both(attn):
    with pytest.raises(TypeError, match=r"x must have the layer's parameters' dtype torch.float32; got x of dtype "
                                        r"torch.float64"):
        attn(torch.randn(2, 5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"parameters' dtype torch.float64; got x of dtype torch.bfloat16"):
        CausalSelfAttention(16, 4).double()(torch.randn(2, 5, 16, dtype=torch.bfloat16))


def test_x_on_another_device_than_the_parameters_names_both(attn):
    with pytest.raises(ValueError, match=r"x must be on the layer's parameters' device cpu; got x on meta"):
        attn(torch.randn(2, 5, 16, device="meta"))
    with pytest.raises(ValueError, match=r"parameters' device meta; got x on cpu"):
        CausalSelfAttention(16, 4, device="meta")(torch.randn(2, 5, 16))


def test_projections_that_make_their_weight_in_the_call_are_not_judged_by_it():
    """A pre-hook that puts the weight in place (offloading: meta until the call; FSDP's unsharding), a
    replaced forward (accelerate's hooks) or a parametrization: x is checked by the product itself, and
    the parametrization runs once per forward, as before."""
    ref = CausalSelfAttention(16, 4)
    x = torch.randn(2, 5, 16)
    expected = ref(x)

    offloaded = CausalSelfAttention(16, 4)
    offloaded.load_state_dict(ref.state_dict())
    weight = offloaded.qkv.weight.detach().clone()
    offloaded.qkv.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"))

    def bring_back(module: torch.nn.Module, args: tuple) -> None:
        module.weight = torch.nn.Parameter(weight)

    offloaded.qkv.register_forward_pre_hook(bring_back)
    assert torch.equal(offloaded(x), expected)

    class Counting(torch.nn.Module):
        calls = 0

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            Counting.calls += 1
            return w

    parametrized = CausalSelfAttention(16, 4)
    parametrized.load_state_dict(ref.state_dict())
    torch.nn.utils.parametrize.register_parametrization(parametrized.qkv, "weight", Counting())
    Counting.calls = 0
    assert torch.equal(parametrized(x), expected)
    assert Counting.calls == 1


def test_autocast_may_feed_x_of_another_dtype(attn):
    """Under autocast the projections cast x: float32 weights with bfloat16 x is what autocast runs."""
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = attn(x.float())
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
