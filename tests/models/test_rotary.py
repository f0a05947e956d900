"""The rotary positions' one-pass op (rotary_qkv) against the composition it stands for (Rotary.apply's
rotate-half: x * cos + rotate_half(x) * sin in the model's dtype), and where Rotary.apply takes it."""

from __future__ import annotations

import pytest
import torch

from causal_attention.models import layers
from causal_attention.models.layers import Rotary

ops = torch.ops.causal_attention
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _composition(rot: Rotary, qkv: torch.Tensor, H: int, Hkv: int) -> torch.Tensor:
    """Rotary.apply's ATen composition (taken while a gradient is wanted), detached."""
    with torch.enable_grad():
        return rot.apply(qkv.detach().clone().requires_grad_(), H, Hkv).detach()


def _case(dtype: torch.dtype, hd: int, H: int, Hkv: int, lead: tuple[int, ...],
          scale: float) -> tuple[Rotary, torch.Tensor]:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
    positions = torch.randint(0, 130000, lead)
    qkv = (torch.randn(*lead, (H + 2 * Hkv) * hd, dtype=torch.float64) * scale).to(dtype)
    return Rotary.at(positions, inv_freq, dtype), qkv


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("hd", [2, 8, 48, 64, 80, 128])
@pytest.mark.parametrize("H, Hkv, lead", [(4, 4, (2, 7)), (8, 2, (3, 113)), (2, 1, (1,)), (3, 1, (2, 1, 5))])
def test_the_op_is_the_composition_bit_for_bit(dtype, hd, H, Hkv, lead):
    """Every dtype, head sizes that fill no vector and several, GQA/MQA, any leading dims, values in the
    hundreds at positions up to 130000 (angles whose cos and sin round in every way)."""
    rot, qkv = _case(dtype, hd, H, Hkv, lead, scale=300.0 if dtype != torch.float16 else 30.0)
    out = ops.rotary_qkv(qkv, rot.cos, rot.sin, H, Hkv)
    expected = _composition(rot, qkv, H, Hkv)
    assert out.dtype == dtype and out.shape == qkv.shape and out.is_contiguous()
    assert torch.equal(out, expected)
    assert torch.equal(out[..., (H + Hkv) * hd:], qkv[..., (H + Hkv) * hd:])  # v untouched


def test_tables_that_broadcast_and_inputs_of_any_strides():
    """cos and sin shared by a batch ((T, hd), (1, T, hd)) or strided, a qkv that is a strided view:
    the composition's bits."""
    H, Hkv, hd, B, T = 4, 2, 64, 3, 19
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    shared = Rotary.at(torch.arange(T), inv_freq, torch.float32)  # (T, hd)
    wide = torch.randn(B, T, 2 * (H + 2 * Hkv) * hd)
    qkv = wide[..., ::2]  # every other column: no unit stride
    expected = _composition(shared, qkv, H, Hkv)
    assert torch.equal(ops.rotary_qkv(qkv, shared.cos, shared.sin, H, Hkv), expected)
    assert torch.equal(ops.rotary_qkv(qkv, shared.cos[None], shared.sin[None], H, Hkv), expected)
    strided = Rotary(*(torch.stack((t, t), -1)[..., 0] for t in (shared.cos, shared.sin)))
    assert strided.cos.stride(-1) == 2
    assert torch.equal(ops.rotary_qkv(qkv[0], strided.cos, strided.sin, H, Hkv), expected[0])  # no broadcast


def test_rotary_apply_takes_the_op_only_without_a_gradient_to_record(monkeypatch):
    """Under no_grad, on plain CPU tensors, Rotary.apply is the op; with a gradient wanted it is the
    composition, whose gradient flows; both give the same bits."""
    calls = []
    real = ops.rotary_qkv

    class _Counting:
        def __call__(self, *args):  # type: ignore[no-untyped-def]
            calls.append(args)
            return real(*args)

    monkeypatch.setattr(torch.ops.causal_attention, "rotary_qkv", _Counting())
    rot, qkv = _case(torch.float32, 16, 2, 1, (2, 9), scale=3.0)
    with torch.no_grad():
        fast = rot.apply(qkv, 2, 1)
    assert len(calls) == 1
    x = qkv.clone().requires_grad_()
    slow = rot.apply(x, 2, 1)
    assert len(calls) == 1 and slow.grad_fn is not None
    slow.sum().backward()
    assert x.grad is not None and torch.equal(fast, slow.detach())


def test_compiled_graphs_keep_the_composition():
    """torch.compile traces the composition (the op is for eager inference), with the same values."""
    seen: list[str] = []

    def backend(gm, _inputs):  # type: ignore[no-untyped-def]
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    rot, qkv = _case(torch.float32, 16, 2, 1, (2, 9), scale=3.0)
    with torch.no_grad():
        compiled = torch.compile(lambda t: rot.apply(t, 2, 1), backend=backend, fullgraph=True)(qkv)
        assert torch.equal(compiled, rot.apply(qkv, 2, 1))
    assert seen and not any("rotary_qkv" in target for target in seen)
    assert not layers._rotates_in_one_pass(qkv.requires_grad_(), rot.cos, rot.sin)


@pytest.mark.parametrize("case, error, message", [
    ("odd_head_dim", ValueError, "head_dim must be even"),
    ("width", ValueError, r"qkv must be \(\.\.\., \(n_heads \+ 2 \* n_kv_heads\) \* head_dim\)"),
    ("dtype", TypeError, "qkv, cos and sin must share one floating dtype"),
    ("table_shape", ValueError, "cos must broadcast to qkv's leading dims and head_dim"),
    ("heads", ValueError, "n_heads and n_kv_heads must be positive"),
])
def test_bad_inputs_name_the_argument(case, error, message):
    H, Hkv, hd = 2, 1, 8
    qkv = torch.randn(2, 5, (H + 2 * Hkv) * hd)
    cos = sin = torch.randn(2, 5, hd)
    args = {
        "odd_head_dim": (torch.randn(2, 5, 4 * 7), torch.randn(2, 5, 7), torch.randn(2, 5, 7), H, Hkv),
        "width": (torch.randn(2, 5, 33), cos, sin, H, Hkv),
        "dtype": (qkv, cos.double(), sin, H, Hkv),
        "table_shape": (qkv, torch.randn(3, 5, hd), sin, H, Hkv),
        "heads": (qkv, cos, sin, 0, Hkv),
    }[case]
    with pytest.raises(error, match=message):
        ops.rotary_qkv(*args)
