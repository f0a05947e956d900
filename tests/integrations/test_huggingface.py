"""The engine inside transformers: hf_attention.register() as an attention implementation.

Every model is compared with transformers' own implementations (eager, sdpa) holding the same
weights, at the real positions of a right-padded batch. Weights are drawn with a large
initializer_range, so that attention moves the logits (at GPT-2's 0.02 a wrong mask would still
move them, but by less).
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from causal_attention.attention import _ops, reference  # noqa: E402
from causal_attention.integrations import huggingface as hf_attention  # noqa: E402
from helpers import OpLog, rel_err  # noqa: E402

hf_logging.set_verbosity_error()  # random configs: token id warnings are noise here

NAME = hf_attention.register()
VOCAB = 101
T = 24
LENGTHS = [T, T - 3, 1, T - 5]
# Right padding (the usual case: invisible to real queries under causal attention, but it decides
# the padded rows), no padding, and left padding (where real queries must skip padding keys).
LAYOUTS = ("right", "all_real", "left")
# f64: both sides round differently only; f32: max error at the real logits, relative to max |logit|.
LOGIT_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def gpt2_config(**overrides: object) -> GPT2Config:
    options = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, initializer_range=0.2,
                   attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    options.update(overrides)
    return GPT2Config(**options)


def llama_config(*, kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                       initializer_range=0.2)


def twins(model_cls: type, config: object, impls: tuple[str, ...], dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """One model per attention implementation, all holding the weights of the first."""
    # A copy of the config each: a model keeps (and _from_config sets) the implementation in its config.
    models = {impl: model_cls._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
              for impl in impls}
    assert all(model.config._attn_implementation == impl for impl, model in models.items())
    first = next(iter(models.values()))
    for model in models.values():
        model.load_state_dict(first.state_dict())
        model.eval()
    return models


def batch(layout: str = "right") -> tuple[Tensor, Tensor]:
    """Token ids (B, T) and the attention_mask (B, T) int64, 1 = real token, for the lengths LENGTHS."""
    ids = torch.randint(0, VOCAB, (len(LENGTHS), T))
    lengths = torch.tensor(LENGTHS if layout != "all_real" else [T] * len(LENGTHS))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T), right padding
    if layout == "left":
        mask = mask.flip(1)
    return ids, mask


def logits_and_grads(model: torch.nn.Module, ids: Tensor, mask: Tensor, weights: Tensor, *,
                     use_cache: bool) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits at the real positions (N, vocab) and the gradients of sum(weights * those logits)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask, use_cache=use_cache).logits[mask.bool()]
    (logits * weights).sum().backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model's own names
    return logits.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


class Spy:
    """Counts the engine's calls (the fused qkv entry, which GPT-2's c_attn buffer takes, and the
    separate-heads entry) and the fallbacks, with their reasons; keeps the qkv buffers the engine got."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fused_calls = 0
        self.heads_calls = 0
        self.fallbacks: list[list[str]] = []
        self.qkvs: list[Tensor] = []
        attention, heads, fallback = _ops.attention, _ops.attention_heads, hf_attention._fallback

        @functools.wraps(attention)
        def counting_attention(qkv: Tensor, *args: object, **kwargs: object) -> Tensor:
            self.fused_calls += 1
            self.qkvs.append(qkv)
            return attention(qkv, *args, **kwargs)

        @functools.wraps(heads)
        def counting_heads(*args: object, **kwargs: object) -> Tensor:
            self.heads_calls += 1
            return heads(*args, **kwargs)

        @functools.wraps(fallback)
        def counting_fallback(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Tensor | None, **kwargs: object) -> object:
            self.fallbacks.append(hf_attention.fallback_reasons(module, query, key, value, attention_mask, **kwargs))
            return fallback(module, query, key, value, attention_mask, **kwargs)

        monkeypatch.setattr(_ops, "attention", counting_attention)
        monkeypatch.setattr(_ops, "attention_heads", counting_heads)
        monkeypatch.setattr(hf_attention, "_fallback", counting_fallback)

    @property
    def engine_calls(self) -> int:
        return self.fused_calls + self.heads_calls


def assert_same(ours: tuple[Tensor, dict[str, Tensor]], theirs: tuple[Tensor, dict[str, Tensor]],
                dtype: torch.dtype) -> None:
    logits, grads = ours
    ref_logits, ref_grads = theirs
    assert rel_err(logits, ref_logits) <= LOGIT_TOL[dtype]
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel_err(grads[name], ref_grads[name]) <= GRAD_TOL[dtype], name


