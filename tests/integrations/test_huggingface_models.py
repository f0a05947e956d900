"""Every attention call of transformers' decoder models on the engine, counted.

GPT-2, Llama (multi-head, grouped-query, multi-query), Qwen2, Mistral (sliding window), Gemma 2
(softcap, query_pre_attn_scalar, alternating sliding layers), Phi-3 and gpt-oss (attention sinks,
alternating sliding layers, experts) of random weights, in float32:
left- and right-padded forward, training, and greedy generate with the dynamic and the static cache.
Every call must be served by the engine (any fallback fails the test, with its reasons), the logits
must equal transformers' own implementation (sdpa; eager for Gemma 2 and gpt-oss, which sdpa cannot
serve) to 1e-4 at the real positions, the gradients to 1e-4 relative, and generate must give the same
tokens.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import Tensor

transformers = pytest.importorskip("transformers")

from transformers.utils import logging as hf_logging  # noqa: E402

from causal_attention.integrations import huggingface as hf_attention  # noqa: E402
from helpers import rel_err  # noqa: E402
from test_huggingface import Spy  # noqa: E402

hf_logging.set_verbosity_error()

NAME = hf_attention.register()
VOCAB = 101
T = 24
NEW_TOKENS = 10


def _common(**overrides: Any) -> dict[str, Any]:
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    options.update(overrides)
    return options


def _models() -> dict[str, tuple[Callable[[], Any], str, str]]:
    """name -> (config maker, model class name, transformers' own implementation to compare with)."""
    t = transformers
    return {
        "gpt2": (lambda: t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=256,
                                      initializer_range=0.2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
                 "GPT2LMHeadModel", "sdpa"),
        "llama": (lambda: t.LlamaConfig(**_common(num_key_value_heads=4)), "LlamaForCausalLM", "sdpa"),
        "llama_gqa": (lambda: t.LlamaConfig(**_common(num_key_value_heads=2)), "LlamaForCausalLM", "sdpa"),
        "llama_mqa": (lambda: t.LlamaConfig(**_common(num_key_value_heads=1)), "LlamaForCausalLM", "sdpa"),
        "qwen2": (lambda: t.Qwen2Config(**_common(num_key_value_heads=2)), "Qwen2ForCausalLM", "sdpa"),
        "mistral": (lambda: t.MistralConfig(**_common(num_key_value_heads=2, sliding_window=7)),
                    "MistralForCausalLM", "sdpa"),
        "gemma2": (lambda: t.Gemma2Config(**_common(num_key_value_heads=2, head_dim=16, sliding_window=7,
                                                    query_pre_attn_scalar=20)), "Gemma2ForCausalLM", "eager"),
        "phi3": (lambda: t.Phi3Config(**_common(num_key_value_heads=2)), "Phi3ForCausalLM", "sdpa"),
        "gpt_oss": (lambda: t.GptOssConfig(**_common(num_key_value_heads=2, head_dim=16, sliding_window=7,
                                                     num_local_experts=4, num_experts_per_tok=2,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
                    "GptOssForCausalLM", "eager"),
    }


MODELS = _models()


def _twins(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    make_config, cls_name, baseline = MODELS[name]
    cls = getattr(transformers, cls_name)
    config = make_config()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=NAME, dtype=torch.float32).eval()
    theirs = cls._from_config(copy.deepcopy(config), attn_implementation=baseline, dtype=torch.float32).eval()
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _batch() -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, VOCAB, (3, T))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :11] = 0  # left padding, as generate takes prompts
    return ids, mask


def _grads(model: torch.nn.Module, ids: Tensor, mask: Tensor, weights: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits[mask.bool()]
    (logits * weights).sum().backward()
    model.eval()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_call_is_served_and_matches_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, theirs = _twins(name)
    ids, left = _batch()
    spy = Spy(monkeypatch)
    with torch.no_grad():
        for mask in (left, left.flip(1)):  # left and right padding
            real = mask.bool()
            assert rel_err(ours(ids, attention_mask=mask).logits[real],
                           theirs(ids, attention_mask=mask).logits[real]) <= 1e-4
    weights = torch.randn(int(left.flip(1).sum()), VOCAB)
    logits, grads = _grads(ours, ids, left.flip(1), weights)
    ref_logits, ref_grads = _grads(theirs, ids, left.flip(1), weights)
    assert rel_err(logits, ref_logits) <= 1e-4 and grads.keys() == ref_grads.keys()
    for param in ref_grads:
        assert rel_err(grads[param], ref_grads[param]) <= 1e-4, param
    for cache in ("dynamic", "static"):
        options: dict[str, Any] = dict(attention_mask=left, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        if cache == "static":
            options["cache_implementation"] = "static"
        assert torch.equal(ours.generate(ids, **options), theirs.generate(ids, **options)), cache
    layers = 2
    # forwards: 2 + training: 1, then per generate the prefill and NEW_TOKENS - 1 steps
    assert spy.fallbacks == []
    assert spy.engine_calls == layers * (3 + 2 * NEW_TOKENS)


def test_a_wrong_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: the engine called without the sliding window (Mistral's 7 over 24
    tokens) differs from transformers."""
    from causal_attention.attention import _ops

    ours, theirs = _twins("mistral")
    ids, mask = _batch()
    heads = _ops.attention_heads

    def windowless(*args: Any, **kwargs: Any) -> Tensor:
        kwargs["window"] = None
        return heads(*args, **kwargs)

    monkeypatch.setattr(_ops, "attention_heads", windowless)
    with torch.no_grad():
        real = mask.bool()
        assert rel_err(ours(ids, attention_mask=mask).logits[real], theirs(ids, attention_mask=mask).logits[real]) > 1e-3


@pytest.mark.parametrize("name", ["llama_gqa", "gpt_oss"])
def test_compiled_fullgraph_decode_with_a_static_cache(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate with a static cache and the decode step compiled (fullgraph): the static cache's tensor
    offset is traced (each query's keys marked by the mask, no graph break), tokens equal transformers'
    own implementation's (gpt-oss: its sinks and sliding layers too)."""
    ours, theirs = _twins(name)
    ids, mask = _batch()
    options: dict[str, Any] = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                   cache_implementation="static")
    expected = theirs.generate(ids, **options)
    torch._dynamo.reset()
    spy = Spy(monkeypatch)
    ours.forward = torch.compile(ours.forward, fullgraph=True)
    assert torch.equal(ours.generate(ids, **options), expected)
    assert spy.fallbacks == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "phi3"])
