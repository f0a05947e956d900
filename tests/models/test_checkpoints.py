"""Checkpoints: exact converters for nn.MultiheadAttention, transformers' GPT-2 and nanoGPT, and the
project's own files.

Every transformers model is built from a config with random weights (nothing is downloaded); every
bias and LayerNorm parameter is perturbed away from its initial 0 / 1 so that a mapping mistake
shows. Parity is measured as helpers.rel_err at the real positions of right-padded batches.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from causal_attention import CausalSelfAttention
from causal_attention.models import (
    GPT,
    CheckpointError,
    GPTConfig,
    from_huggingface,
    from_nanogpt,
    nanogpt_model_args,
    to_huggingface,
    to_huggingface_state_dict,
    to_nanogpt_state_dict,
)
from helpers import mha_forward, rel_err
from models.checkpoint_cases import CASES, write

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402

F64, F32 = torch.float64, torch.float32
PARITY_TOL = {F64: 1e-10, F32: 1e-4}  # the bounds for logits against transformers


# ---------------------------------------------------------------------------------------------
# Helpers


def perturb_(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Adds noise to every parameter (biases leave 0, LayerNorm weights leave 1)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * std)
    return module


def small_hf_config(**overrides: Any) -> GPT2Config:
    values: dict[str, Any] = dict(vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=100, eos_token_id=100)
    values.update(overrides)
    return GPT2Config(**values)


def hf_model(config: GPT2Config, dtype: torch.dtype = F64, cls: type = GPT2LMHeadModel) -> Any:
    return perturb_(cls(config)).to(dtype).eval()


def right_padded(lengths: list[int], vocab: int) -> tuple[Tensor, Tensor]:
    """Random tokens (B, T) and the bool mask (B, T) of right padding, T = max(lengths)."""
    T = max(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    tokens = torch.randint(0, vocab, (len(lengths), T))
    return tokens, mask


def states_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    """Same keys, and every tensor bitwise equal (dtype included)."""
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def hf_logits(hf: Any, tokens: Tensor, mask: Tensor) -> Tensor:
    with torch.no_grad():
        return hf(input_ids=tokens, attention_mask=mask.long()).logits


def ours_logits(model: GPT, tokens: Tensor, mask: Tensor) -> Tensor:
    with torch.no_grad():
        return model(tokens, mask)


def generating_hf(dtype: torch.dtype, **overrides: Any) -> Any:
    """A small GPT2LMHeadModel whose greedy continuations are varied (larger weights) and never
    reach eos (token 100): its tied embedding row is zero, so its logit is 0 while the largest of
    the others is positive."""
    hf = hf_model(small_hf_config(initializer_range=0.3, **overrides), dtype)
    with torch.no_grad():
        hf.transformer.wte.weight[100] = 0
    return hf


def hf_generate(hf: Any, prompts: list[list[int]], n: int, eos: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding needed)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            seq = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=eos, eos_token_id=eos)
            out.append(seq[0, len(p):].tolist())
    return out


# ---------------------------------------------------------------------------------------------
# 1. nn.MultiheadAttention <-> CausalSelfAttention


def _random_mha(dim: int, heads: int, bias: bool) -> nn.MultiheadAttention:
    mha = nn.MultiheadAttention(dim, heads, bias=bias, batch_first=True, dtype=F64)
    return perturb_(mha, 0.1)  # in_proj_bias and out_proj.bias start at 0


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("T", [1, 7, 113])
@pytest.mark.parametrize("dim, heads", [(16, 2), (96, 2), (64, 8)], ids=["hd8", "hd48", "h8hd8"])
def test_from_multihead_attention_outputs_and_gradients(dim, heads, T, bias, padded):
    mha = _random_mha(dim, heads, bias)
    attn = CausalSelfAttention.from_multihead_attention(mha)
    assert (attn.dim, attn.n_heads, attn.qkv.weight.dtype) == (dim, heads, F64)
    assert (attn.qkv.bias is None) == (not bias) and (attn.proj.bias is None) == (not bias)
    B = 4
    mask = None
    if padded:
        mask = torch.arange(T)[None, :] < torch.tensor([T, max(1, T - 3), 1, max(1, T // 2)])[:, None]
    x = torch.randn(B, T, dim, dtype=F64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = attn(x1, mask), mha_forward(mha, x2, mask)
    assert rel_err(y1, y2) <= 1e-12  # every position, padded queries included
    g = torch.randn_like(y1)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    pairs = [(x1.grad, x2.grad), (attn.qkv.weight.grad, mha.in_proj_weight.grad),
             (attn.proj.weight.grad, mha.out_proj.weight.grad)]
    if bias:
        pairs += [(attn.qkv.bias.grad, mha.in_proj_bias.grad), (attn.proj.bias.grad, mha.out_proj.bias.grad)]
    for ours, theirs in pairs:
        assert ours is not None and theirs is not None
        assert rel_err(ours, theirs) <= 1e-12


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_multihead_attention_round_trip_is_bitwise(bias):
    mha = _random_mha(48, 6, bias)
    attn = CausalSelfAttention.from_multihead_attention(mha)
    back = attn.to_multihead_attention()
    assert back.batch_first and (back.embed_dim, back.num_heads) == (48, 6)
    states_equal(back.state_dict(), mha.state_dict())
    again = CausalSelfAttention.from_multihead_attention(back)
    states_equal(again.state_dict(), attn.state_dict())
    expected_keys = ["qkv.weight", "proj.weight"] + (["qkv.bias", "proj.bias"] if bias else [])
    assert sorted(attn.state_dict()) == sorted(expected_keys)
    # The exported module computes what the layer computes.
    x = torch.randn(2, 9, 48, dtype=F64)
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [4]])
    with torch.no_grad():
        assert rel_err(mha_forward(back, x, mask), attn(x, mask)) <= 1e-12


@pytest.mark.parametrize(
    "kwargs, option",
    [(dict(kdim=8), "kdim"), (dict(vdim=8), "vdim"), (dict(add_bias_kv=True), "add_bias_kv"),
     (dict(add_zero_attn=True), "add_zero_attn")],
    ids=["kdim", "vdim", "add_bias_kv", "add_zero_attn"],
)
def test_from_multihead_attention_refuses_what_the_layer_cannot_represent(kwargs, option):
    mha = nn.MultiheadAttention(16, 2, batch_first=True, **kwargs)
    with pytest.raises(ValueError, match=option):
        CausalSelfAttention.from_multihead_attention(mha)


def test_from_multihead_attention_takes_only_multihead_attention():
    with pytest.raises(TypeError, match="nn.MultiheadAttention"):
        CausalSelfAttention.from_multihead_attention(nn.Linear(16, 48))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# 2. transformers' GPT-2: parity


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_gpt2_logits_match_transformers(dtype):
    hf = hf_model(small_hf_config(), dtype)
    model = from_huggingface(hf).eval()
    assert model.tok.weight.dtype == dtype
    T = 29
    tokens, mask = right_padded([T, T - 3, 1, T - 5], 101)
    ours, theirs = ours_logits(model, tokens, mask), hf_logits(hf, tokens, mask)
    assert ours.dtype == dtype
    err = rel_err(ours[mask], theirs[mask])
    assert err <= PARITY_TOL[dtype], err
    assert torch.count_nonzero(ours[~mask]) == 0  # nothing is computed for padding


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gpt2_gradients_match_transformers(tie):
    """Gradients of a loss on the real positions of a padded batch, ours mapped to transformers'
    names through to_huggingface_state_dict, against transformers' own (float64)."""
    hf = hf_model(small_hf_config(tie_word_embeddings=tie))
    model = from_huggingface(hf).eval()
    assert model.config.tie_head is tie
    tokens, mask = right_padded([21, 18, 1, 16], 101)
    targets = torch.randint(0, 101, tokens.shape)
    loss_ours = nn.functional.cross_entropy(model(tokens, mask)[mask], targets[mask])
    loss_hf = nn.functional.cross_entropy(hf(input_ids=tokens, attention_mask=mask.long()).logits[mask], targets[mask])
    assert abs(loss_ours.item() - loss_hf.item()) <= 1e-12
    loss_ours.backward()
    loss_hf.backward()
    grads = GPT(model.config).double()  # a model whose weights are our gradients
    grads.load_state_dict({name: p.grad for name, p in model.named_parameters()})
    mapped = to_huggingface_state_dict(grads)
    theirs = dict(hf.named_parameters())
    assert set(theirs) <= set(mapped)
    for name, p in theirs.items():
        assert p.grad is not None, name
        assert rel_err(mapped[name], p.grad) <= 1e-12, name


