"""Checks that guard data hold under torch.compile (fullgraph) as in eager code."""

from __future__ import annotations

import pytest
import torch

from causal_attention import CausalSelfAttention
from helpers import rel_err



def _eager_and_compiled(fn):  # type: ignore[no-untyped-def]
    torch._dynamo.reset()
    return [("eager", fn), ("compiled", torch.compile(fn, fullgraph=True))]


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_integer_mask_values_are_checked_compiled_too(backend):
    attn = CausalSelfAttention(16, 2, backend=backend)
    x = torch.randn(2, 3, 16)
    for mode, fn in _eager_and_compiled(lambda x, m: attn(x, m)):
        with pytest.raises(ValueError, match="must hold only 0 \\(padding\\) and 1"):
            fn(x, torch.tensor([[1, 2, 1], [1, 1, 0]]))
        ok = fn(x, torch.tensor([[1, 1, 1], [1, 1, 0]]))
        assert rel_err(ok, attn(x, torch.tensor([[True, True, True], [True, True, False]]))) <= 1e-6, mode


@pytest.mark.parametrize("backend", ["cpp", "sdpa"])
def test_cache_checks_hold_compiled_too(backend):
    """Left padding with a cache was accepted when compiled (length 2, the padding's key kept as real);
    an overflowing cache indexed out of bounds inside inductor on the sdpa path."""
    attn = CausalSelfAttention(16, 2, backend=backend)
    for mode, step in _eager_and_compiled(lambda x, m, c: attn(x, m, cache=c)):
        with torch.no_grad():
            cache = attn.make_cache(1, 4)
            with pytest.raises(ValueError, match="must be right padding"):
                step(torch.randn(1, 3, 16), torch.tensor([[False, True, True]]), cache)
            assert cache.lengths.tolist() == [0] and torch.count_nonzero(cache.k) == 0, mode
            step(torch.randn(1, 3, 16), torch.tensor([[True, True, True]]), cache)
            before = cache.k.clone()
            with pytest.raises(ValueError, match="KV cache overflow: sequence 0 holds 3 tokens and 2 more"):
                step(torch.randn(1, 2, 16), torch.tensor([[True, True]]), cache)
            assert cache.lengths.tolist() == [3] and torch.equal(cache.k, before), mode


def test_gpt_position_check_holds_compiled_too():
    from causal_attention.models import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2))
    for _, fn in _eager_and_compiled(lambda t: model(t)):
        with pytest.raises(RuntimeError, match="sequence longer than max_len=8"):
            fn(torch.zeros(1, 9, dtype=torch.long))


def test_x_dtype_check_holds_compiled_and_allows_autocast():
    """The check that x has the parameters' dtype raises its message compiled (fullgraph) too (as
    dynamo's error carrying it: it is raised while tracing); under autocast, where x legitimately
    differs, the compiled layer runs."""
    attn = CausalSelfAttention(16, 2)
    for mode, fn in _eager_and_compiled(lambda x: attn(x)):
        error = TypeError if mode == "eager" else torch._dynamo.exc.Unsupported
        with pytest.raises(error, match="x must have the layer's parameters' dtype torch.float32"):
            fn(torch.randn(2, 3, 16, dtype=torch.float64))
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = attn(x)
        compiled = torch.compile(lambda x: attn(x), fullgraph=True)(x)
    assert compiled.dtype == torch.bfloat16 and rel_err(compiled.float(), eager.float()) <= 1e-2