def test_import_does_not_import_transformers() -> None:
    code = "import sys, causal_attention, causal_attention.integrations.huggingface; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_rejects_names_transformers_reads_specially() -> None:
    for bad in ("", "my_sdpa", "eager"):
        with pytest.raises(ValueError, match="name"):
            hf_attention.register(bad)
    assert hf_attention.register("causal_attention_again") == "causal_attention_again"


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "dynamic_cache"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("baseline", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_gpt2_matches_transformers(dtype: torch.dtype, baseline: str, layout: str, use_cache: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    models = twins(GPT2LMHeadModel, gpt2_config(), (NAME, baseline), dtype)
    ids, mask = batch(layout)
    weights = torch.randn(int(mask.sum()), VOCAB, dtype=dtype)
    theirs = logits_and_grads(models[baseline], ids, mask, weights, use_cache=use_cache)
    spy = Spy(monkeypatch)
    ours = logits_and_grads(models[NAME], ids, mask, weights, use_cache=use_cache)
    assert spy.engine_calls == 2 and spy.fallbacks == []  # one per layer
    # Without a cache, q, k, v are views of c_attn's output, read as that buffer. With one,
    # transformers' cache hands back its own k and v: the separate-heads entry reads them in place.
    assert spy.fused_calls == (0 if use_cache else 2)
    assert_same(ours, theirs, dtype)


def test_gpt2_engine_reads_c_attn_output_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    model = twins(GPT2LMHeadModel, gpt2_config(n_layer=1), (NAME,), torch.float32)[NAME]
    outputs: list[Tensor] = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda mod, args, out: outputs.append(out))
    spy = Spy(monkeypatch)
    ids, mask = batch()
    model(ids, attention_mask=mask, use_cache=False)
    (qkv,) = spy.qkvs
    assert qkv.data_ptr() == outputs[0].data_ptr() and qkv.shape == outputs[0].shape


def test_fused_view_is_the_buffer_with_its_gradient() -> None:
    B, H, hd = 2, 3, 4
    dim = H * hd
    fused = torch.randn(B, T, 3 * dim, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in fused.split(dim, 2))  # GPT-2's layout
    view = hf_attention.fused_view(q, k, v)
    assert view is not None and view.data_ptr() == fused.data_ptr() and torch.equal(view, fused)
    grad = torch.randn_like(fused)
    (g_view,) = torch.autograd.grad(view, fused, grad)
    assert torch.equal(g_view, grad)
    # Layouts that are not one [q | k | v] buffer: no view.
    assert hf_attention.fused_view(q.contiguous(), k, v) is None
    assert hf_attention.fused_view(k, q, v) is None
    assert hf_attention.fused_view(q, k, v.clone()) is None


def _swap_q_k(qkv: Tensor) -> Tensor:
    q, k, v = qkv.chunk(3, dim=-1)
    return torch.cat([k, q, v], dim=-1)


MUTANTS = {
    "mask dropped": ("left", lambda qkv, mask, n_heads: (qkv, None, n_heads)),
    "q and k swapped": ("right", lambda qkv, mask, n_heads: (_swap_q_k(qkv), mask, n_heads)),
    "heads miscounted": ("right", lambda qkv, mask, n_heads: (qkv, mask, n_heads // 2)),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_comparison_catches_a_broken_engine_call(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity check above can fail: the engine fed wrong arguments is caught, in float32 too."""
    layout, mutate = MUTANTS[mutant]
    models = twins(GPT2LMHeadModel, gpt2_config(), (NAME, "eager"), torch.float32)
    ids, mask = batch(layout)
    weights = torch.randn(int(mask.sum()), VOCAB)
    theirs = logits_and_grads(models["eager"], ids, mask, weights, use_cache=False)
    attention = _ops.attention
    monkeypatch.setattr(_ops, "attention", lambda *args, **kwargs: attention(*mutate(*args), **kwargs))
    ours = logits_and_grads(models[NAME], ids, mask, weights, use_cache=False)
    with pytest.raises(AssertionError):
        assert_same(ours, theirs, torch.float32)


def _rms_norm_in_input_dtype(self: torch.nn.Module, hidden_states: Tensor) -> Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def llama_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaRMSNorm rounds every hidden state to float32 (and Llama's eager attention takes its
    softmax in float32): in float64 that would hide differences below 1e-7. Here the norm keeps
    the input dtype, so float64 parity means float64; models are compared with sdpa."""
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)


@pytest.mark.usefixtures("llama_in_float64")
@pytest.mark.parametrize("layout", ["right", "left"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_llama_separate_projections_take_the_heads_path(dtype: torch.dtype, layout: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    models = twins(LlamaForCausalLM, llama_config(kv_heads=4), (NAME, "sdpa"), dtype)
    ids, mask = batch(layout)
    weights = torch.randn(int(mask.sum()), VOCAB, dtype=dtype)
    theirs = logits_and_grads(models["sdpa"], ids, mask, weights, use_cache=False)
    spy = Spy(monkeypatch)
    ours = logits_and_grads(models[NAME], ids, mask, weights, use_cache=False)
    assert spy.heads_calls == 2 and spy.fallbacks == []  # q, k, v from three projections (k, q rotated)
    assert_same(ours, theirs, dtype)


@pytest.mark.usefixtures("llama_in_float64")
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("layout", ["right", "left"])
def test_llama_grouped_query_in_float64(layout: str, kv_heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    models = twins(LlamaForCausalLM, llama_config(kv_heads=kv_heads), (NAME, "sdpa"), torch.float64)
    ids, mask = batch(layout)
    weights = torch.randn(int(mask.sum()), VOCAB, dtype=torch.float64)
    theirs = logits_and_grads(models["sdpa"], ids, mask, weights, use_cache=False)
    spy = Spy(monkeypatch)
    ours = logits_and_grads(models[NAME], ids, mask, weights, use_cache=False)
    assert spy.heads_calls == 2 and spy.fallbacks == []
    assert_same(ours, theirs, torch.float64)


def test_layer_scaled_attention_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """scale_attn_by_inverse_layer_idx: the scale is not 1/sqrt(head_dim) past layer 0."""
    models = twins(GPT2LMHeadModel, gpt2_config(scale_attn_by_inverse_layer_idx=True), (NAME, "eager"), torch.float64)
    ids, mask = batch()
    weights = torch.randn(int(mask.sum()), VOCAB, dtype=torch.float64)
    theirs = logits_and_grads(models["eager"], ids, mask, weights, use_cache=False)
    spy = Spy(monkeypatch)
    ours = logits_and_grads(models[NAME], ids, mask, weights, use_cache=False)
    assert spy.fused_calls == 1 and spy.heads_calls == 1 and spy.fallbacks == []  # layer 1: scale / 2
    assert_same(ours, theirs, torch.float64)


def test_training_dropout_runs_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_pdrop > 0 in train mode: the engine's fused dropout serves it (no fallback), outputs
    vary between calls, torch.manual_seed reproduces them, and eval mode passes dropout 0."""
    model = twins(GPT2LMHeadModel, gpt2_config(attn_pdrop=0.5), (NAME,), torch.float32)[NAME]
    model.train()
    ids, mask = batch()
    got: list[float] = []
    attention = _ops.attention

    def recording(qkv: Tensor, key_padding_mask: Tensor | None, n_heads: int, dropout_p: float = 0.0,
                  seed: Tensor | None = None) -> Tensor:
        got.append(dropout_p)
        return attention(qkv, key_padding_mask, n_heads, dropout_p, seed)

    monkeypatch.setattr(_ops, "attention", recording)
    torch.manual_seed(1)
    a = model(ids, attention_mask=mask, use_cache=False).logits
    a.sum().backward()
    torch.manual_seed(1)
    b = model(ids, attention_mask=mask, use_cache=False).logits
    c = model(ids, attention_mask=mask, use_cache=False).logits
    assert got == [0.5] * 6
    real = mask.bool()
    assert torch.equal(a, b) and not torch.allclose(b[real], c[real])
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    model(ids, attention_mask=mask, use_cache=False)
    assert got[-2:] == [0.0, 0.0]
    reasons = hf_attention.fallback_reasons(model.transformer.h[0].attn, *(torch.zeros(1, 4, 3, 16),) * 3, None,
                                            dropout=0.5, scaling=16**-0.5)
    assert reasons == []


def test_fallback_reasons_name_the_cause() -> None:
    module = torch.nn.Module()
    q = torch.zeros(2, 4, 5, 8)
    kv = torch.zeros(2, 2, 9, 8)
    served = hf_attention.engine_mask(torch.ones(2, 7, dtype=torch.bool))
    assert hf_attention.fallback_reasons(module, q, q, q, None, scaling=8**-0.5) == []
    assert hf_attention.fallback_reasons(module, q, kv, kv, served, scaling=0.3, softcap=50.0, sliding_window=4) == []
    odd = torch.zeros(2, 3, 9, 8)
    assert "3 key/value heads do not divide 4" in " ".join(hf_attention.fallback_reasons(module, q, odd, odd, None))
    theirs = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    assert "the mask function did not serve" in " ".join(hf_attention.fallback_reasons(module, q, kv, kv, theirs))
    short = hf_attention.engine_mask(torch.ones(2, 3, dtype=torch.bool))
    assert "do not end the 3 keys" in " ".join(hf_attention.fallback_reasons(module, q, kv, kv, short))
    assert "dropout with a past" in " ".join(hf_attention.fallback_reasons(module, q, kv, kv, None, dropout=0.1))
    assert "not causal" in " ".join(hf_attention.fallback_reasons(module, q, q, q, None, is_causal=False))
    assert "sinks is set" in " ".join(hf_attention.fallback_reasons(module, q, q, q, None, sinks=torch.zeros(4)))
    assert hf_attention.fallback_reasons(module, q, kv, kv, served, s_aux=torch.zeros(4)) == []
    assert "s_aux must be one floating logit per query head (4,)" in " ".join(
        hf_attention.fallback_reasons(module, q, q, q, None, s_aux=torch.zeros(2, 4)))
    assert "mixed dtypes" in " ".join(hf_attention.fallback_reasons(module, q, kv.double(), kv, None))


def test_a_fallback_with_sinks_goes_to_eager() -> None:
    """A call the engine cannot serve (here: not causal) with gpt-oss's sinks goes to the model's eager
    attention, as transformers would (sdpa would ignore the sinks): the same output as eager's."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    config = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_hidden_layers=1)
    module = modeling_gpt_oss.GptOssAttention(config, 0)
    with torch.no_grad():
        module.sinks.normal_()
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    out, _ = hf_attention.causal_attention_forward(module, q, k, v, None, scaling=0.25, is_causal=False,
                                                   s_aux=module.sinks)
    eager, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, None, scaling=0.25)
    assert torch.equal(out, eager)


def test_mask_function_hands_on_the_keys_each_call_sees() -> None:
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    def key_mask(result: Tensor | None) -> Tensor | None:
        ours, keys = hf_attention.engine_key_mask(result)
        assert ours
        return keys

    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert torch.equal(key_mask(hf_attention.key_padding_mask(2, 3, 3, attention_mask=mask)), mask)
    assert hf_attention.key_padding_mask(2, 3, 3, attention_mask=None) is None
    # A decode step against a dynamic cache: the padding of the past and the new token.
    decode = torch.tensor([[True, True, False, True], [True, True, True, True]])
    got = hf_attention.key_padding_mask(2, 1, 4, q_offset=3, attention_mask=decode, mask_function=causal_mask_function)
    assert torch.equal(key_mask(got), decode)
    # A static cache of 10 slots, 4 filled: its unfilled slots are left out (L = 4), also without padding.
    static = hf_attention.key_padding_mask(2, 1, 10, q_offset=torch.tensor(3), attention_mask=decode)
    assert torch.equal(key_mask(static), decode)
    assert key_mask(hf_attention.key_padding_mask(2, 2, 10, q_offset=3, attention_mask=None)).shape == (2, 5)
    # A sliding window served: the window is the attention call's (its sliding_window argument).
    window = sliding_window_causal_mask_function(3)
    assert hf_attention._window_of_mask_function(window) == (True, 3)
    assert torch.equal(key_mask(hf_attention.key_padding_mask(2, 1, 4, q_offset=3, attention_mask=decode,
                                                              mask_function=window)), decode)
    # A pattern the engine does not compute (bidirectional): sdpa's own mask.
    from transformers.masking_utils import bidirectional_mask_function

    assert hf_attention._window_of_mask_function(bidirectional_mask_function) == (False, None)
    ours = hf_attention.key_padding_mask(2, 1, 4, q_offset=3, attention_mask=decode,
                                         mask_function=bidirectional_mask_function)
    theirs = sdpa_mask(batch_size=2, q_length=1, kv_length=4, q_offset=3, attention_mask=decode,
                       mask_function=bidirectional_mask_function)
    assert ours is not None and ours.dtype == torch.bool and torch.equal(ours, theirs)


@pytest.mark.parametrize("filled", [9, 6])
def test_a_decode_step_dispatches_the_engine_op_alone(filled: int) -> None:
    """A served decode step (eager, nothing to differentiate) dispatches the engine's op and no other
    tensor op (each one costs tens of microseconds right after a step streamed the cache): the engine
    mask carries its key mask, and keys are cut to the filled slots only where some are unfilled. A copy
    of the mask, which does not carry it, is read through its bytes to the same output."""
    B, H, Hkv, Tk, hd = 2, 4, 2, 9, 16
    padding = torch.ones(B, filled, dtype=torch.bool)
    padding[0, :3] = False
    mask = hf_attention.key_padding_mask(B, 1, Tk, q_offset=filled - 1, attention_mask=padding)
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(B, 1, H, hd).transpose(1, 2)
    k, v = torch.randn(B, Hkv, Tk, hd), torch.randn(B, Hkv, Tk, hd)
    with torch.no_grad():
        with OpLog() as dispatched:
            out, _ = hf_attention.causal_attention_forward(module, q, k, v, mask, scaling=0.25)
        copied, _ = hf_attention.causal_attention_forward(module, q, k, v, mask.clone(), scaling=0.25)
    expected = ["causal_attention.attention_heads_forward.default"]
    if filled < Tk:
        expected = ["aten.slice.Tensor"] * 2 + expected  # the two narrows
    assert dispatched.names == expected
    assert torch.equal(copied, out)
    want = reference.attention(q.double(), k[:, :, :filled].double(), v[:, :, :filled].double(), key_mask=padding,
                               scale=0.25)[0].transpose(1, 2)  # (B, Tq, H, hd)
    assert rel_err(out.double(), want) < 1e-5


def test_generate_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation with transformers' cache, left padded: the prefill and every decode step in
    the engine."""
    models = twins(GPT2LMHeadModel, gpt2_config(), (NAME, "sdpa"), torch.float64)
    ids, _ = batch("all_real")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :7] = 0
    options = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    theirs = models["sdpa"].generate(ids, **options)
    spy = Spy(monkeypatch)
    ours = models[NAME].generate(ids, **options)
    assert spy.engine_calls == 2 * 8 and spy.fallbacks == []  # the prefill and 7 decode steps, 2 layers
    assert torch.equal(ours, theirs)


def test_output_attentions_gives_eagers_weights() -> None:
    models = twins(LlamaForCausalLM, llama_config(kv_heads=2), (NAME, "eager"), torch.float64)
    ids, mask = batch("right")  # (left: eager's padded rows are NaN, and reach real rows through its P V)
    ours = models[NAME](ids, attention_mask=mask, output_attentions=True).attentions
    theirs = models["eager"](ids, attention_mask=mask, output_attentions=True).attentions
    assert len(ours) == len(theirs) == 2
    real = mask.bool()
    for a, b in zip(ours, theirs):  # (B, H, T, T) at the real query rows
        assert a.shape == b.shape and rel_err(a.transpose(1, 2)[real], b.transpose(1, 2)[real]) <= 1e-6


def test_compiled_forward_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(fullgraph=True): the engine's op is traced; q, k, v go to the separate-heads entry."""
    models = twins(GPT2LMHeadModel, gpt2_config(n_layer=1), (NAME, "sdpa"), torch.float32)
    ids, mask = batch()
    weights = torch.randn(int(mask.sum()), VOCAB)
    theirs = logits_and_grads(models["sdpa"], ids, mask, weights, use_cache=False)
    spy = Spy(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(models[NAME], fullgraph=True)
    ours = logits_and_grads(compiled, ids, mask, weights, use_cache=False)
    assert spy.heads_calls == 1 and spy.fallbacks == []  # counted once, while tracing
    assert_same(ours, theirs, torch.float32)


def test_bench_transformers_quick(tmp_path: Path) -> None:
    from causal_attention.tools.bench import hf as bench_transformers

    report = bench_transformers.main(out_dir=tmp_path, repeats=1, bf16=False, quick=True)
    rows = report["rows"]
    assert {row["name"] for row in rows} >= {"prefill vs sdpa", "prefill vs eager", "forward vs SDPA(enable_gqa)",
                                             "forward + backward vs SDPA(enable_gqa)", "decode attention vs sdpa",
                                             "decode attention vs torch.sum of its K/V bytes", "prefill vs sdpa",
                                             "generate vs sdpa"}
    for row in rows:
        assert row["ours_ms"] > 0 and row["theirs_ms"] > 0
        if row["section"].startswith("decode step"):  # the median of the rounds' ratios
            assert "rounds, caches cleared" in row["section"] and 0 < row["ratio"] < float("inf")
        else:
            assert row["ratio"] == pytest.approx(row["theirs_ms"] / row["ours_ms"])
    assert (tmp_path / "bench_transformers.png").stat().st_size > 0