@pytest.fixture(scope="module")
def gpt2_124m() -> tuple[Any, GPT]:
    """transformers' default GPT2Config (GPT-2 small, 124M) with random weights, and our copy."""
    torch.manual_seed(124)
    hf = GPT2LMHeadModel(GPT2Config()).eval()
    return hf, from_huggingface(hf).eval()


def test_gpt2_124m_logits_match_transformers(gpt2_124m):
    hf, model = gpt2_124m
    assert model.config == GPTConfig.gpt2()
    tokens, mask = right_padded([64, 41], 50257)
    err32 = rel_err(ours_logits(model, tokens, mask)[mask], hf_logits(hf, tokens, mask)[mask])
    assert err32 <= PARITY_TOL[F32], err32
    # float64 copies of both (about 1 GB each), one short forward.
    hf64, model64 = copy.deepcopy(hf).double(), copy.deepcopy(model).double()
    err64 = rel_err(ours_logits(model64, tokens, mask)[mask], hf_logits(hf64, tokens, mask)[mask])
    assert err64 <= PARITY_TOL[F64], err64


def test_gpt2_124m_generation_matches_transformers(gpt2_124m):
    hf, model = gpt2_124m
    prompts = [[464, 3290, 318], [40, 588, 284, 1561, 546, 262, 8848, 13]]
    ours = model.generate(prompts, 8, eos_id=50256, pad_id=50256)
    assert ours == hf_generate(hf, prompts, 8, 50256)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_gpt2_greedy_generation_matches_transformers(dtype):
    hf = generating_hf(dtype)
    model = from_huggingface(hf).eval()
    prompts = [[5, 17, 3, 99, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [60, 61, 62]]
    expected = hf_generate(hf, prompts, 32, 100)
    assert [len(g) for g in expected] == [32] * 4
    assert model.generate(prompts, 32, eos_id=100) == expected
    assert model.generate(prompts, 32, eos_id=100, use_cache=False) == expected


def test_gpt2_generation_stops_at_eos_as_transformers_does():
    """An eos token the model does produce: both stop right after it, per sequence."""
    hf = hf_model(small_hf_config(initializer_range=0.3))
    model = from_huggingface(hf).eval()
    prompts = [[5, 17, 3, 99, 42], [7], [60, 61, 62]]
    free = model.generate(prompts, 16, eos_id=None)
    eos = free[1][3]  # the fourth token of the second prompt's continuation
    expected = hf_generate(hf, prompts, 16, eos)
    assert expected[1][-1] == eos and len(expected[1]) <= 4
    assert model.generate(prompts, 16, eos_id=eos) == expected


def test_top_k_sampling_is_reproducible_and_stays_in_the_top_k():
    hf = hf_model(small_hf_config(initializer_range=0.3))
    model = from_huggingface(hf).eval()
    prompts = [[5, 17, 3], [7], [60, 61, 62, 63, 64, 65]]
    k = 5
    runs = [model.generate(prompts, 20, top_k=k, temperature=0.8, generator=torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert model.generate(prompts, 20, top_k=k, generator=torch.Generator().manual_seed(8)) != runs[0]
    with torch.no_grad():
        for prompt, generated in zip(prompts, runs[0]):
            seq = prompt + generated
            logits = model(torch.tensor([seq]))[0]  # (T, V)
            for i, token in enumerate(generated):
                top = logits[len(prompt) + i - 1].topk(k).indices.tolist()
                assert token in top, (prompt, i, token, top)
    assert model.generate(prompts, 20, top_k=1) == model.generate(prompts, 20)  # top-1 is greedy


# ---------------------------------------------------------------------------------------------
# 3. transformers' GPT-2: what is accepted


def test_gpt2model_without_head_is_accepted():
    hf = hf_model(small_hf_config(), cls=GPT2Model)
    model = from_huggingface(hf).eval()
    assert model.config.tie_head
    tokens, mask = right_padded([13, 7, 10], 101)
    with torch.no_grad():
        h = hf(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
    expected = h @ hf.wte.weight.t()  # the head GPT-2 ties to the token embedding
    assert rel_err(ours_logits(model, tokens, mask)[mask], expected[mask]) <= 1e-10
    # Its bare state_dict (no 'transformer.' prefix) too.
    again = from_huggingface(hf.state_dict(), n_heads=4)
    states_equal(again.state_dict(), model.state_dict())


def test_state_dict_is_accepted_heads_inferred_or_given():
    # n_embd 128 with 2 heads: the default inference (dim // 64) is right.
    hf = hf_model(small_hf_config(n_embd=128, n_head=2))
    model = from_huggingface(hf.state_dict()).eval()
    assert (model.config.n_heads, model.config.dim, model.config.n_layers) == (2, 128, 2)
    assert model.config.activation == "gelu_tanh" and model.config.tie_head
    states_equal(model.state_dict(), from_huggingface(hf).state_dict())
    tokens, mask = right_padded([11, 4], 101)
    assert rel_err(ours_logits(model, tokens, mask)[mask], hf_logits(hf, tokens, mask)[mask]) <= 1e-10
    # 4 heads of 16: must be given.
    hf4 = hf_model(small_hf_config())
    model4 = from_huggingface(hf4.state_dict(), n_heads=4).eval()
    assert model4.config.n_heads == 4
    assert rel_err(ours_logits(model4, tokens, mask)[mask], hf_logits(hf4, tokens, mask)[mask]) <= 1e-10
    # The default (dim // 64 = 1 head) is a different model: the parity check must see it.
    wrong = from_huggingface(hf4.state_dict()).eval()
    assert wrong.config.n_heads == 1
    assert rel_err(ours_logits(wrong, tokens, mask)[mask], hf_logits(hf4, tokens, mask)[mask]) > 1e-6


def test_n_heads_contradicting_the_config_or_the_width_is_an_error():
    hf = hf_model(small_hf_config())
    with pytest.raises(CheckpointError, match="n_heads=3 contradicts .*n_head=4"):
        from_huggingface(hf, n_heads=3)
    with pytest.raises(ValueError, match="n_heads=5 must divide dim=64"):
        from_huggingface(hf.state_dict(), n_heads=5)


def test_save_pretrained_directory_is_read(tmp_path):
    hf = hf_model(small_hf_config(), F32)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model = from_huggingface(tmp_path)
    states_equal(model.state_dict(), from_huggingface(hf).state_dict())
    assert model.config == from_huggingface(hf).config
    tokens, mask = right_padded([20, 9, 14], 101)
    assert rel_err(ours_logits(model.eval(), tokens, mask)[mask], hf_logits(hf, tokens, mask)[mask]) <= 1e-4


def test_sharded_save_pretrained_directory_is_read(tmp_path):
    hf = hf_model(small_hf_config(), F32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 2
    states_equal(from_huggingface(tmp_path).state_dict(), from_huggingface(hf).state_dict())


def test_hub_layout_directory_is_read(tmp_path):
    """The layout of the gpt2 repository's model.safetensors: GPT2Model names (no 'transformer.'),
    no lm_head, causal-mask buffers h.{i}.attn.bias (1, 1, n_positions, n_positions) and
    h.{i}.attn.masked_bias."""
    from safetensors.torch import save_file

    hf = hf_model(small_hf_config(), F32)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.ones(64, 64).tril()[None, None]
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.to_json_file(str(tmp_path / "config.json"))
    model = from_huggingface(tmp_path)
    states_equal(model.state_dict(), from_huggingface(hf).state_dict())
    assert model.tok.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()  # a copy


def test_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        from_huggingface(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_huggingface(tmp_path)
    hf_model(small_hf_config(), F32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_huggingface(tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(tie_head=False), dict(activation="gelu", mlp_hidden=96, layer_norm_eps=1e-6)],
    ids=["tied", "untied", "gelu-mlp96-eps"],
)
def test_round_trip_through_transformers_is_bitwise(overrides):
    config = GPTConfig.gpt2(vocab_size=101, max_len=32, dim=64, n_layers=2, n_heads=4, **overrides)
    model = perturb_(GPT(config).double(), 0.05).eval()
    hf = to_huggingface(model).eval()
    assert isinstance(hf, GPT2LMHeadModel) and next(hf.parameters()).dtype == F64
    back = from_huggingface(hf)
    assert back.config == config
    states_equal(back.state_dict(), model.state_dict())
    # The transformers model computes what ours does.
    tokens, mask = right_padded([32, 20, 3], 101)
    assert rel_err(hf_logits(hf, tokens, mask)[mask], ours_logits(model, tokens, mask)[mask]) <= 1e-10


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_to_huggingface_state_dict_equals_transformers_state_dict(tie):
    hf = hf_model(small_hf_config(tie_word_embeddings=tie))
    ours = to_huggingface_state_dict(from_huggingface(hf))
    states_equal(ours, hf.state_dict())
    assert torch.equal(ours["lm_head.weight"], ours["transformer.wte.weight"]) is tie


def test_half_precision_checkpoints_stay_bitwise():
    hf = hf_model(small_hf_config(), torch.bfloat16)
    model = from_huggingface(hf)
    assert model.tok.weight.dtype == torch.bfloat16
    states_equal(to_huggingface_state_dict(model), hf.state_dict())


def test_to_huggingface_passes_the_attention_implementation():
    model = perturb_(GPT(GPTConfig.gpt2(vocab_size=101, max_len=32, dim=64, n_layers=2, n_heads=4)).double()).eval()
    hf = to_huggingface(model, attn_implementation="eager").eval()
    assert hf.config._attn_implementation == "eager"
    tokens, mask = right_padded([32, 20, 3], 101)
    assert rel_err(hf_logits(hf, tokens, mask)[mask], ours_logits(model, tokens, mask)[mask]) <= 1e-10


def test_to_huggingface_refuses_bias_false():
    model = GPT(GPTConfig(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2, bias=False))
    with pytest.raises(CheckpointError, match="bias=False"):
        to_huggingface_state_dict(model)


# ---------------------------------------------------------------------------------------------
# 4. transformers' GPT-2: what is refused, by name


@pytest.mark.parametrize(
    "option, value",
    [("scale_attn_by_inverse_layer_idx", True), ("reorder_and_upcast_attn", True), ("scale_attn_weights", False),
     ("activation_function", "relu"), ("add_cross_attention", True)],
)
def test_architecture_options_gpt_lacks_are_errors(tmp_path, option, value):
    hf = GPT2LMHeadModel(small_hf_config(**{option: value}))
    with pytest.raises(CheckpointError, match=f"{option}={value!r}"):
        from_huggingface(hf)
    hf.save_pretrained(tmp_path)  # and the same from a directory
    with pytest.raises(CheckpointError, match=f"{option}={value!r}"):
        from_huggingface(tmp_path)


def test_heads_not_dividing_the_width_in_a_config_is_an_error(tmp_path):
    GPT2LMHeadModel(small_hf_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["n_head"] = 5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="n_head=5 does not divide n_embd=64"):
        from_huggingface(tmp_path)


def test_other_model_types_are_errors():
    with pytest.raises(CheckpointError, match="GPT2ForSequenceClassification"):
        from_huggingface(transformers.GPT2ForSequenceClassification(small_hf_config()))
    with pytest.raises(TypeError, match="from_huggingface takes"):
        from_huggingface(42)


def _hf_state() -> dict[str, Tensor]:
    return dict(hf_model(small_hf_config(), F32).state_dict())


def test_state_dict_mismatches_name_the_key():
    state = _hf_state()
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(CheckpointError, match=re.escape("'transformer.h.1.mlp.c_fc.bias'")):
        from_huggingface(state, n_heads=4)

    state = _hf_state()
    state["transformer.h.0.attn.rotary.inv_freq"] = torch.zeros(8)
    with pytest.raises(CheckpointError, match=re.escape("transformer.h.0.attn.rotary.inv_freq")):
        from_huggingface(state, n_heads=4)

    state = _hf_state()
    state["transformer.h.1.attn.c_attn.weight"] = state["transformer.h.1.attn.c_attn.weight"][:, :96]
    message = "'transformer.h.1.attn.c_attn.weight' has shape (64, 96); the model expects (64, 192)"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        from_huggingface(state, n_heads=4)

    state = _hf_state()
    state["lm_head.weight"] = state["lm_head.weight"][:50]  # an (untied) head of the wrong size
    with pytest.raises(CheckpointError, match=re.escape("'lm_head.weight' has shape (50, 64)")):
        from_huggingface(state, n_heads=4)


def test_causal_mask_buffers_of_older_checkpoints():
    """Older transformers stored h.{i}.attn.bias (the causal mask) and masked_bias: a causal one is
    accepted and dropped, anything else names the buffer."""
    state = _hf_state()
    model = from_huggingface(state, n_heads=4)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()[None, None]  # (1, 1, n_positions, n_positions)
    for i in range(2):
        state[f"transformer.h.{i}.attn.bias"] = causal
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    states_equal(from_huggingface(state, n_heads=4).state_dict(), model.state_dict())
    state["transformer.h.1.attn.bias"] = torch.ones_like(causal)
    with pytest.raises(CheckpointError, match=re.escape("transformer.h.1.attn.bias")):
        from_huggingface(state, n_heads=4)


# ---------------------------------------------------------------------------------------------
# 5. nanoGPT


def nanogpt_checkpoint(hf: Any, *, compiled: bool = True) -> dict[str, Any]:
    """The dict nanoGPT's train.py saves, built from a GPT2LMHeadModel (exact GELU): Linear weights
    (out, in), tied lm_head, causal-mask buffers attn.bias (1, 1, block_size, block_size), and the
    '_orig_mod.' prefix a torch.compile'd model's state_dict has."""
    c = hf.config
    src = hf.state_dict()
    state: dict[str, Tensor] = {}
    block_size = c.n_positions
    mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
    for key, value in src.items():
        if key == "lm_head.weight":
            continue
        conv1d = re.search(r"\.(c_attn|c_proj|c_fc)\.weight$", key)
        state[key] = value.t().contiguous() if conv1d else value.clone()
        if key.endswith(".attn.c_attn.weight"):
            state[key.replace("c_attn.weight", "bias")] = mask
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied
    if compiled:
        state = {"_orig_mod." + k: v for k, v in state.items()}
    model_args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=block_size, bias=True,
                      vocab_size=c.vocab_size, dropout=0.0)
    return dict(model=state, optimizer={}, model_args=model_args, iter_num=0, best_val_loss=1e9,
                config=dict(dataset="shakespeare_char"))


def nano_hf(dtype: torch.dtype = F64, **overrides: Any) -> Any:
    return hf_model(small_hf_config(activation_function="gelu", **overrides), dtype)


@pytest.mark.parametrize("dtype", [F64, F32], ids=["f64", "f32"])
def test_nanogpt_matches_transformers(dtype):
    hf = generating_hf(dtype, activation_function="gelu")
    model = from_nanogpt(nanogpt_checkpoint(hf)).eval()
    assert model.config.activation == "gelu" and model.config.n_heads == 4
    assert model.tok.weight.dtype == dtype
    tokens, mask = right_padded([30, 27, 1, 25], 101)
    err = rel_err(ours_logits(model, tokens, mask)[mask], hf_logits(hf, tokens, mask)[mask])
    assert err <= PARITY_TOL[dtype], err
    prompts = [[5, 17, 3, 99, 42], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [60, 61, 62]]
    expected = hf_generate(hf, prompts, 32, 100)
    assert [len(g) for g in expected] == [32] * 4
    assert model.generate(prompts, 32, eos_id=100) == expected


def test_nanogpt_checkpoint_file_and_prefixes(tmp_path):
    hf = nano_hf(F32)
    checkpoint = nanogpt_checkpoint(hf)
    model = from_nanogpt(checkpoint)
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    states_equal(from_nanogpt(tmp_path / "ckpt.pt").state_dict(), model.state_dict())
    states_equal(from_nanogpt(str(tmp_path / "ckpt.pt")).state_dict(), model.state_dict())
    # Without '_orig_mod.' (an uncompiled model) and as a bare state_dict (heads given or dim // 64).
    plain = nanogpt_checkpoint(hf, compiled=False)
    states_equal(from_nanogpt(plain).state_dict(), model.state_dict())
    states_equal(from_nanogpt(plain["model"], n_heads=4).state_dict(), model.state_dict())
    assert from_nanogpt(plain["model"]).config.n_heads == 1
    # Equal to the transformers model's weights, exactly.
    states_equal(model.state_dict(), from_huggingface(hf).state_dict())


def test_to_nanogpt_state_dict_round_trip_is_bitwise():
    hf = nano_hf(F32)
    checkpoint = nanogpt_checkpoint(hf, compiled=False)
    model = from_nanogpt(checkpoint)
    out = to_nanogpt_state_dict(model)
    without_buffers = {k: v for k, v in checkpoint["model"].items() if not k.endswith(".attn.bias")}
    states_equal(out, without_buffers)
    assert nanogpt_model_args(model) == checkpoint["model_args"]
    again = from_nanogpt(dict(model=out, model_args=nanogpt_model_args(model)))
    states_equal(again.state_dict(), model.state_dict())


def test_nanogpt_bias_false_round_trip():
    config = GPTConfig(vocab_size=67, max_len=40, dim=48, n_layers=2, n_heads=3, bias=False)
    model = perturb_(GPT(config).double(), 0.05).eval()
    state = to_nanogpt_state_dict(model)
    assert not any(k.endswith(".bias") for k in state)
    assert nanogpt_model_args(model)["bias"] is False
    back = from_nanogpt(dict(model={"_orig_mod." + k: v for k, v in state.items()},
                                 model_args=nanogpt_model_args(model))).eval()
    assert back.config == config
    states_equal(back.state_dict(), model.state_dict())
    tokens, mask = right_padded([40, 12, 33], 67)
    assert torch.equal(ours_logits(back, tokens, mask), ours_logits(model, tokens, mask))
    # A bare state_dict without biases infers bias=False.
    assert from_nanogpt(state, n_heads=3).config == config


def test_to_nanogpt_refuses_what_nanogpt_lacks():
    base = dict(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2)
    for overrides, words in [(dict(activation="gelu_tanh"), "gelu_tanh"), (dict(tie_head=False), "untied"),
                             (dict(mlp_hidden=48), "4 \\* dim")]:
        with pytest.raises(CheckpointError, match=words):
            to_nanogpt_state_dict(GPT(GPTConfig(**base, **overrides)))


def _nano_checkpoint() -> dict[str, Any]:
    return nanogpt_checkpoint(nano_hf(F32))


def test_nanogpt_mismatches_name_the_key_or_option():
    ckpt = _nano_checkpoint()
    ckpt["model"]["_orig_mod.transformer.h.1.attn.bias"] = torch.ones(1, 1, 64, 64)  # not causal
    with pytest.raises(CheckpointError, match=re.escape("transformer.h.1.attn.bias")):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model_args"]["n_kv_head"] = 2
    with pytest.raises(CheckpointError, match="n_kv_head"):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    del ckpt["model_args"]["n_embd"]
    with pytest.raises(CheckpointError, match="model_args lacks \\['n_embd'\\]"):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model_args"]["block_size"] = 32  # the checkpoint has 64 positions
    with pytest.raises(CheckpointError, match=re.escape("'transformer.wpe.weight' has shape (64, 64); the model expects (32, 64)")):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model"]["_orig_mod.transformer.h.0.attn.rotary.inv_freq"] = torch.zeros(8)
    with pytest.raises(CheckpointError, match=re.escape("transformer.h.0.attn.rotary.inv_freq")):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    del ckpt["model"]["_orig_mod.transformer.h.1.mlp.c_proj.bias"]
    with pytest.raises(CheckpointError, match=re.escape("transformer.h.1.mlp.c_proj.bias")):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    key = "_orig_mod.transformer.h.0.mlp.c_fc.weight"
    ckpt["model"][key] = ckpt["model"][key][:200]
    message = "'transformer.h.0.mlp.c_fc.weight' has shape (200, 64); the model expects (256, 64)"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model_args"]["n_head"] = 5
    with pytest.raises(CheckpointError, match="n_head=5 does not divide n_embd=64"):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model_args"]["bias"] = False  # the checkpoint has biases
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        from_nanogpt(ckpt)

    ckpt = _nano_checkpoint()
    ckpt["model"]["_orig_mod.lm_head.weight"] = ckpt["model"]["_orig_mod.lm_head.weight"] + 1  # untied
    with pytest.raises(CheckpointError, match=re.escape("'lm_head.weight'")):
        from_nanogpt(ckpt)

    with pytest.raises(TypeError, match="from_nanogpt takes"):
        from_nanogpt(42)


def test_nanogpt_unreadable_files_are_checkpoint_errors(tmp_path):
    """A truncated ckpt.pt (torch's zip reader fails) and an empty one are CheckpointErrors naming
    the file, as a text file is."""
    torch.save(_nano_checkpoint(), tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    for name, content in [("trunc.pt", data[:1000]), ("empty.pt", b""), ("text.pt", b"# not a checkpoint\n")]:
        (tmp_path / name).write_bytes(content)
        message = f"{tmp_path / name}: not a nanoGPT checkpoint (torch.load: "
        with pytest.raises(CheckpointError, match=re.escape(message)):
            from_nanogpt(tmp_path / name)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("vocab_size", 10**12, "'transformer.wte.weight' has shape (101, 64); the model expects (1000000000000, 64) "
                               "(model_args vocab_size=1000000000000, n_embd=64)"),
        ("n_layer", 10**6, "model_args n_layer=1000000 but the checkpoint holds 2 blocks"),
        ("n_layer", 1, "model_args n_layer=1 but the checkpoint holds 2 blocks"),
        ("block_size", 10**9, "'transformer.wpe.weight' has shape (64, 64); the model expects (1000000000, 64) "
                              "(model_args block_size=1000000000"),
        ("n_embd", 4096, "'transformer.wte.weight' has shape (101, 64); the model expects (101, 4096)"),
        ("n_embd", "64", 'model_args: n_embd must be an int; got "64"'),
        ("n_layer", 2.5, "model_args: n_layer must be an int; got 2.5"),
        ("vocab_size", True, "model_args: vocab_size must be an int; got true"),
        ("bias", "yes", 'model_args: bias must be true or false; got "yes"'),
        ("dropout", "0.1", 'model_args: dropout must be a number; got "0.1"'),
        ("vocab_size", 0, "model_args: GPTConfig.vocab_size must be a positive int; got 0"),
    ],
)
def test_nanogpt_model_args_are_checked_against_the_tensors_first(option, value, message):
    """model_args that disagree with the tensors, or are not of their type, are errors naming the
    option, before the model is built: no allocation of what model_args asks for (10**12 tokens, a
    million layers), in a moment."""
    ckpt = _nano_checkpoint()
    ckpt["model_args"][option] = value
    with pytest.raises(CheckpointError, match=re.escape(message)):
        from_nanogpt(ckpt)


def test_huggingface_config_values_of_the_wrong_type_or_size_are_named(tmp_path):
    """config.json's options must be of their JSON type (C++'s HfConfig rules and messages, naming
    the file), and must agree with the tensors before the model is built."""
    hf = hf_model(small_hf_config(), F32)
    hf.save_pretrained(str(tmp_path))
    values = json.loads((tmp_path / "config.json").read_text())
    config_json = f"{tmp_path / 'config.json'}: "
    cases = [("n_embd", "64", config_json + 'n_embd must be an int; got "64"'),
             ("layer_norm_epsilon", "1e-5", config_json + 'layer_norm_epsilon must be a number; got "1e-5"'),
             ("tie_word_embeddings", 1, config_json + "tie_word_embeddings must be true or false; got 1"),
             ("n_layer", None, "config n_layer=12 but the checkpoint holds 2 blocks"),  # null: the default, 12
             ("n_layer", 10**6, "config n_layer=1000000 but the checkpoint holds 2 blocks"),
             ("vocab_size", 10**12, "'transformer.wte.weight' has shape (101, 64); the model expects "
                                    "(1000000000000, 64) (config vocab_size=1000000000000, n_embd=64)"),
             ("n_inner", 10**9, "'transformer.h.0.mlp.c_fc.weight' has shape (64, 256); the model expects "
                                "(64, 1000000000) (config n_embd=64, n_inner=1000000000)")]
    for option, value, message in cases:
        (tmp_path / "config.json").write_text(json.dumps({**values, option: value}))
        with pytest.raises(CheckpointError, match=re.escape(message)):
            from_huggingface(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**values, "n_head": 4.0}))  # a whole float reads as int()
    assert from_huggingface(tmp_path).config.n_heads == 4


def test_to_huggingface_writes_token_ids_of_the_vocabulary():
    """GPT2Config's bos/eos default (50256, GPT-2's tokenizer's) is kept only where the vocabulary
    holds it; ids passed are checked against the vocabulary, naming them."""
    small = GPT(GPTConfig(vocab_size=13, max_len=8, dim=16, n_layers=1, n_heads=2, activation="gelu_tanh"))
    config = to_huggingface(small).config
    assert (config.bos_token_id, config.eos_token_id) == (None, None)
    config = to_huggingface(small, bos_token_id=12, eos_token_id=11).config
    assert (config.bos_token_id, config.eos_token_id) == (12, 11)
    with pytest.raises(CheckpointError, match=re.escape("eos_token_id must be None or a token id or a non-empty "
                                                        "list of them in 0..vocab_size-1 = 0..12; got 13")):
        to_huggingface(small, eos_token_id=13)
    wide = GPT(GPTConfig(vocab_size=50257, max_len=8, dim=16, n_layers=1, n_heads=2, activation="gelu_tanh"))
    assert to_huggingface(wide).config.eos_token_id == 50256
    # A list of end ids, as Llama 3's (transformers' generate stops at any of them)
    assert to_huggingface(small, eos_token_id=[11, 3]).config.eos_token_id == [11, 3]
    with pytest.raises(CheckpointError, match=re.escape("eos_token_id must be None or a token id or a non-empty "
                                                        "list of them in 0..vocab_size-1 = 0..12; got [11, 13]")):
        to_huggingface(small, eos_token_id=[11, 13])


# ---------------------------------------------------------------------------------------------
# 6. The project's own files: GPT.save / GPT.load


@pytest.mark.parametrize(
    "overrides, dtype",
    [(dict(), F32), (dict(tie_head=False), F32), (dict(bias=False), F32), (dict(activation="gelu_tanh"), F64)],
    ids=["tied", "untied", "nobias", "f64"],
)
def test_save_load_round_trip_is_bitwise(tmp_path, overrides, dtype):
    config = GPTConfig(vocab_size=37, max_len=24, dim=32, n_layers=2, n_heads=4, mlp_hidden=80,
                       layer_norm_eps=1e-6, resid_dropout=0.1, **overrides)
    model = perturb_(GPT(config).to(dtype), 0.05)
    model.save(tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json", "model.safetensors"]
    back = GPT.load(tmp_path / "run")
    assert back.config == config
    states_equal(back.state_dict(), model.state_dict())


def test_load_allocates_huge_page_memory_and_draws_nothing(tmp_path):
    """GPT.load builds the model empty: nothing drawn from the generator, no torch._dynamo imported
    (normal_ on the meta device would), each weight of a huge page or more on memory of its own from a
    huge-page boundary (make_caches then has nothing to copy), and the values the file holds."""
    config = GPTConfig(vocab_size=9000, max_len=24, dim=64, n_layers=1, n_heads=4, mlp_hidden=80)  # tok: 2.2 MB
    model = perturb_(GPT(config), 0.05)
    model.save(tmp_path / "run")
    script = f"""
import sys, torch
from causal_attention.models import GPT
torch.manual_seed(3)
back = GPT.load({str(tmp_path / "run")!r})
drawn = torch.randn(4)
torch.manual_seed(3)
assert torch.equal(drawn, torch.randn(4)), "GPT.load drew from the generator"
assert "torch._dynamo" not in sys.modules, "GPT.load imported torch._dynamo"
assert back.tok.weight.data_ptr() % (2 << 20) == 0, hex(back.tok.weight.data_ptr())
torch.save(back.state_dict(), {str(tmp_path / "state.pt")!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    states_equal(torch.load(tmp_path / "state.pt"), model.state_dict())


def test_load_errors_name_the_file_or_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    config = GPTConfig(vocab_size=37, max_len=24, dim=32, n_layers=2, n_heads=4)
    GPT(config).save(tmp_path)
    weights = tmp_path / "model.safetensors"
    good = load_file(str(weights))

    save_file({**good, "blocks.1.mlp.0.weight": good["blocks.1.mlp.0.weight"][:64].contiguous()}, str(weights))
    with pytest.raises(CheckpointError, match=re.escape("tensor 'blocks.1.mlp.0.weight' has shape (64, 32)")):
        GPT.load(tmp_path)

    save_file({**good, "blocks.0.attn.rotary": torch.zeros(4)}, str(weights))
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor(s) ['blocks.0.attn.rotary']")):
        GPT.load(tmp_path)

    save_file({k: v for k, v in good.items() if k != "ln_f.bias"}, str(weights))
    with pytest.raises(CheckpointError, match=re.escape("missing tensor(s) ['ln_f.bias']")):
        GPT.load(tmp_path)

    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        GPT.load(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "n_experts": 2}))
    save_file(good, str(weights))
    with pytest.raises(ValueError, match="n_experts"):
        GPT.load(tmp_path)


@pytest.mark.parametrize("ratio", [4, 2])
def test_demo_config_with_mlp_ratio_loads(tmp_path, ratio):
    """A directory as the demo wrote it before GPTConfig had mlp_hidden: config.json with mlp_ratio,
    weights by safetensors' save_model."""
    from safetensors.torch import save_model

    config = GPTConfig(vocab_size=37, max_len=24, dim=32, n_layers=2, n_heads=4, mlp_hidden=None if ratio == 4 else 64)
    model = perturb_(GPT(config), 0.05)
    save_model(model, str(tmp_path / "model.safetensors"))
    old = {"vocab_size": 37, "max_len": 24, "dim": 32, "n_layers": 2, "n_heads": 4, "mlp_ratio": ratio}
    (tmp_path / "config.json").write_text(json.dumps(old, indent=2))
    with pytest.warns(UserWarning, match=re.escape("the options it lacks take that version's values: layer_norm_eps=1e-05")):
        back = GPT.load(tmp_path)
    assert back.config == config
    states_equal(back.state_dict(), model.state_dict())


# ---------------------------------------------------------------------------------------------
# The corpus of good and bad directories shared with C++ (tests/data/checkpoint_cases.json)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_checkpoint_corpus(tmp_path, case):
    """Each case loads (with the warning it lists, or none) or is refused with a one-line error holding
    every listed piece, as csrc/tests/test_gpt.cpp's LoadGPT.SharedCorpus checks load_gpt."""
    written = write(case, tmp_path)
    if "error" in case:
        with pytest.raises(ValueError) as caught:
            GPT.load(tmp_path)
        message = str(caught.value)
        assert "\n" not in message
        for piece in case["error"]:
            assert piece in message
        return
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        model = GPT.load(tmp_path)
    messages = [str(w.message) for w in caught_warnings]
    if case["warning"]:
        assert len(messages) == 1, messages
        for piece in case["warning"]:
            assert piece in messages[0]
    else:
        assert messages == []
    states_equal(model.state_dict(), written)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(bias=False), dict(tie_head=False), dict(mlp_hidden=24), dict(bias=False, tie_head=False)],
    ids=["default", "nobias", "untied", "hidden24", "nobias-untied"],
)
def test_parameter_layout_is_the_models(overrides):
    from causal_attention.models.checkpoint import parameter_layout

    config = GPTConfig(vocab_size=11, max_len=9, dim=8, n_layers=2, n_heads=2, **overrides)
    before, block, after = parameter_layout(config)
    names = before + [(f"blocks.{i}.{name}", shape) for i in range(config.n_layers) for name, shape in block] + after
    assert names == [(name, tuple(t.shape)) for name, t in GPT(config).state_dict().items()]


def test_huge_config_is_refused_fast_in_bounded_memory(tmp_path):
    """n_layers = 10**6 beside a small file: `convert --from ours` (GPT.load) refuses it naming both
    files, in a process whose address space is capped 1 GiB above what importing the package takes."""
    case = next(case for case in CASES if case["name"] == "n_layers_huge")
    write(case, tmp_path / "run")
    code = f"""
import resource, sys
import causal_attention.models, safetensors.torch
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (used + 2**30 if hard == resource.RLIM_INFINITY else min(used + 2**30, hard), hard))
from causal_attention.tools.cli import main
main(["convert", "--from", "ours", {str(tmp_path / "run")!r}, "--out", {str(tmp_path / "out")!r}])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "config.json describes a model of 2224000688 parameters" in last, result.stderr[-2000:]
    assert "MemoryError" not in result.stderr and "allocate" not in result.stderr
    assert not (tmp_path / "out").exists()
