"""The fused CPU kernel (torch.ops.causal_attention.attention) on the cases that break kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from causal_attention import CausalSelfAttention
from causal_attention.attention import reference
from helpers import isa_env, make_mask, rel_err

op = torch.ops.causal_attention.attention


def _check_against_reference(qkv: torch.Tensor, mask: torch.Tensor | None, H: int, tol: float) -> None:
    """Output and grad_qkv of the kernel against reference.attention_core, same dtype."""
    a = qkv.detach().clone().requires_grad_()
    b = qkv.detach().clone().requires_grad_()
    y = op(a, mask, H)
    y_ref, _ = reference.attention_core(b, mask, H)
    assert not y.isnan().any()
    assert rel_err(y, y_ref) <= tol
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert not a.grad.isnan().any()
    assert rel_err(a.grad, b.grad) <= tol


def _block_mask(B: int, T: int, kind: str) -> torch.Tensor | None:
    """Masks that switch whole key blocks off (every block size in use is 128 or 256)."""
    if kind in ("none", "right", "random"):
        return make_mask(kind, B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    if kind == "holes":  # whole blocks of padding in the middle, key 0 real
        mask[:, 100:400] = False
        mask[-1, 1:] = False  # a sequence with one real key
    elif kind == "left":  # left padding: the first queries have no allowed key at all
        mask[:, : T // 3] = False
        mask[0, :] = False  # a sequence with no real token at all
    return mask


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 127, 128, 129, 191, 193, 255, 256, 257, 383, 385, 513])
@pytest.mark.parametrize("mask_kind", ["none", "right", "random", "holes", "left"])
def test_block_boundaries_float64(T, mask_kind):
    B, H, hd = 2, 2, 16
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    _check_against_reference(qkv, _block_mask(B, T, mask_kind), H, 1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("mask_kind", ["none", "right", "holes"])
def test_long_sequence(dtype, mask_kind):
    """T = 1025: many key blocks, one past a power of two."""
    B, T, H, hd = 1, 1025, 2, 64
    qkv = torch.randn(B, T, 3 * H * hd, dtype=dtype)
    _check_against_reference(qkv, _block_mask(B, T, mask_kind), H, 1e-12 if dtype == torch.float64 else 2e-5)


@pytest.mark.parametrize("hd", [1, 4, 8, 20, 33, 48, 64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_head_dims(hd, dtype):
    """Head dims that are and are not multiples of the vector width (8 doubles, 16 floats)."""
    B, T, H = 2, 150, 3
    qkv = torch.randn(B, T, 3 * H * hd, dtype=dtype)
    _check_against_reference(qkv, make_mask("random", B, T), H, 1e-12 if dtype == torch.float64 else 2e-5)


@pytest.mark.parametrize("layout", ["row_slice", "transposed_batch", "strided_columns", "expanded",
                                    "expanded_time", "one_row_odd_stride"])
def test_non_contiguous_inputs(layout):
    B, T, H, hd = 3, 140, 2, 24
    C = 3 * H * hd
    if layout == "row_slice":  # rows of qkv sit inside wider rows
        qkv = torch.randn(B, T, C + 40, dtype=torch.float64)[:, :, 13 : 13 + C]
    elif layout == "transposed_batch":  # (T, B, C) storage seen as (B, T, C)
        qkv = torch.randn(T, B, C, dtype=torch.float64).transpose(0, 1)
    elif layout == "strided_columns":  # last dimension not dense
        qkv = torch.randn(B, T, 2 * C, dtype=torch.float64)[:, :, ::2]
    elif layout == "expanded":  # one sequence broadcast over the batch
        qkv = torch.randn(1, T, C, dtype=torch.float64).expand(B, T, C)
    elif layout == "expanded_time":  # one token broadcast over time: rows 0 apart
        qkv = torch.randn(B, 1, C, dtype=torch.float64).expand(B, T, C)
    else:  # T = 1 with a row stride below the row length (PyTorch calls it contiguous)
        T = 1
        qkv = torch.randn(B, C, 1, dtype=torch.float64).transpose(1, 2)
        assert qkv.stride(1) < C
    assert not qkv.is_contiguous() or layout == "one_row_odd_stride"
    mask = make_mask("right", B, T).t().contiguous().t()  # a non-contiguous mask too
    assert not mask.is_contiguous() or T == 1
    _check_against_reference(qkv, mask, H, 1e-12)


def test_non_contiguous_grad_output():
    B, T, H, hd = 2, 70, 2, 8
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64, requires_grad=True)
    g = torch.randn(T, B, H * hd, dtype=torch.float64).transpose(0, 1)
    (grad,) = torch.autograd.grad(op(qkv, None, H), qkv, g)
    qkv_ref = qkv.detach().clone().requires_grad_()
    (grad_ref,) = torch.autograd.grad(reference.attention_core(qkv_ref, None, H)[0], qkv_ref, g)
    assert rel_err(grad, grad_ref) <= 1e-12


@pytest.mark.parametrize("mask_kind", ["none", "right", "random", "left"])
def test_gradcheck(mask_kind):
    B, T, H, hd = 2, 9, 2, 4
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64, requires_grad=True)
    mask = _block_mask(B, T, mask_kind) if mask_kind == "left" else make_mask(mask_kind, B, T)
    assert torch.autograd.gradcheck(lambda t: op(t, mask, H), (qkv,))


@pytest.mark.parametrize("mask_kind", ["none", "right", "left"])
def test_double_backward_matches_reference(mask_kind):
    """create_graph=True (gradient penalties): the second derivative is the reference's."""
    B, T, H, hd = 2, 11, 2, 4
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    mask = _block_mask(B, T, mask_kind) if mask_kind == "left" else make_mask(mask_kind, B, T)

    def second(fn) -> torch.Tensor:
        x = qkv.clone().requires_grad_()
        (g,) = torch.autograd.grad((fn(x) ** 2).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g**2).sum(), x)
        return gg

    ours = second(lambda x: op(x, mask, H))
    ref = second(lambda x: reference.attention_core(x, mask, H)[0])
    assert ours.abs().sum() > 0
    assert rel_err(ours, ref) <= 1e-10
    assert torch.autograd.gradgradcheck(lambda x: op(x, mask, H), (qkv.clone().requires_grad_(),))