def test_other_dtypes_match_sdpa(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64: the engine's logits equal sdpa's to 1e-10; bfloat16: no further from sdpa's than
    transformers' eager is (or 2 units of bfloat16's last place); at the real positions of a right-padded
    batch, every call served. (Gemma 2's eager, its yardstick, takes its softmax in float32 and makes NaN
    padded rows in float64: it is compared in float32 above.)"""
    ours, theirs = (m.to(dtype) for m in _twins(name))
    ids, left = _batch()
    mask = left.flip(1)
    real = mask.bool()
    spy = Spy(monkeypatch)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits[real].double()
        expected = theirs(ids, attention_mask=mask).logits[real].double()
        eager = type(ours)._from_config(copy.deepcopy(ours.config), attn_implementation="eager", dtype=dtype).eval()
        eager.load_state_dict(theirs.state_dict())
        spread = rel_err(eager(ids, attention_mask=mask).logits[real].double(), expected)
    tol = 1e-10 if dtype == torch.float64 else max(2 * torch.finfo(dtype).eps, 3 * spread)
    assert rel_err(got, expected) <= tol
    assert spy.fallbacks == [] and spy.engine_calls == 2


def test_training_with_gradient_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradient checkpointing recomputes each layer's attention in the backward: same gradients as sdpa's."""
    ours, theirs = _twins("qwen2")
    for model in (ours, theirs):
        model.gradient_checkpointing_enable()
    ids, left = _batch()
    mask = left.flip(1)
    weights = torch.randn(int(mask.sum()), VOCAB)
    spy = Spy(monkeypatch)
    logits, grads = _grads(ours, ids, mask, weights)
    ref_logits, ref_grads = _grads(theirs, ids, mask, weights)
    assert rel_err(logits, ref_logits) <= 1e-4
    for param in ref_grads:
        assert rel_err(grads[param], ref_grads[param]) <= 1e-4, param
    assert spy.fallbacks == [] and spy.engine_calls == 4  # 2 layers, each run again in the backward
