"""Generation: the static KV cache, the decode kernel, and the tiny GPT's generate()."""

from __future__ import annotations

import mmap
import os
import sys
import warnings

import pytest
import torch
import torch.nn.utils.prune
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from causal_attention import CausalSelfAttention, KVCache
from causal_attention.attention import backends
from causal_attention.attention.cache import advise_huge_pages
from causal_attention.models import GPTConfig, TinyGPT
from helpers import OpLog, rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CACHE_BACKENDS = ("cpp", "sdpa")


def _ragged(B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence lengths in [1, T] (the first is T) and prompt lengths in [1, length]."""
    lengths = torch.randint(1, T + 1, (B,))
    lengths[0] = T
    prompts = (torch.rand(B) * lengths).long().clamp(1, None)
    return lengths, prompts


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_prefill_then_decode_equals_full_forward(backend, dtype):
    B, T, H, hd = 4, 40, 3, 16
    attn = CausalSelfAttention(H * hd, H, backend=backend, dtype=dtype)
    x = torch.randn(B, T, H * hd, dtype=dtype)
    lengths, prompts = _ragged(B, T)
    full_mask = torch.arange(T)[None, :] < lengths[:, None]
    with torch.no_grad():
        full = attn(x, full_mask)  # (B, T, dim)
        cache = attn.make_cache(B, 2 * T)  # finished sequences keep taking (ignored) tokens
        P = int(prompts.max())
        prompt_mask = torch.arange(P)[None, :] < prompts[:, None]
        out = attn(x[:, :P], prompt_mask, cache=cache)  # right-padded prefill
        assert torch.equal(cache.lengths, prompts)
        real = prompt_mask
        assert rel_err(out[real], full[:, :P][real]) <= TOL[dtype]
        positions = prompts.clone()
        for _ in range(T - int(prompts.min())):
            step_x = x[torch.arange(B), positions.clamp(max=T - 1)][:, None]  # (B, 1, dim): each at its own position
            y = attn(step_x, cache=cache)[:, 0]
            live = positions < lengths
            assert rel_err(y[live], full[torch.arange(B), positions.clamp(max=T - 1)][live]) <= TOL[dtype]
            positions += 1
            assert torch.equal(cache.lengths, positions)
            if bool((positions >= T).all()):
                break


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
def test_ragged_batch_equals_each_sequence_alone(backend):
    B, T, H, hd = 3, 30, 2, 8
    attn = CausalSelfAttention(H * hd, H, backend=backend, dtype=torch.float64)
    x = torch.randn(B, T, H * hd, dtype=torch.float64)
    prompts = torch.tensor([30, 11, 1])
    with torch.no_grad():
        cache = attn.make_cache(B, T + 5)
        batch_prefill = attn(x, torch.arange(T)[None, :] < prompts[:, None], cache=cache)
        new = torch.randn(B, 5, 1, H * hd, dtype=torch.float64)
        batch_steps = [attn(new[:, s], cache=cache) for s in range(5)]
        for b in range(B):
            alone = attn.make_cache(1, T + 5)
            p = int(prompts[b])
            solo_prefill = attn(x[b : b + 1, :p], cache=alone)
            assert rel_err(batch_prefill[b, :p], solo_prefill[0]) <= 1e-12
            for s in range(5):
                assert rel_err(batch_steps[s][b], attn(new[b : b + 1, s], cache=alone)[0]) <= 1e-12


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
def test_chunked_prefill_equals_single_prefill(backend):
    B, T, H, hd = 3, 37, 2, 16
    attn = CausalSelfAttention(H * hd, H, backend=backend)
    x = torch.randn(B, T, H * hd)
    first = torch.tensor([10, 4, 1])  # first chunk lengths (right-padded chunk of 10)
    second = torch.tensor([27, 9, 0])  # second chunk lengths (right-padded chunk of 27)
    with torch.no_grad():
        one = attn.make_cache(B, 64)
        packed = torch.stack([torch.cat([x[b, : first[b]], x[b, 10 : 10 + second[b]], x[b, : T - first[b] - second[b]]]) for b in range(B)])
        total = first + second
        y_one = attn(packed, torch.arange(T)[None, :] < total[:, None], cache=one)
        two = attn.make_cache(B, 64)
        y_a = attn(x[:, :10], torch.arange(10)[None, :] < first[:, None], cache=two)
        y_b = attn(x[:, 10:], torch.arange(27)[None, :] < second[:, None], cache=two)
    assert torch.equal(one.lengths, two.lengths) and torch.equal(two.lengths, total)
    for b in range(B):
        f, s = int(first[b]), int(second[b])
        assert rel_err(y_a[b, :f], y_one[b, :f]) <= 1e-5
        assert rel_err(y_b[b, :s], y_one[b, f : f + s]) <= 1e-5
        n = f + s
        assert rel_err(two.k[b, :, :n], one.k[b, :, :n]) <= 1e-6
        assert rel_err(two.v[b, :, :n], one.v[b, :, :n]) <= 1e-6


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
def test_cache_holds_exactly_what_was_written_and_reset_clears(backend):
    B, T, H, hd = 2, 9, 2, 4
    attn = CausalSelfAttention(H * hd, H, backend=backend)
    x = torch.randn(B, T, H * hd)
    mask = torch.arange(T)[None, :] < torch.tensor([[9], [5]])
    with torch.no_grad():
        cache = attn.make_cache(B, 16)
        attn(x, mask, cache=cache)
        qkv = attn.qkv(x)  # (B, T, 3 * dim)
    k = qkv[..., H * hd : 2 * H * hd].view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
    v = qkv[..., 2 * H * hd :].view(B, T, H, hd).transpose(1, 2)
    written = mask[:, None, :, None]  # (B, 1, T, 1): the real tokens, and only they, are written
    assert torch.equal(cache.k[:, :, :T], torch.where(written, k, 0)) and torch.equal(cache.v[:, :, :T], torch.where(written, v, 0))
    assert torch.count_nonzero(cache.k[:, :, T:]) == 0 and torch.count_nonzero(cache.v[:, :, T:]) == 0
    assert cache.lengths.tolist() == [9, 5]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]


def test_generating_leaves_the_state_dict_as_a_fresh_model_has_it():
    """Caches live outside the module: after generating, the state_dict has a fresh model's keys and
    values, no tensor of it is (or shares memory with) a cache, and it loads strictly into a new model."""
    config = GPTConfig(vocab_size=11, max_len=16, dim=32, n_layers=2, n_heads=2)
    model = TinyGPT(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    caches = model.make_caches(2)
    with torch.no_grad():
        model(torch.zeros(2, 3, dtype=torch.long), caches=caches)
    state = model.state_dict()
    assert list(state) == list(TinyGPT(config).state_dict())
    assert all(torch.equal(state[k], before[k]) for k in before)
    cache_tensors = [t for c in caches for t in (c.k, c.v, c.lengths)]
    assert not any(s.untyped_storage().data_ptr() == c.untyped_storage().data_ptr() for s in state.values() for c in cache_tensors)
    TinyGPT(config).load_state_dict(state, strict=True)
    attn = CausalSelfAttention(16, 2)
    attn(torch.randn(1, 2, 16).requires_grad_(False))
    with torch.no_grad():
        attn(torch.randn(1, 2, 16), cache=attn.make_cache(1, 4))
    assert list(attn.state_dict()) == ["qkv.weight", "qkv.bias", "proj.weight", "proj.bias"]


@pytest.mark.parametrize("backend", CACHE_BACKENDS)
def test_cache_errors(backend):
    attn = CausalSelfAttention(16, 2, backend=backend)
    cache = attn.make_cache(2, 5)
    with torch.no_grad():
        attn(torch.randn(2, 4, 16), cache=cache)
        with pytest.raises(ValueError, match="KV cache overflow"):
            attn(torch.randn(2, 2, 16), cache=cache)
        with pytest.raises(ValueError, match="must be right padding"):
            left_padded = torch.tensor([[False, True, True], [True, True, True]])
            attn(torch.randn(2, 3, 16), left_padded, cache=attn.make_cache(2, 5))
        with pytest.raises(ValueError, match=r"cache must hold \(B, n_heads, max_len, head_dim\)"):
            attn(torch.randn(3, 1, 16), cache=cache)
        with pytest.raises(TypeError, match="cache must be a KVCache"):
            attn(torch.randn(2, 1, 16), cache={"k": 1})
    with pytest.raises(ValueError, match="the KV cache is for inference"):
        attn(torch.randn(2, 1, 16), cache=attn.make_cache(2, 5))


@pytest.mark.parametrize("t_new", [1, 2, 7, 16, 70])
@pytest.mark.parametrize("B, H", [(1, 1), (2, 3), (8, 12)])
def test_decode_kernel_against_torch(t_new, B, H):
    """The C++ decode op (context split when B * H is small) against the plain-torch cache path."""
    hd, L = 24, 700
    qkv = torch.randn(B, t_new, 3 * H * hd, dtype=torch.float64)
    start = torch.randint(0, L - t_new, (B,))
    start[0] = 0
    end = start + torch.randint(0, t_new + 1, (B,))  # some new tokens are padding; end may be 0
    k = torch.randn(B, H, L, hd, dtype=torch.float64)
    v = torch.randn(B, H, L, hd, dtype=torch.float64)
    ours = (k.clone(), v.clone())
    torch.ops.causal_attention.kv_cache_write(qkv, ours[0], ours[1], start, end, H)
    y = torch.ops.causal_attention.decode_attention(qkv, ours[0], ours[1], start, end, H)
    ref_cache = KVCache(k.clone(), v.clone(), start.clone())
    y_ref = backends.cached_attention_torch(qkv, ref_cache, start, end, H)
    assert torch.equal(ours[0], ref_cache.k) and torch.equal(ours[1], ref_cache.v)
    assert rel_err(y, y_ref) <= 1e-12
    empty = end == 0
    assert torch.count_nonzero(y[empty]) == 0


@pytest.mark.parametrize("layout", ["expanded_time", "one_row_odd_stride"])
def test_decode_kernel_odd_row_strides(layout):
    """qkv views whose rows are closer than a row length apart (T expanded; one row whose stride
    PyTorch ignores) give what their contiguous copies give."""
    B, H, hd, L = 2, 3, 16, 300
    C = 3 * H * hd
    if layout == "expanded_time":  # 40 new tokens: the tiled forward
        qkv = torch.randn(B, 1, C, dtype=torch.float64).expand(B, 40, C)
    else:
        qkv = torch.randn(B, C, 1, dtype=torch.float64).transpose(1, 2)
        assert qkv.stride(1) < C
    t = qkv.shape[1]
    start = torch.tensor([0, 100])
    end = start + t
    k = torch.randn(B, H, L, hd, dtype=torch.float64)
    v = torch.randn(B, H, L, hd, dtype=torch.float64)
    torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, end, H)
    y = torch.ops.causal_attention.decode_attention(qkv, k, v, start, end, H)
    fresh = torch.empty(qkv.shape, dtype=qkv.dtype).copy_(qkv)  # canonical strides
    y_ref = torch.ops.causal_attention.decode_attention(fresh, k, v, start, end, H)
    assert rel_err(y, y_ref) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("t_new", [1, 5, 40])
def test_decode_kernel_low_precision(dtype, t_new):
    """The decode op at the working dtypes: error against float64 within 3x of the plain-torch path's."""
    B, H, hd, L = 3, 4, 32, 400
    qkv = (torch.randn(B, t_new, 3 * H * hd) * 2).to(dtype)
    start = torch.tensor([0, 100, 300])
    end = start + t_new
    k = torch.randn(B, H, L, hd).to(dtype)
    v = torch.randn(B, H, L, hd).to(dtype)
    exact = backends.cached_attention_torch(qkv.double(), KVCache(k.double(), v.double(), start.clone()), start, end, H)
    kc, vc = k.clone(), v.clone()
    torch.ops.causal_attention.kv_cache_write(qkv, kc, vc, start, end, H)
    ours = torch.ops.causal_attention.decode_attention(qkv, kc, vc, start, end, H)
    plain = backends.cached_attention_torch(qkv, KVCache(k.clone(), v.clone(), start.clone()), start, end, H)
    assert ours.dtype == dtype
    assert rel_err(ours, exact) <= 3 * rel_err(plain, exact) + (1e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("hd", [8, 48, 64, 80])
@pytest.mark.parametrize("T, H, Hkv", [(17, 2, 2), (113, 4, 2), (1025, 2, 1)])
def test_a_prefill_into_the_cache_is_the_uncached_forward_bit_for_bit(dtype, hd, T, H, Hkv):
    """More than 16 new queries into an empty cache (right-padded prompts, GQA/MQA, a cache longer than
    the prompts) give the uncached forward's bits at every row, padding rows included."""
    B, L = 3, T + 40
    qkv = torch.randn(B, T, (H + 2 * Hkv) * hd).to(dtype)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [T // 2], [1]])
    start, end = torch.zeros(B, dtype=torch.long), mask.sum(1)
    k, v = torch.zeros(B, Hkv, L, hd, dtype=dtype), torch.zeros(B, Hkv, L, hd, dtype=dtype)
    ops.kv_cache_write(qkv, k, v, start, end, H, Hkv)
    cached = ops.decode_attention(qkv, k, v, start, end, H, Hkv)
    assert torch.equal(cached, ops.attention(qkv, mask, H, n_kv_heads=Hkv))


@pytest.mark.parametrize("case", ["ragged_starts", "past_max_len", "gqa_ragged"])
def test_many_new_queries_against_torch(case):
    """More than 16 new queries after ragged pasts, rows of padding that would sit past the cache's
    end, and GQA: the op against the plain-torch cache path in float64."""
    B, hd, L, t = 3, 16, 90, 33
    H, Hkv = (4, 2) if case == "gqa_ragged" else (3, 3)
    start = torch.tensor([0, 20, 57]) if case != "past_max_len" else torch.tensor([70, 70, 70])
    end = start + torch.tensor([t, 5, 0]) if case != "past_max_len" else torch.tensor([L, 75, 70])
    qkv = torch.randn(B, t, (H + 2 * Hkv) * hd, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, hd, dtype=torch.float64)
    v = torch.randn(B, Hkv, L, hd, dtype=torch.float64)
    ref_cache = KVCache(k.clone(), v.clone(), start.clone())
    expected = backends.cached_attention_torch(qkv, ref_cache, start, end, H, Hkv)
    ops.kv_cache_write(qkv, k, v, start, end, H, Hkv)
    y = ops.decode_attention(qkv, k, v, start, end, H, Hkv)
    assert torch.equal(k, ref_cache.k) and torch.equal(v, ref_cache.v)
    assert rel_err(y, expected) <= 1e-12
    assert torch.count_nonzero(y[end == 0]) == 0  # no key: 0


def test_decode_step_compiles_once():
    torch._dynamo.reset()
    attn = CausalSelfAttention(32, 4)
    cache = attn.make_cache(3, 40)
    step = torch.compile(lambda x: attn(x, cache=cache), fullgraph=True, dynamic=False)
    with torch.no_grad():
        attn(torch.randn(3, 5, 32), torch.arange(5)[None, :] < torch.tensor([[5], [2], [4]]), cache=cache)
        eager_cache = KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(6):
                x = torch.randn(3, 1, 32)
                y = step(x)
                y_eager = attn(x, cache=eager_cache)
                assert rel_err(y, y_eager) <= 1e-5
    assert torch.equal(cache.lengths, eager_cache.lengths)
    assert cache.lengths.tolist() == [11, 8, 10]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_decode_kernel_long_contexts_span_several_streamed_chunks(dtype):
    """Contexts longer than one decode_chunk call (512 KB of keys and values: 1365 keys of 24 in
    float64, 1024 of 64 in float32, 2048 in bfloat16) and not split (B * H >= 64): the running
    softmax carried across calls, against the plain-torch path in float64."""
    B, H = 8, 8
    hd, L = (24, 3000) if dtype == torch.float64 else (64, 4200)
    qkv = torch.randn(B, 1, 3 * H * hd, dtype=torch.float64)
    start = torch.tensor([L - 1, 2 * L // 3, 1030, 2049, 1023, 1, 0, L // 2])
    end = start + 1
    k, v = torch.randn(B, H, L, hd, dtype=torch.float64), torch.randn(B, H, L, hd, dtype=torch.float64)
    exact = backends.cached_attention_torch(qkv, KVCache(k.clone(), v.clone(), start.clone()), start, end, H)
    kc, vc = k.to(dtype), v.to(dtype)
    ops.kv_cache_write(qkv.to(dtype), kc, vc, start, end, H)
    ours = ops.decode_attention(qkv.to(dtype), kc, vc, start, end, H).double()
    rounded = backends.cached_attention_torch(  # the same inputs rounded to dtype, computed in float64
        qkv.to(dtype).double(), KVCache(k.to(dtype).double(), v.to(dtype).double(), start.clone()), start, end, H
    )
    # Measured: 1.6e-16, 6e-8 and 2.3e-3 against both (bfloat16: P and the sums' roundings).
    assert rel_err(ours, rounded) <= {torch.float64: 1e-14, torch.float32: 5e-7, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(ours, exact) <= {torch.float64: 1e-14, torch.float32: 5e-7, torch.bfloat16: 1e-2}[dtype]


ops = torch.ops.causal_attention


def _decode_layer_inputs(B: int, t: int, H: int, hd: int, ctx: int, dtype: torch.dtype, bias: bool):  # type: ignore[no-untyped-def]
    """A layer's weights, a ragged cache (contexts in [0, ctx]), x, and a right-padding mask (B, t)."""
    dim = H * hd
    attn = CausalSelfAttention(dim, H, bias=bias, dtype=dtype)
    x = torch.randn(B, t, dim).to(dtype)
    k, v = torch.randn(B, H, ctx + t, hd).to(dtype), torch.randn(B, H, ctx + t, hd).to(dtype)
    lengths = torch.randint(0, ctx + 1, (B,))
    mask = torch.arange(t)[None, :] < torch.randint(0, t + 1, (B, 1))
    return attn, x, k, v, lengths, mask


def _fused_and_in_turn(B: int, t: int, H: int, hd: int, ctx: int, dtype: torch.dtype, bias: bool, masked: bool):  # type: ignore[no-untyped-def]
    """decode_layer on fresh inputs, and cache_end, few_rows_linear (qkv), kv_cache_write,
    decode_attention and few_rows_linear (proj) in turn on copies: (fused, in_turn, before), the
    first two as (out, k, v, lengths), before as (k, lengths)."""
    attn, x, k, v, lengths, mask = _decode_layer_inputs(B, t, H, hd, ctx, dtype, bias)
    mask = mask if masked else None
    w, b, pw, pb = attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias
    with torch.no_grad():
        k1, v1 = k.clone(), v.clone()
        end = ops.cache_end(lengths, mask, t, ctx + t)
        qkv = ops.few_rows_linear(x, w, b)
        ops.kv_cache_write(qkv, k1, v1, lengths, end, H)
        expected = ops.few_rows_linear(ops.decode_attention(qkv, k1, v1, lengths, end, H), pw, pb)
        k2, v2, lengths2 = k.clone(), v.clone(), lengths.clone()
        out = ops.decode_layer(x, w, b, pw, pb, k2, v2, lengths2, mask, H)
    return (out, k2, v2, lengths2), (expected, k1, v1, end), (k, lengths)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["f64", "f32", "bf16", "f16"])
@pytest.mark.parametrize("B, t, H, hd, ctx", [(4, 1, 12, 64, 1025), (1, 1, 2, 8, 1), (3, 2, 2, 48, 113),
                                               (2, 4, 1, 80, 7), (8, 1, 3, 64, 0), (1, 20, 2, 16, 50), (1, 1, 3, 5, 40)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
def test_decode_layer_equals_the_ops_in_turn(dtype, B, t, H, hd, ctx, bias, masked):
    """The fused decode step: output, cache and lengths bit for bit those of cache_end,
    few_rows_linear (qkv), kv_cache_write, decode_attention and few_rows_linear (proj) in turn."""
    fused, in_turn, (k_before, start) = _fused_and_in_turn(B, t, H, hd, ctx, dtype, bias, masked)
    assert fused[0].dtype == dtype and fused[0].shape == (B, t, H * hd)
    assert all(torch.equal(a, b) for a, b in zip(fused, in_turn))  # out, k, v, lengths
    assert not torch.equal(fused[1], k_before) or bool((in_turn[3] == start).all())  # the new keys were written


@settings(max_examples=60, deadline=None, derandomize=True)
@given(B=st.integers(1, 4), t=st.integers(0, 6), H=st.integers(1, 4), hd=st.sampled_from([1, 3, 8, 16, 24, 33]),
       ctx=st.integers(0, 1300), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       bias=st.booleans(), masked=st.booleans(), threads=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**31 - 1))
def test_decode_layer_is_the_ops_in_turn_on_any_shape(B, t, H, hd, ctx, dtype, bias, masked, threads, seed):
    """Hypothesis over shapes (no new token, head sizes that fill no vector, contexts past one
    streamed chunk), dtypes and thread counts: decode_layer's output, cache and lengths bit for bit
    the ops' in turn."""
    torch.manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, in_turn, _ = _fused_and_in_turn(B, t, H, hd, ctx, dtype, bias, masked)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(fused, in_turn))  # out, k, v, lengths


def test_the_modules_decode_step_is_the_fused_op_and_a_prefill_is_not():
    """A cached step of few rows (B * t <= FEW_ROWS, no autograd, the engine's backend) runs one
    decode_layer op, and gives a fresh layer's full forward; more rows take the ops one by one."""
    attn = CausalSelfAttention(32, 4, dtype=torch.float64)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        full = attn(x)
        cache = attn.make_cache(2, 12)
        with OpLog() as prefill:
            attn(x[:, :8], cache=cache)  # 16 rows
        with OpLog() as step:
            y = attn(x[:, 8:], cache=cache)  # 2 rows
    assert "causal_attention.decode_layer.default" not in prefill.names
    assert "causal_attention.decode_attention.default" in prefill.names
    assert step.names.count("causal_attention.decode_layer.default") == 1
    assert "causal_attention.decode_attention.default" not in step.names
    assert rel_err(y, full[:, 8:]) <= 1e-12
    assert cache.lengths.tolist() == [9, 9]


class _Doubled(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


# Projections a decode step may stream (their call is their weight product) and projections it
# must call (hooks, a forward of their own, a quantized layer).
_STREAMED_CASES = ["plain", "parametrized", "plain_tensor_weight", "instance_dict_weight", "new_parameter",
                   "new_module", "subclass_property", "linear_subclass_property"]
_CALLED_CASES = ["forward_hook", "forward_pre_hook", "pruned", "instance_forward", "global_hook",
                 "dynamic_quantized"]


def _layer_for_case(case: str) -> tuple[CausalSelfAttention, list]:
    """A layer whose projections are set up as the case says, and handles to remove afterwards."""
    handles: list = []
    dtype = torch.float32 if case == "dynamic_quantized" else torch.float64
    cls = CausalSelfAttention
    if case == "subclass_property":
        other = torch.nn.Linear(32, 96, dtype=dtype)

        class WithProperty(CausalSelfAttention):
            @property
            def qkv(self) -> torch.nn.Linear:  # type: ignore[override]
                return other

            @qkv.setter
            def qkv(self, value: torch.nn.Linear) -> None:
                pass

        cls = WithProperty
    attn = cls(32, 4, dtype=dtype)
    with torch.no_grad():
        if case == "parametrized":
            torch.nn.utils.parametrize.register_parametrization(attn.qkv, "weight", _Doubled())
        elif case == "plain_tensor_weight":
            weight = attn.proj.weight.detach() * 0.5
            del attn.proj.weight
            attn.proj.weight = weight
        elif case == "instance_dict_weight":  # shadows the registered parameter for attribute access
            attn.qkv.__dict__["weight"] = attn.qkv.weight.detach() * 0.5
        elif case == "new_parameter":
            attn.qkv.weight = torch.nn.Parameter(torch.randn(96, 32, dtype=dtype))
        elif case == "new_module":
            attn.proj = torch.nn.Linear(32, 32, dtype=dtype)
        elif case == "linear_subclass_property":  # a property over the registered parameter
            class DoubledLinear(torch.nn.Linear):
                pass

            linear = DoubledLinear(32, 32, dtype=dtype)
            DoubledLinear.weight = property(lambda self: 2 * self._parameters["weight"])  # type: ignore[assignment]
            attn.proj = linear
        elif case == "forward_hook":
            handles.append(attn.proj.register_forward_hook(lambda module, args, out: 2 * out))
        elif case == "forward_pre_hook":
            handles.append(attn.qkv.register_forward_pre_hook(lambda module, args: (0.5 * args[0],)))
        elif case == "pruned":  # the weight is recomputed from weight_orig in a pre-hook
            torch.nn.utils.prune.l1_unstructured(attn.qkv, "weight", amount=0.3)
            attn.qkv.weight_orig.mul_(1.5)  # e.g. an optimizer step: the plain `weight` attribute is stale
        elif case == "instance_forward":  # as accelerate's hooks wrap a module's forward
            proj = attn.proj
            proj.forward = lambda x: 2 * torch.nn.Linear.forward(proj, x)
        elif case == "global_hook":
            handles.append(torch.nn.modules.module.register_module_forward_hook(
                lambda module, args, out: 2 * out if isinstance(module, torch.nn.Linear) else None))
        else:
            assert case in ("plain", "dynamic_quantized", "subclass_property"), case
    if case == "dynamic_quantized":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
            attn = torch.ao.quantization.quantize_dynamic(attn, {torch.nn.Linear}, dtype=torch.qint8)
    return attn, handles


@pytest.mark.parametrize("case", _STREAMED_CASES + _CALLED_CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_a_decode_step_computes_the_projections_as_calling_them_would(case, masked):
    """A decode step streams a projection's weight only where calling the projection computes
    just that product (reading a plain nn.Linear's weight and bias from its parameter dicts, what
    attribute access gives there), honouring a parametrization, a weight set as a plain tensor or
    in the instance dict, a new parameter or submodule, a subclass's property; it calls the
    projections that hooks (their own or global), a forward of their own or quantization make
    more than their weight product. Each step against the full forward, which calls them."""
    torch.manual_seed(0)
    attn, handles = _layer_for_case(case)
    try:
        dtype = torch.float32 if case == "dynamic_quantized" else torch.float64
        x = torch.randn(2, 9, 32, dtype=dtype)
        mask = torch.ones(2, 9, dtype=torch.bool) if masked else None
        with torch.no_grad():
            full = attn(x, mask)
            if case == "dynamic_quantized":
                with pytest.raises(TypeError, match="pass dtype= and device="):
                    attn.make_cache(2, 12)
            cache = attn.make_cache(2, 12, dtype=dtype, device="cpu")
            attn(x[:, :8], None if mask is None else mask[:, :8], cache=cache)
            twin = KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())
            step_mask = None if mask is None else mask[:, 8:]
            with OpLog() as step:
                y = attn(x[:, 8:], step_mask, cache=cache)
            # The projections called as modules around the cached attention.
            called = attn.proj(attn.attend(attn.qkv(x[:, 8:]), step_mask, cache=twin))
        fused = step.names.count("causal_attention.decode_layer.default")
        assert fused == (1 if case in _STREAMED_CASES else 0), step.names
        if case == "dynamic_quantized":  # its activations' scales depend on the rows a call sees
            assert torch.equal(y, called)
        else:
            assert rel_err(y, full[:, 8:]) <= 1e-12
            assert rel_err(y, called) <= 1e-12
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("case", _STREAMED_CASES[:-2] + _CALLED_CASES)
def test_few_rows_linear_is_the_layers_call(case):
    """few_rows_linear (the GPT's decode MLP) gives what calling the layer gives, streaming its
    weight only where the call is the weight product."""
    from causal_attention.attention.decode import few_rows_linear

    torch.manual_seed(0)
    attn, handles = _layer_for_case(case)
    try:
        for layer in (attn.qkv, attn.proj):
            x = torch.randn(4, 1, 32, dtype=torch.float32 if case == "dynamic_quantized" else torch.float64)
            with torch.no_grad(), OpLog() as ops:
                y = few_rows_linear(layer, x)
                expected = layer(x)
            assert torch.equal(y, expected) or rel_err(y, expected) <= 1e-12, case
            streamed = ops.names.count("causal_attention.few_rows_linear.default")
            assert streamed <= 1
    finally:
        for handle in handles:
            handle.remove()


def test_a_decode_step_without_a_mask_dispatches_only_the_fused_op():
    """forward's lean decode step (no mask, few rows): the one decode_layer op and nothing else
    dispatched, and none of the general path's Python checks run (the op makes them)."""
    attn = CausalSelfAttention(32, 4)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        cache = attn.make_cache(2, 8)
        attn(x[:, :5], cache=cache)
        last = x[:, 5:]

        def general_check(*args: object) -> None:
            raise AssertionError("the general path's checks ran")

        attn._check_x = attn._check_cache = general_check  # type: ignore[method-assign]
        with OpLog() as step:
            attn(last, cache=cache)
    assert step.names == ["causal_attention.decode_layer.default"]
    assert cache.lengths.tolist() == [6, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("B, t", [(1, 1), (2, 3), (8, 1), (4, 2)])
def test_the_lean_decode_step_gives_the_general_paths_bits(dtype, bias, B, t):
    """The lean step and forward's general path (the lean one switched off) on copies of one cache
    with ragged lengths: output, keys, values and lengths bit for bit the same."""
    attn = CausalSelfAttention(32, 4, bias=bias, dtype=dtype)
    general = CausalSelfAttention(32, 4, bias=bias, dtype=dtype)
    general.load_state_dict(attn.state_dict())
    general._decode_step = lambda x, cache: None  # type: ignore[method-assign]
    cache = attn.make_cache(B, 12)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.copy_(torch.randint(0, 12 - t + 1, (B,)))
    twin = KVCache(cache.k.clone(), cache.v.clone(), cache.lengths.clone())
    x = torch.randn(B, t, 32, dtype=dtype)
    with torch.no_grad(), OpLog() as lean_ops:
        lean = attn(x, cache=cache)
    with torch.no_grad():
        expected = general(x, cache=twin)
    assert lean_ops.names == ["causal_attention.decode_layer.default"]
    assert torch.equal(lean, expected)
    assert all(torch.equal(a, b) for a, b in zip((cache.k, cache.v, cache.lengths), (twin.k, twin.v, twin.lengths)))


def _refused_step_case(case: str) -> tuple[CausalSelfAttention, KVCache, torch.Tensor, type, str]:
    attn = CausalSelfAttention(16, 2)
    B = 2
    x = torch.randn(B, 1, 16)
    cache = attn.make_cache(B, 6)
    if case == "cache_dtype":
        cache = attn.make_cache(B, 6, dtype=torch.float64)
        return attn, cache, x, ValueError, "cache must match x's dtype and device .* got keys"
    if case == "value_dtype":
        cache.v = cache.v.double()
        return attn, cache, x, ValueError, "cache must match x's dtype and device .* got values in"
    if case == "cache_batch":
        return attn, attn.make_cache(3, 6), x, ValueError, r"cache must hold \(B, n_heads, max_len, head_dim\)"
    if case == "integer_x":
        return attn, cache, torch.ones(B, 1, 16, dtype=torch.int64), TypeError, "x must be a floating-point tensor"
    if case == "weight_dtype":  # x and the cache in float64, the weights in float32: forward's error, naming x
        return (attn, attn.make_cache(B, 6, dtype=torch.float64), x.double(), TypeError,
                r"x must have the layer's parameters' dtype torch.float32; got x of dtype torch.float64")
    if case == "noncontiguous_cache":  # passes forward's checks: the op's error
        cache.k = torch.zeros(B, 2, 8, 6).transpose(2, 3)
        return attn, cache, x, ValueError, "the KV cache buffers must be contiguous"
    if case == "int32_lengths":
        cache.lengths = cache.lengths.int()
        return attn, cache, x, TypeError, "cache lengths must be an int64 tensor"
    if case == "cache_full":
        cache.lengths.fill_(6)
        return attn, cache, x, ValueError, "KV cache overflow"
    assert case == "x_width"  # refused in Python before the op
    return attn, cache, torch.randn(B, 1, 8), ValueError, "x must have last dimension dim=16"


@pytest.mark.parametrize("case", ["cache_dtype", "value_dtype", "cache_batch", "integer_x", "weight_dtype",
                                  "noncontiguous_cache", "int32_lengths", "cache_full", "x_width"])
def test_a_refused_lean_decode_step_raises_forwards_error_and_changes_nothing(case):
    """Where the fused op refuses a step that forward's lean path gave it, nothing is written, the
    op is called once (a step is never applied twice), and forward's checks raise their error,
    which names forward's argument, where one applies; otherwise the op's error is raised."""
    attn, cache, x, error, match = _refused_step_case(case)
    cache.k.normal_()
    before = (cache.k.clone(), cache.v.clone(), cache.lengths.clone())
    with torch.no_grad(), OpLog() as ops, pytest.raises(error, match=match):
        attn(x, cache=cache)
    assert ops.names.count("causal_attention.decode_layer.default") <= 1
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths)))


@pytest.mark.parametrize("on_meta", ["weights", "cache", "lengths"])
def test_a_step_with_some_tensors_on_meta_is_refused(on_meta):
    """The op's meta kernel runs when any argument is on the meta device: it refuses tensors on
    different devices (an uninitialised output came back) and nothing is written."""
    attn = CausalSelfAttention(16, 2, device="meta" if on_meta == "weights" else None)
    cache = attn.make_cache(2, 6, device="cpu")
    if on_meta == "cache":
        cache.k = cache.k.to("meta")
    elif on_meta == "lengths":
        cache.lengths = cache.lengths.to("meta")
    with torch.no_grad(), pytest.raises(ValueError, match="device"):
        attn(torch.randn(2, 1, 16), cache=cache)
    if on_meta != "lengths":
        assert cache.lengths.tolist() == [0, 0]


class _RaiseAfter(TorchDispatchMode):
    """Runs each op, then raises (a failure after the fused op has written)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        func(*args, **(kwargs or {}))
        raise RuntimeError("failed after the op ran")


def test_a_step_that_fails_after_writing_is_applied_once():
    attn = CausalSelfAttention(16, 2)
    cache = attn.make_cache(2, 6)
    x = torch.randn(2, 1, 16)
    with torch.no_grad(), _RaiseAfter(), pytest.raises(RuntimeError, match="failed after the op ran"):
        attn(x, cache=cache)
    assert cache.lengths.tolist() == [1, 1]  # advanced once: the step was not run again


def test_a_cache_of_the_wrong_rank_is_named():
    attn = CausalSelfAttention(16, 2)
    cache = attn.make_cache(2, 6)
    cache.k = cache.k[0]
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache must hold 4-D \(B, n_heads, max_len, head_dim\)"):
        attn(torch.randn(2, 1, 16), cache=cache)


def test_a_fake_tensor_step_takes_the_general_paths_checks():
    """Under FakeTensorMode the op's fake kernel checks nothing: a fake step takes forward's
    general path, whose checks refuse a cache of the wrong batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        attn = CausalSelfAttention(16, 2)
        with pytest.raises(ValueError, match=r"cache must hold \(B, n_heads, max_len, head_dim\)"):
            attn(torch.randn(2, 1, 16), cache=attn.make_cache(3, 6))
        assert attn(torch.randn(2, 1, 16), cache=attn.make_cache(2, 6)).shape == (2, 1, 16)


@pytest.mark.parametrize("case", ["sdpa_backend", "grad_mode_frozen_weights", "nine_rows"])
def test_steps_the_fused_op_does_not_take(case):
    """Where a projection would not take few_rows_matmul's engine path, or the attention not the
    engine's, the step runs op by op, and still equals the full forward."""
    attn = CausalSelfAttention(32, 4, backend="sdpa" if case == "sdpa_backend" else "auto")
    B, t = (3, 3) if case == "nine_rows" else (2, 1)
    x = torch.randn(B, 5 + t, 32)
    with torch.no_grad():
        full = attn(x)
        cache = attn.make_cache(B, 12)
        attn(x[:, :5], cache=cache)
    attn.requires_grad_(False)
    grad = torch.enable_grad() if case == "grad_mode_frozen_weights" else torch.no_grad()
    with grad, OpLog() as step:
        y = attn(x[:, 5:], cache=cache)
    assert "causal_attention.decode_layer.default" not in step.names
    assert rel_err(y, full[:, 5:]) <= 1e-5
    assert cache.lengths.tolist() == [5 + t] * B
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (a cached step refuses autocast's dtype)
        assert attn._decode_layer(x[:, 5:], None, cache) is None
        assert attn._decode_step(x[:, 5:], cache) is None


def test_an_inference_mode_cache_is_stepped_in_inference_mode_only():
    """Inference tensors may be written in place only in inference mode: a step outside it is
    refused before it writes anything, whichever path it would take (B * t = 2 and 10 rows)."""
    attn = CausalSelfAttention(16, 2)
    for t in (1, 5):
        with torch.inference_mode():
            cache = attn.make_cache(2, 8)
        with torch.no_grad(), pytest.raises(ValueError, match="made under torch.inference_mode"):
            attn(torch.randn(2, t, 16), cache=cache)
        assert cache.lengths.tolist() == [0, 0] and not cache.k.any()
        with torch.inference_mode():
            attn(torch.randn(2, t, 16), cache=cache)
        assert cache.lengths.tolist() == [t, t]


def test_decode_layer_errors_name_the_argument_and_change_nothing():
    attn, x, k, v, lengths, _ = _decode_layer_inputs(2, 1, 2, 8, 5, torch.float32, True)
    w, b, pw, pb = attn.qkv.weight.detach(), attn.qkv.bias.detach(), attn.proj.weight.detach(), attn.proj.bias.detach()
    k0, lengths0 = k.clone(), lengths.clone()
    with pytest.raises(ValueError, match=r"qkv_weight must have shape \[48, 16\]"):
        ops.decode_layer(x, w.t(), b, pw, pb, k, v, lengths, None, 2)
    with pytest.raises(TypeError, match=r"proj_bias dtype \(Double\) must match x's \(Float\)"):
        ops.decode_layer(x, w, b, pw, pb.double(), k, v, lengths, None, 2)
    with pytest.raises(ValueError, match="must be right padding"):
        ops.decode_layer(torch.randn(2, 2, 16), w, b, pw, pb, k, v, lengths, torch.tensor([[0, 1], [1, 1]]).bool(), 2)
    full = torch.full((2,), 6)
    with pytest.raises(ValueError, match="KV cache overflow"):
        ops.decode_layer(x, w, b, pw, pb, k, v, full, None, 2)
    with pytest.raises(ValueError, match="lengths is written in place and must not be an expanded view"):
        ops.decode_layer(x, w, b, pw, pb, k, v, torch.tensor([1]).expand(2), None, 2)
    assert torch.equal(k, k0) and torch.equal(lengths, lengths0) and full.tolist() == [6, 6]
    out = ops.decode_layer(x, w.requires_grad_(), b, pw, pb, k, v, lengths, None, 2)  # inference only
    with pytest.raises(RuntimeError, match="derivative for causal_attention::decode_layer is not implemented"):
        out.sum().backward()


def test_decode_layer_refuses_negative_and_huge_lengths_and_changes_nothing():
    """Without a mask the step's end lengths are computed and checked in the op (no tensor op):
    a negative length, and one so large that adding the new tokens overflows int64, are refused
    with the positions' message before anything is written."""
    attn, x, k, v, _, _ = _decode_layer_inputs(2, 1, 2, 8, 5, torch.float32, True)
    w, b, pw, pb = attn.qkv.weight.detach(), attn.qkv.bias.detach(), attn.proj.weight.detach(), attn.proj.bias.detach()
    k0, v0 = k.clone(), v.clone()
    for bad in ([1, -1], [2, 2**63 - 1]):
        lengths = torch.tensor(bad)
        with torch.no_grad(), pytest.raises(ValueError, match=r"cache positions of sequence 1 must satisfy 0 <= start"):
            ops.decode_layer(x, w, b, pw, pb, k, v, lengths, None, 2)
        assert lengths.tolist() == bad
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_decode_layer_advances_strided_lengths_in_place(masked):
    """lengths as a strided view (every other element of a buffer): the op gives the contiguous
    lengths' output and cache, writes the view's elements only, and leaves the others alone."""
    attn, x, k, v, lengths, mask = _decode_layer_inputs(3, 2, 2, 8, 6, torch.float32, True)
    mask = mask if masked else None
    w, b, pw, pb = attn.qkv.weight.detach(), attn.qkv.bias.detach(), attn.proj.weight.detach(), attn.proj.bias.detach()
    base = torch.full((6,), -7)
    base[::2] = lengths
    strided = base[::2]
    assert strided.stride() == (2,)
    with torch.no_grad():
        k1, v1, contiguous = k.clone(), v.clone(), lengths.clone()
        expected = ops.decode_layer(x, w, b, pw, pb, k1, v1, contiguous, mask, 2)
        out = ops.decode_layer(x, w, b, pw, pb, k, v, strided, mask, 2)
    assert torch.equal(out, expected) and torch.equal(k, k1) and torch.equal(v, v1)
    assert base[::2].tolist() == contiguous.tolist() and base[1::2].tolist() == [-7, -7, -7]
    real = mask.sum(1) if masked else torch.full((3,), 2)
    assert contiguous.tolist() == (lengths + real).tolist()


def test_decode_layer_compiles_and_writes_the_cache():
    """torch.compile of the op (its meta kernel; the cache and lengths mutated in place) gives the
    eager bits."""
    attn, x, k, v, lengths, _ = _decode_layer_inputs(3, 1, 4, 8, 20, torch.float32, True)
    params = [p.detach() for p in (attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias)]
    torch._dynamo.reset()
    step = torch.compile(lambda x, k, v, n: ops.decode_layer(x, *params, k, v, n, None, 4), fullgraph=True)
    k1, v1, n1, k2, v2, n2 = k.clone(), v.clone(), lengths.clone(), k.clone(), v.clone(), lengths.clone()
    with torch.no_grad():
        eager = ops.decode_layer(x, *params, k1, v1, n1, None, 4)
        compiled = step(x, k2, v2, n2)
    assert torch.equal(compiled, eager)
    assert torch.equal(k2, k1) and torch.equal(v2, v1) and torch.equal(n2, n1)
    assert torch.equal(n2, lengths + 1)


def _tiny_gpt(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=17, max_len=48, dim=32, n_layers=2, n_heads=4)).eval()


def test_generate_with_cache_equals_without():
    model = _tiny_gpt()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9], [3, 3, 3, 1], [16, 0, 5, 2, 2, 8, 1, 1, 1, 4, 2]]
    with_cache = model.generate(prompts, 12)
    without = model.generate(prompts, 12, use_cache=False)
    assert with_cache == without
    assert all(len(g) == 12 for g in with_cache)
    # Each prompt alone gives what it gave in the ragged batch.
    for p, g in zip(prompts, with_cache):
        assert model.generate([p], 12) == [g]


def test_generate_top_k_is_reproducible_and_stops_at_eos():
    model = _tiny_gpt(1)
    prompts = [[1, 2], [3, 4, 5, 6]]
    a = model.generate(prompts, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompts, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    assert a == b
    eos = a[0][0]
    stopped = model.generate(prompts, 10, top_k=5, eos_id=eos, generator=torch.Generator().manual_seed(3))
    assert stopped[0] == [eos]
    with pytest.raises(ValueError, match="exceeds max_len"):
        model.generate(prompts, 100)


def test_gpt_refuses_attention_maps_with_caches():
    model = _tiny_gpt()
    with torch.no_grad(), pytest.raises(ValueError, match="return_attention is not available with caches"):
        model(torch.tensor([[1, 2]]), caches=model.make_caches(1), return_attention=True)


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping of this process that holds address (None: no such mapping)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


def _huge_page_bytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_cpu_cache_is_zeroed_and_advised_onto_huge_pages(dtype):
    """make_cache's keys and values: zeros of the cache's shape and dtype, ordinary tensors (they
    step, clone and resize as any), and of a huge page or more, a mapping of their own from a
    huge-page boundary, advised to be huge (VmFlags "hg": whether the kernel then gives huge pages
    depends on its THP mode and free memory, not on the code)."""
    attn = CausalSelfAttention(256, 4, dtype=dtype)
    cache = attn.make_cache(4, 2048 + 7)  # 4 * 4 * 2055 * 64 elements: 8.4 MB in float32
    for buffer in (cache.k, cache.v):
        assert buffer.shape == (4, 4, 2055, 64) and buffer.dtype == dtype and buffer.is_cpu
        assert buffer.is_contiguous() and int(buffer.count_nonzero()) == 0
        assert buffer.data_ptr() % _huge_page_bytes() == 0
        if sys.platform == "linux":
            assert "hg" in (_vm_flags(buffer.data_ptr()) or []), "the cache's memory was not advised"
    # A step writes it, a copy and a resize behave as on any tensor.
    with torch.no_grad():
        attn(torch.randn(4, 3, 256, dtype=dtype), cache=cache)
    assert int(cache.lengths.sum()) == 12 and int(cache.k[:, :, 3:].count_nonzero()) == 0
    assert int(cache.k[:, :, :3].count_nonzero()) > 0
    assert torch.equal(cache.k.clone(), cache.k)
    grown = cache.v.clone()
    cache.v.resize_(4 * 4 * 2055 * 64 * 2)
    assert torch.equal(cache.v[: grown.numel()].view_as(grown), grown)


def _anon_huge_bytes(address: int) -> int:
    """The bytes on transparent huge pages (AnonHugePages) of the mapping that holds address."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def _fresh_floats(numel: int) -> tuple[mmap.mmap, torch.Tensor]:
    """numel float32 values on an anonymous mapping of their own (no advice from earlier tests: freed
    memory keeps it), starting 4 KB past a huge-page boundary; the mapping keeps them alive."""
    huge = _huge_page_bytes()
    mapping = mmap.mmap(-1, numel * 4 + 2 * huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = (-base) % huge + 4096
    return mapping, torch.frombuffer(mapping, dtype=torch.float32, count=numel, offset=offset)


def _kernel_collapses() -> bool:
    """Whether this kernel moves a private anonymous huge page's worth of small pages onto a huge
    page when asked (madvise MADV_COLLAPSE, Linux 6.1; THP not "never", a huge page free)."""
    huge = _huge_page_bytes()
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            return False
    mapping = mmap.mmap(-1, 2 * huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.write(b"\1" * (2 * huge))
    offset = (-torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()) % huge
    try:
        mapping.madvise(25, offset, huge)  # MADV_COLLAPSE (Python's mmap module has no name for it)
    except OSError:
        return False
    return True


def _on_fresh_memory(parameter: torch.nn.Parameter) -> tuple[mmap.mmap, int]:
    """Moves parameter's values onto _fresh_floats (the same Parameter); returns the mapping and the
    address of the first whole huge page inside them."""
    mapping, fresh = _fresh_floats(parameter.numel())
    with torch.no_grad():
        fresh.copy_(parameter.reshape(-1))
        parameter.data = fresh.view_as(parameter)
    return mapping, parameter.data_ptr() - 4096 + _huge_page_bytes()


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")
def test_make_cache_moves_the_layer_weights_onto_huge_pages_in_place():
    """make_cache advises the whole huge pages inside the layer's weights (VmFlags "hg"), and only
    those, and moves them in place: the same tensors, addresses and values, the same step. What the
    kernel reports moved is whole pages inside the storage and shows as AnonHugePages (whether it
    moves them depends on its version and free memory)."""
    huge = _huge_page_bytes()
    attn = CausalSelfAttention(768, 12).eval()  # qkv weight 6.75 MB in float32
    mapping, begin = _on_fresh_memory(attn.qkv.weight)
    weight = attn.qkv.weight
    value, address = weight.detach().clone(), weight.data_ptr()
    whole = (address + weight.nbytes - begin) // huge * huge
    if whole < huge:
        pytest.skip(f"no whole huge page of {huge} bytes inside a 6.75 MB weight")
    assert "hg" not in (_vm_flags(begin) or [])
    x = torch.randn(2, 1, 768)
    with torch.no_grad():
        expected = attn(x, cache=KVCache.empty(2, 12, 64, 8))  # (KVCache.empty advises no weight)
        assert "hg" not in (_vm_flags(begin) or [])
        assert torch.equal(attn(x, cache=attn.make_cache(2, 8)), expected)
    assert attn.qkv.weight is weight and weight.data_ptr() == address and torch.equal(weight, value)
    assert "hg" in (_vm_flags(begin) or []), "make_cache did not advise the weight's whole huge pages"
    assert "hg" not in (_vm_flags(address) or []) and "hg" not in (_vm_flags(begin + whole) or [])
    moved = advise_huge_pages(weight)  # make_cache's move asked again: on huge pages, the same bytes
    assert moved % huge == 0 and 0 <= moved <= whole
    if _kernel_collapses():
        assert moved == whole and _anon_huge_bytes(begin) >= moved
    del mapping


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # (quantized tensors, deprecated)
def test_gpt_make_caches_moves_every_weight_and_leaves_what_it_cannot():
    """The GPT's make_caches advises all its parameters (here the MLP's first weight, 4 MB); the
    Python wrapper never raises: a bare tensor or an iterable, tensors too small, on meta, sparse or
    quantized give 0."""
    huge = _huge_page_bytes()
    model = TinyGPT(GPTConfig(vocab_size=64, max_len=32, dim=512, n_layers=1, n_heads=8)).eval()
    weight = model.blocks[0].mlp[0].weight
    mapping, begin = _on_fresh_memory(weight)
    if weight.data_ptr() + weight.nbytes - begin < huge:
        pytest.skip(f"no whole huge page of {huge} bytes inside a 4 MB weight")
    model.make_caches(1, 8)
    assert "hg" in (_vm_flags(begin) or []), "make_caches did not advise the MLP's weight"
    del mapping
    assert advise_huge_pages(torch.ones(16, 16)) == 0 and advise_huge_pages([torch.ones(4)]) == 0
    assert advise_huge_pages(torch.empty(1 << 22, device="meta")) == 0
    assert advise_huge_pages(torch.zeros(1 << 20, 4).to_sparse()) == 0
    assert advise_huge_pages(torch.quantize_per_tensor(torch.zeros(1 << 22), 0.1, 0, torch.qint8)) == 0
    assert torch.ops.causal_attention.advise_huge_pages(torch.empty(1 << 22, device="meta")) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="fork and /proc/self/pagemap are Linux's")
def test_pages_shared_with_a_fork_are_not_copied():
    """Pages a process shares copy-on-write with a fork stay shared: the collapse would copy them
    into the forked process's own memory (a server's workers forked after loading the model)."""
    huge = _huge_page_bytes()
    mapping, values = _fresh_floats(3 * huge // 4)  # 4 KB past a boundary: 2 whole pages inside
    values.fill_(1.5)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its pages are the parent's until one of them writes
        try:
            os.write(write, str(advise_huge_pages(values)).encode())
        finally:
            os._exit(0)
    os.close(write)
    moved_in_child = int(os.read(read, 64) or b"-1")
    os.close(read)
    os.waitpid(pid, 0)
    assert moved_in_child == 0
    moved = advise_huge_pages(values)  # alone again
    assert moved % huge == 0 and bool((values == 1.5).all())
    if _kernel_collapses():
        assert moved == 2 * huge
    del mapping


def test_small_fake_and_traced_caches():
    """Below a huge page, torch's own zeros; under FakeTensorMode, fake tensors (the op's device
    argument takes FakeTensorMode's constructor path); a module that makes its cache in forward
    compiles (fullgraph) and exports (strict and not) to eager's output; the op names a negative or
    overflowing size."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    small = CausalSelfAttention(16, 2).make_cache(2, 6)
    assert small.k.shape == (2, 2, 6, 8) and int(small.k.count_nonzero()) == 0
    with FakeTensorMode():
        fake = CausalSelfAttention(16, 2).make_cache(2, 2100)
    assert isinstance(fake.k, FakeTensor) and isinstance(fake.v, FakeTensor) and fake.k.device.type == "cpu"

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = CausalSelfAttention(256, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, cache=self.attn.make_cache(2, 2100))

    model = Step().eval()
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        assert rel_err(torch.compile(model, fullgraph=True)(x), expected) < 1e-5
        for strict in (True, False):
            assert rel_err(torch.export.export(model, (x,), strict=strict).module()(x), expected) < 1e-5
    with pytest.raises(ValueError, match="size must be non-negative"):
        torch.ops.causal_attention.cache_zeros([2, -1], torch.float32)
    with pytest.raises(ValueError, match="overflows a byte count"):
        torch.ops.causal_attention.cache_zeros([1 << 40, 1 << 40], torch.float32)


# ---------------------------------------------------------------------------------------------
# The inference-only guard


@pytest.mark.parametrize("trainable", ["qkv.bias", "proj.weight", "proj.bias", "x"])
def test_cache_refuses_grad_mode_whatever_wants_a_gradient(trainable):
    """BitFit-style: qkv.weight frozen, a bias trainable: the cache path, inference only, must
    refuse, or the bias would silently get no gradient."""
    attn = CausalSelfAttention(16, 2)
    for p in attn.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 1, 16)
    if trainable == "x":
        x.requires_grad_()
    else:
        attn.get_parameter(trainable).requires_grad_()
    with pytest.raises(ValueError, match=f"the KV cache is for inference, but {trainable} require"):
        attn(x, cache=attn.make_cache(2, 4))
    with torch.no_grad():
        attn(x, cache=attn.make_cache(2, 4))  # fine without grad mode


