"""The compiled engine and the module's plumbing: loading, backend choice, state_dict."""

from __future__ import annotations

import warnings

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import _ops, backends
from helpers import rel_err


def test_compiled_engine_is_loaded():
    """Fails in CI (and anywhere) when the C++ engine was not built or cannot be loaded."""
    assert _ops.load_error() is None
    assert hasattr(torch.ops.causal_attention, "attention")


def test_auto_picks_cpp_on_cpu():
    qkv = torch.randn(1, 3, 24)
    assert backends.select_backend(qkv, "auto") == "cpp"


def test_cpp_passed_over_with_reasons_for_other_devices():
    qkv = torch.randn(1, 3, 24, device="meta")
    reasons = backends.unsupported_reasons("cpp", qkv)
    assert any("CPU tensors; got device meta" in r for r in reasons)
    assert backends.select_backend(qkv, "auto") == "sdpa"
    with pytest.raises(ValueError, match="backend 'cpp' cannot run these inputs"):
        backends.select_backend(qkv, "cpp")


def test_missing_engine_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(_ops, "load_error", lambda: "no such file (test)")
    backends._warn_engine_missing.cache_clear()
    attn = CausalSelfAttention(16, 4, dtype=torch.float64)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = attn(x)
        attn(x)
    backends._warn_engine_missing.cache_clear()
    engine_warnings = [w for w in caught if "compiled C++ engine is not loaded" in str(w.message)]
    assert len(engine_warnings) == 1
    assert "no such file (test)" in str(engine_warnings[0].message)
    monkeypatch.undo()
    assert rel_err(y, CausalSelfAttention.forward(attn, x)) <= 1e-12


def test_state_dict_holds_exactly_the_projections():
    attn = CausalSelfAttention(32, 4)
    sd = attn.state_dict()
    assert list(sd) == ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]
    assert sd["qkv.weight"].shape == (96, 32) and sd["proj.weight"].shape == (32, 32)
    # A plain state dict loads strictly into a fresh module and gives the same outputs.
    other = CausalSelfAttention(32, 4)
    other.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        assert torch.equal(attn(x), other(x))


def test_qkv_split_order_and_head_columns():
    """Head h uses columns h*hd:(h+1)*hd of q, k and v: zeroing head 1's v zeroes its slice only."""
    attn = CausalSelfAttention(12, 3, dtype=torch.float64, backend="cpp")
    with torch.no_grad():
        attn.proj.weight.copy_(torch.eye(12))
        attn.proj.bias.zero_()
        attn.qkv.weight[24 + 4 : 24 + 8].zero_()  # v columns of head 1
        attn.qkv.bias[24 + 4 : 24 + 8].zero_()
    y = attn(torch.randn(2, 5, 12, dtype=torch.float64))
    assert torch.count_nonzero(y[..., 4:8]) == 0
    assert torch.count_nonzero(y[..., :4]) > 0 and torch.count_nonzero(y[..., 8:]) > 0


@pytest.mark.parametrize("backend", ["cpp", "sdpa", "reference"])
def test_empty_inputs(backend):
    """B = 0 or T = 0 gives an empty output on every backend, with and without a mask or cache."""
    attn = CausalSelfAttention(8, 2, backend=backend)
    for B, T in ((0, 5), (2, 0)):
        x = torch.randn(B, T, 8)
        assert attn(x).shape == (B, T, 8)
        assert attn(x, torch.ones(B, T, dtype=torch.bool)).shape == (B, T, 8)
    if backend != "reference":
        with torch.no_grad():
            cache = attn.make_cache(2, 4)
            assert attn(torch.randn(2, 0, 8), cache=cache).shape == (2, 0, 8)
            assert cache.lengths.tolist() == [0, 0]


@pytest.mark.parametrize("hd", [1, 3, 15, 16])
def test_narrow_float32_heads_are_computed_in_float64(hd: int) -> None:
    """Float32 heads narrower than a panel (16) run in float64 and round once (flash.cpp): out and
    grad_qkv equal the float64 kernel's rounded to float32 bit for bit, and lse stays float64, in the
    meta kernel too; head_dim 16 stays float32."""
    B, T, H = 2, 37, 3
    qkv = torch.randn(B, T, 3 * H * hd) * 4
    mask = torch.arange(T)[None, :] >= torch.tensor([[0], [6]])
    g = torch.randn(B, T, H * hd)
    ops = torch.ops.causal_attention
    out, lse = ops.attention_forward(qkv, mask, H)
    out64, lse64 = ops.attention_forward(qkv.double(), mask, H)
    grad = ops.attention_backward(g, qkv, mask, out, lse, H)
    grad64 = ops.attention_backward(g.double(), qkv.double(), mask, out.double(), lse.double(), H)
    assert out.dtype == grad.dtype == torch.float32
    assert lse.dtype == (torch.float64 if hd < 16 else torch.float32)  # the backward's P from an exact lse
    assert ops.attention_forward(qkv.to("meta"), mask.to("meta"), H)[1].dtype == lse.dtype  # export traces it
    same = [torch.equal(out, out64.float()), torch.equal(lse.double(), lse64), torch.equal(grad, grad64.float())]
    assert same == [hd < 16] * 3



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