def test_lse_matches_reference_logsumexp():
    B, T, H, hd = 2, 300, 3, 16
    qkv = torch.randn(B, T, 3 * H * hd, dtype=torch.float64)
    mask = _block_mask(B, T, "left")
    out, lse = torch.ops.causal_attention.attention_forward(qkv, mask, H)
    assert lse.shape == (B, H, T) and lse.dtype == torch.float64
    q, k, _ = qkv.view(B, T, 3, H, hd).unbind(2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5
    allowed = torch.ones(T, T, dtype=torch.bool).tril() & mask[:, None, None, :]
    expected = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # -inf on empty rows
    empty = ~allowed.any(-1).expand(B, H, T)
    assert torch.equal(lse[empty], torch.full_like(lse[empty], float("inf")))  # empty rows: +inf
    assert rel_err(lse[~empty], expected[~empty]) <= 1e-12
    assert torch.count_nonzero(out.view(B, T, H, hd).transpose(1, 2)[empty]) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
def test_a_nan_key_reaches_exactly_the_queries_that_see_it(dtype):
    """A NaN in one key (head 0, position 150) makes every output of head 0 from query 150 on NaN, as
    the reference's softmax would, and leaves the earlier queries and the other head bit for bit as
    without it (the score is computed in their tiles too, but past their causal limit); the decode op
    likewise for the one sequence whose cache holds the NaN key."""
    B, T, H, hd, pos = 2, 300, 2, 64, 150
    qkv = torch.randn(B, T, 3 * H * hd).to(dtype)
    bad = qkv.clone()
    bad[:, pos, H * hd + 5] = float("nan")  # k of head 0, one coordinate
    clean, _ = torch.ops.causal_attention.attention_forward(qkv, None, H)
    out, _ = torch.ops.causal_attention.attention_forward(bad, None, H)
    assert out[:, pos:, :hd].isnan().all()
    assert torch.equal(out[:, :pos], clean[:, :pos])
    assert torch.equal(out[:, :, hd:], clean[:, :, hd:])

    k, v = torch.randn(2, B, H, T, hd).to(dtype)
    k[0, 0, pos, 5] = float("nan")
    start = torch.full((B,), T - 1)
    step = torch.randn(B, 1, 3 * H * hd).to(dtype)
    y = torch.ops.causal_attention.decode_attention(step, k, v, start, start + 1, H)
    assert y[0, :, :hd].isnan().all()
    assert not y[0, :, hd:].isnan().any() and not y[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_deterministic_and_thread_count_independent(dtype):
    B, T, H, hd = 2, 400, 4, 32
    qkv = torch.randn(B, T, 3 * H * hd, dtype=dtype)
    mask = make_mask("right", B, T)
    g = torch.randn(B, T, H * hd, dtype=dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        x = qkv.clone().requires_grad_()
        y = op(x, mask, H)
        y.backward(g)
        return y.detach(), x.grad

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y1, g1 = run()
        y2, g2 = run()
        torch.set_num_threads(1)
        y3, g3 = run()
        torch.set_num_threads(3)  # an odd count, more threads than items of some sequences
        y4, g4 = run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)  # same inputs and threads: bitwise
    # Work items (taken by whichever thread is free) do not depend on the thread count: the same bits.
    assert torch.equal(y1, y3) and torch.equal(g1, g3)
    assert torch.equal(y1, y4) and torch.equal(g1, g4)


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    attn = CausalSelfAttention(64, 4)
    compiled = torch.compile(attn, fullgraph=True)
    x = torch.randn(3, 50, 64)
    mask = make_mask("right", 3, 50)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_eager = attn(x1, mask)
    y_comp = compiled(x2, mask)
    assert rel_err(y_comp, y_eager) <= 1e-5
    g = torch.randn_like(y_eager)
    y_eager.backward(g)
    grads_eager = [x1.grad] + [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    y_comp.backward(g)
    grads_comp = [x2.grad] + [p.grad for p in attn.parameters()]
    for a, b in zip(grads_comp, grads_eager):
        assert rel_err(a, b) <= 1e-5


def test_fake_kernels_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(2, 5, 3 * 16, dtype=torch.bfloat16)
        out, lse = torch.ops.causal_attention.attention_forward(qkv, None, 4)
        grad = torch.ops.causal_attention.attention_backward(out, qkv, None, out, lse, 4)
    assert out.shape == (2, 5, 16) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert grad.shape == (2, 5, 48)


_ISA_SCRIPT = """
import torch, causal_attention
from causal_attention.attention import reference
torch.manual_seed(0)
qkv = torch.randn(2, 300, 3 * 4 * 40, requires_grad=True)
mask = torch.arange(300)[None, :] < torch.tensor([[300], [170]])
y = torch.ops.causal_attention.attention(qkv, mask, 4)
ref = reference.attention_core(qkv.detach().double(), mask, 4)[0]
err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
g, = torch.autograd.grad(y.sum(), qkv)
# bfloat16 with large scores: error against float64 relative to torch's SDPA at bfloat16.
x = (qkv.detach() * 3).bfloat16()
exact = reference.attention_core(x.double(), mask, 4)[0]
rel = lambda a: ((a.double() - exact).abs().max() / exact.abs().max()).item()
ratio = rel(torch.ops.causal_attention.attention(x, mask, 4)) / rel(causal_attention.attention.backends.RUN["sdpa"](x, mask, 4))
print(torch.ops.causal_attention.cpu_capability(), err, bool(g.isfinite().all()), ratio)
"""


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_each_instruction_set_is_exact(capability):
    """The element-wise routines of each instruction set, forced with ATEN_CPU_CAPABILITY."""
    if capability == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU has no AVX-512")
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2")
    env = isa_env(capability)
    result = subprocess.run([sys.executable, "-c", _ISA_SCRIPT], env=env, capture_output=True, text=True, check=True)
    name, err, finite, bf16_ratio = result.stdout.split()
    assert name == capability.upper()
    assert float(err) <= 2e-6 and finite == "True"
    assert float(bf16_ratio) <= 3.0


# The suites that compare the kernels with the reference and nn.MultiheadAttention in every dtype,
# with padding, dropout, adversarial half-precision magnitudes and non-finite inputs, and the ci
# profile of the float64-reference fuzz (test_fuzz.py).
PATH_SUITES = ("test_engine.py", "test_parity.py", "test_precision.py", "test_compile.py", "test_autograd.py",
               "test_dropout.py", "test_properties.py", "test_nonfinite.py", "test_fuzz.py", "test_gqa.py",
               "test_unrounded.py", "../models/test_rotary.py",
               "test_projection.py::test_widened_addmm_sums_in_float32_and_rounds_once",
               "test_projection.py::test_widened_products_names_the_route",
               "test_cache.py::test_cache_refuses_grad_mode_whatever_wants_a_gradient",
               "test_cache.py::test_a_full_sequence_does_not_block_the_batch",
               "test_cache.py::test_kv_cache_write_writes_only_real_tokens",
               "test_decode.py::test_decode_is_bitwise_independent_of_the_thread_count")

# The instruction sets below each default, in the order ATen ranks them.
_LOWER = {"AVX512": ["avx2", "default"], "AVX2": ["default"], "DEFAULT": []}


def _amx_tiles() -> bool:
    return str(torch.ops.causal_attention.tile_products(torch.bfloat16)) == "AMX-BF16 tiles"


def test_tile_products_names_the_path():
    """What runs the tile products, as the C++ side says it (test_flash.cpp): the ISA's float32
    micro-kernel for float32 and half, BLAS for float64, and bfloat16's pair kernel where it runs."""
    ops = torch.ops.causal_attention
    isa = str(ops.cpu_capability())
    micro = "BLAS" if isa == "DEFAULT" else f"{isa} float32 micro-kernel"
    assert ops.tile_products(torch.float32) == micro and ops.tile_products(torch.float16) == micro
    assert ops.tile_products(torch.float64) == "BLAS"
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    pairs = "AMX-BF16 tiles" if "amx_bf16" in flags else "AVX512-BF16 pairs"
    assert ops.tile_products(torch.bfloat16) == (pairs if isa == "AVX512" and "avx512_bf16" in flags else micro)
    with pytest.raises(ValueError, match="tile_products: dtype must be a floating type"):
        ops.tile_products(torch.int32)


@pytest.mark.parametrize("capability", ["avx2", "default", "avx512-bf16"])
def test_kernel_suites_on_each_lower_instruction_set(capability, tmp_path):
    """The kernel suites run once more under ATEN_CPU_CAPABILITY for each instruction set below this
    CPU's default (on AVX-512: AVX2's float32 micro-kernel, bfloat16 on widened operands instead of the
    pair kernel, and the DEFAULT build's BLAS products and scalar routines), so that a change is tested on
    every path the CPU can run, not only on the one it was written on. The default path is the whole
    suite's own run.

    The sub-run has its own inductor cache: inductor's cache does not tell the two capabilities apart,
    and an AVX-512 run's compiled graph loaded under avx2 gave wrong results and a corrupted heap (seen
    with torch 2.13 on the compiled sdpa backend of test_compile). On a CPU with AMX, "avx512-bf16" runs
    them on the bfloat16 pair kernel's vdpbf16ps path, below the AMX tiles the default run takes."""
    default = torch.backends.cpu.get_cpu_capability()
    if capability == "avx512-bf16":
        if not _amx_tiles():
            pytest.skip("bfloat16's tile products are not on AMX here: the whole suite ran the pair kernel's path")
    elif capability not in _LOWER.get(default, []):
        pytest.skip(f"{capability.upper()} is not below this CPU's default ({default}): the whole suite ran it")
    here = os.path.dirname(os.path.abspath(__file__))
    env = isa_env(capability, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    probe = subprocess.run([sys.executable, "-c", "import torch, causal_attention; "
                            "print(torch.ops.causal_attention.cpu_capability(), "
                            "torch.ops.causal_attention.tile_products(torch.bfloat16))"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.split()[0] == capability.split("-")[0].upper(), probe.stdout
    if capability == "avx512-bf16":
        assert "AVX512-BF16 pairs" in probe.stdout, probe.stdout
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           *(os.path.join(here, name) for name in PATH_SUITES)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise AssertionError(f"the {capability} run of {PATH_SUITES} took over 1200 s; its output so far:\n"
                             f"{partial[-6000:]}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


_ONE_KEY_SCRIPT = """
import torch, causal_attention
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    dq = 0.0
    for heads, hd in ((4, 12), (2, 64)):  # head_dim 64: two AMX chunks of 16 pairs where bfloat16 has tiles
        qkv = (8 * torch.randn(3, 1, 3 * heads * hd)).to(dtype).requires_grad_()
        y = torch.ops.causal_attention.attention(qkv, None, heads)
        g, = torch.autograd.grad(y, qkv, torch.randn_like(y))
        dq = max(dq, g[..., :heads * hd].abs().max().item())
    print(torch.ops.causal_attention.cpu_capability(), dtype, dq)
"""


@pytest.mark.parametrize("capability", ["avx2", "avx512", "avx512-bf16"])
def test_micro_kernel_one_key_gives_exact_zero_query_gradient(capability):
    """T = 1 on the micro-kernels (AVX2 and AVX512: float32's, and bfloat16's pair kernel where the CPU has
    AVX512-BF16, on AMX tiles where it has them and, avx512-bf16, held to vdpbf16ps there): the single weight
    is 1 whatever q is, so dQ = dS k with dS = P (dP - delta) is 0. delta = dO . O is summed in the kernel's
    order, so it cancels dP = dO . v bit for bit where O is exactly v: bfloat16 and float16 (O rounded back to
    v) get exactly 0 (ATen's sum of delta left ~1e-5 there). In float32 the row's largest key weighs exactly 1
    (exp.h, scaled_max: the shift rounded down, the exponent clamped to 0), so O = v exactly: before, P =
    exp(rounding residue) ~ 1 + 1e-7 left a residue of 1e-5 (and make fuzz caught 2.8e-5 of relative error at
    scores of std 8)."""
    default = torch.backends.cpu.get_cpu_capability()
    if default == "DEFAULT" or (capability.startswith("avx512") and default != "AVX512"):
        pytest.skip(f"this CPU has no {capability.upper()}")
    if capability == "avx512-bf16" and not _amx_tiles():
        pytest.skip("bfloat16's tile products are not on AMX here: the avx512 case runs the pair kernel's path")
    env = isa_env(capability)
    result = subprocess.run([sys.executable, "-c", _ONE_KEY_SCRIPT], env=env, capture_output=True, text=True,
                            check=True)
    lines = result.stdout.split("\n")[:3]
    for line in lines:
        name, dtype, dq = line.split()
        assert name == capability.split("-")[0].upper(), line
        assert float(dq) <= (1e-12 if dtype == "torch.float32" else 0.0), line