# ---------------------------------------------------------------------------------------------
# Capacity per sequence


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_a_full_sequence_does_not_block_the_batch(backend):
    """lengths [4, 1], max_len 4; a step with mask [[False], [True]] leaves sequence 0 untouched:
    capacity is judged per sequence by its real new tokens."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, backend=backend, dtype=torch.float64)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        cache = attn.make_cache(2, 4)
        attn(x, torch.tensor([[True] * 4, [True, False, False, False]]), cache=cache)
        k0, v0 = cache.k[0].clone(), cache.v[0].clone()
        y = attn(x[:, 1:2], torch.tensor([[False], [True]]), cache=cache)
        assert cache.lengths.tolist() == [4, 2]
        assert torch.equal(cache.k[0], k0) and torch.equal(cache.v[0], v0)
        full = attn(x[1:, :2])  # sequence 1 alone: tokens 0 and 1
        assert rel_err(y[1, 0], full[0, 1]) <= 1e-12
        with pytest.raises(ValueError, match="sequence 0 holds 4 tokens and 1 more do not fit in max_len=4"):
            attn(x[:, :1], cache=cache)
        assert cache.lengths.tolist() == [4, 2]


def test_kv_cache_write_writes_only_real_tokens():
    B, H, hd, L, t = 2, 2, 4, 6, 3
    qkv = torch.randn(B, t, 3 * H * hd)
    k, v = torch.zeros(B, H, L, hd), torch.zeros(B, H, L, hd)
    start, end = torch.tensor([0, 5]), torch.tensor([2, 5])
    torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, end, H)
    new_k = qkv[..., H * hd : 2 * H * hd].view(B, t, H, hd).transpose(1, 2)
    assert torch.equal(k[0, :, :2], new_k[0, :, :2]) and torch.count_nonzero(k[0, :, 2:]) == 0
    assert torch.count_nonzero(k[1]) == 0
    with pytest.raises(ValueError, match="KV cache overflow: sequence 1 holds 5 tokens and 2 more"):
        torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, torch.tensor([2, 7]), H)
    with pytest.raises(ValueError, match="must satisfy 0 <= start <= end <= start \\+ new tokens"):
        torch.ops.causal_attention.kv_cache_write(qkv, k, v, start, torch.tensor([4, 5]), H)
