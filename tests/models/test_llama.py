"""The Llama family in GPT: transformers' LlamaForCausalLM (grouped-query, Llama 3 rope scaling),
Qwen2ForCausalLM (q/k/v biases, tied head) and MistralForCausalLM (sliding window), random weights,
converted by from_huggingface: float64 logits equal transformers' at every real position (right
and left padding), greedy generate token-equal, the state dict back exactly, save_pretrained
directories (sharded) read as they are, our own files round-tripped, and every unsupported option an
error that names it."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from causal_attention.models import GPT, CheckpointError, GPTConfig, from_huggingface, to_huggingface_state_dict
from causal_attention.models.convert import config_from_huggingface

transformers = pytest.importorskip("transformers")

F64 = torch.float64
V = 97


def hf_model(kind: str, **overrides: Any) -> Any:
    """A transformers model of `kind` with random weights (every parameter perturbed), float64, eval."""
    common: dict[str, Any] = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  max_position_embeddings=64)
    if kind == "llama":
        values = dict(num_attention_heads=8, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        config, cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif kind == "llama-mha-bias":
        values = dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                      tie_word_embeddings=True)
        config, cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif kind == "qwen2":
        values = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6)
        config, cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    else:
        values = dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=6)
        config, cls = transformers.MistralConfig, transformers.MistralForCausalLM
    cfg = config(**{**common, **values, **overrides})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(F64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


KINDS = ["llama", "llama-mha-bias", "qwen2", "mistral"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_equal_transformers_in_float64(kind: str, padding: str) -> None:
    hf = hf_model(kind)
    ours = from_huggingface(hf).eval()
    T = 23
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (4, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor([23, 17, 1, 9])[:, None]
    if padding == "left":
        mask = mask.flip(1)
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask.long()).logits
        got = ours(tokens, mask)
        full = ours(tokens)
    assert (got - expected)[mask].abs().max() <= 1e-10
    assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
    assert (full - hf(tokens).logits).abs().max() <= 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_transformers(kind: str) -> None:
    hf = hf_model(kind)
    ours = from_huggingface(hf).eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (9, 1, 14, 4)]
    got = ours.generate(prompts, 16)
    assert got == ours.generate(prompts, 16, use_cache=False)
    for prompt, tokens in zip(prompts, got):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_the_state_dict_goes_back_exactly(kind: str) -> None:
    hf = hf_model(kind)
    back = to_huggingface_state_dict(from_huggingface(hf))
    theirs = {k: v for k, v in hf.state_dict().items() if "inv_freq" not in k}
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[k], theirs[k]) for k in theirs)


def test_gradients_equal_transformers() -> None:
    hf = hf_model("llama")
    ours = from_huggingface(hf)
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.arange(11)[None, :] < torch.tensor([11, 6])[:, None]
    hf(tokens, attention_mask=mask.long()).logits[mask].square().sum().backward()
    ours(tokens, mask)[mask].square().sum().backward()
    ours_grads = to_huggingface_state_dict_of_grads(ours)
    for name, p in hf.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(ours_grads[name], p.grad, rtol=1e-9, atol=1e-10)


def to_huggingface_state_dict_of_grads(model: GPT) -> dict[str, torch.Tensor]:
    """The gradients of model's parameters under transformers' names (the state dict of a twin
    whose parameters are the gradients)."""
    twin = GPT(model.config).to(F64)
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            q.copy_(p.grad)
    return to_huggingface_state_dict(twin)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_save_pretrained_directories_are_read_as_they_are(shard: str | None, tmp_path: Path) -> None:
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path, **({} if shard is None else {"max_shard_size": shard}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    ours = from_huggingface(tmp_path)
    reference = from_huggingface(hf)
    assert ours.config == reference.config
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), reference.state_dict().values()))


def test_half_checkpoints_are_read_in_their_dtype(tmp_path: Path) -> None:
    """A bfloat16 directory gives a bfloat16 GPT holding its tensors exactly (GPT.empty: no float32 twin)."""
    hf = hf_model("llama").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    ours = from_huggingface(tmp_path)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    theirs = to_huggingface_state_dict(ours)
    assert all(torch.equal(theirs[k], v) for k, v in hf.state_dict().items() if k in theirs)
    empty = GPT.empty(ours.config, dtype=torch.float16)
    assert {p.dtype for p in empty.parameters()} == {torch.float16}
    assert {p.device.type for p in empty.parameters()} == {"cpu"}
    assert [(k, v.shape) for k, v in empty.state_dict().items()] == [(k, v.shape) for k, v in ours.state_dict().items()]


def test_our_files_round_trip_a_llama_family_model(tmp_path: Path) -> None:
    ours = from_huggingface(hf_model("mistral"))
    ours.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["positions"] == "rope" and saved["sliding_window"] == 6 and saved["n_kv_heads"] == 1
    back = GPT.load(tmp_path)
    assert back.config == ours.config
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(back.eval()(tokens), ours.eval()(tokens))


def test_gpt2_files_keep_their_keys() -> None:
    """config.json of a GPT-2-architecture model holds none of the Llama family's options (C++ reads it)."""
    values = GPTConfig.gpt2().to_dict()
    assert not {"n_kv_heads", "norm", "gated_mlp", "positions", "rope_theta", "sliding_window"} & set(values)
    assert GPTConfig.from_dict(values) == GPTConfig.gpt2()


def test_half_precision_llama_runs_and_follows_float64() -> None:
    hf = hf_model("llama")
    ours = from_huggingface(hf).eval()
    tokens = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = ours(tokens)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.1)):
            got = _cast(ours, dtype)(tokens)
            assert (got.double() - exact).abs().max() <= tol * max(1.0, float(exact.abs().max()))


def _cast(model: GPT, dtype: torch.dtype) -> GPT:
    twin = GPT(model.config).eval()
    twin.load_state_dict(model.state_dict())
    return twin.to(dtype)


@pytest.mark.parametrize(
    "kind, overrides, message",
    [
        ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope type 'yarn'"),
        ("llama", dict(head_dim=16), "head_dim=16 is not supported"),
        ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "use_sliding_window=True"),
    ],
)
def test_unsupported_options_are_named(kind: str, overrides: dict[str, Any], message: str) -> None:
    hf = hf_model(kind, **overrides)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        from_huggingface(hf)


def test_qwen2_windows_that_reach_no_layer_are_read() -> None:
    """use_sliding_window with max_window_layers >= the layers: every layer is full attention."""
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    ours = from_huggingface(hf).eval()
    assert ours.config.sliding_window is None
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-10


def test_partial_rotary_is_refused() -> None:
    values = hf_model("llama").config.to_dict()
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(CheckpointError, match="partial_rotary_factor=0.5"):
        config_from_huggingface(values)


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it() -> None:
    """transformers (4 and 5) reads rope_scaling, where given, in place of rope_parameters: a yarn
    rope_scaling beside a default rope_parameters is yarn, refused by name; a llama3 one is read
    (with the top-level rope_theta or the default, not rope_parameters')."""
    values = hf_model("llama").config.to_dict()
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    yarn = {**values, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    # (transformers writes into the dicts it is given: it reads copies.)
    assert transformers.LlamaConfig.from_dict(copy.deepcopy(yarn)).rope_parameters["rope_type"] == "yarn"
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported"):
        config_from_huggingface(yarn)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    both = {**values, "rope_scaling": llama3, "rope_theta": 7.0}
    theirs = transformers.LlamaConfig.from_dict(copy.deepcopy(both)).rope_parameters
    config = config_from_huggingface(both)
    assert config.rope_scaling == llama3 and config.rope_theta == theirs["rope_theta"] == 7.0
    assert config_from_huggingface({**values, "rope_scaling": None}).rope_theta == 5000.0


@pytest.mark.parametrize(
    "option, value, message",
    [("hidden_size", "64", 'hidden_size must be an int; got "64"'),
     ("num_hidden_layers", 2.5, "num_hidden_layers must be an int; got 2.5"),
     ("rms_norm_eps", "1e-6", 'rms_norm_eps must be a number; got "1e-6"'),
     ("attention_bias", "false", 'attention_bias must be true or false; got "false"'),
     ("vocab_size", None, "missing option vocab_size"),
     ("rope_scaling", "llama3", 'rope_scaling must be an object; got "llama3"')],
)
def test_config_values_of_the_wrong_json_type_are_named(option: str, value: Any, message: str) -> None:
    """C++'s HfConfig rules and messages: a value of another JSON type (a string "64" is not an int)
    is an error naming the option; null takes the default, and a required option has none."""
    values = hf_model("llama").config.to_dict()
    with pytest.raises(CheckpointError, match=re.escape(message)):
        config_from_huggingface({**values, option: value})


def test_a_huggingface_directory_with_a_string_hidden_size_names_its_config(tmp_path: Path) -> None:
    hf_model("llama").save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "hidden_size": "64"}))
    with pytest.raises(CheckpointError, match=re.escape(f'{tmp_path / "config.json"}: hidden_size must be an int; '
                                                        'got "64"')):
        from_huggingface(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**values, "num_hidden_layers": 10**6}))
    with pytest.raises(CheckpointError, match="num_hidden_layers=1000000 but the checkpoint holds 2 blocks"):
        from_huggingface(tmp_path)


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    broken = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("missing tensor 'model.layers.1.self_attn.k_proj.weight'")):
        from_huggingface(tmp_path)
    broken["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64, dtype=F64)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("model.layers.1.self_attn.k_proj.weight has shape (8, 64); "
                                                        "the model expects (16, 64)")):
        from_huggingface(tmp_path)
    save_file({**state, "model.layers.0.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("unexpected tensor(s) ['model.layers.0.extra.weight']")):
        from_huggingface(tmp_path)
    with pytest.raises(CheckpointError, match="needs its config"):
        from_huggingface(state)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
        (dict(norm="batchnorm"), "norm must be"),
        (dict(positions="alibi"), "positions must be"),
        (dict(positions="rope", rope_theta=0.0), "rope_theta must be a positive finite number"),
        (dict(positions="rope", rope_scaling={"rope_type": "yarn"}), "rope_type 'yarn' is not supported"),
        (dict(rope_scaling={"rope_type": "llama3"}), "rope_scaling needs positions='rope'"),
        (dict(sliding_window=0), "sliding_window must be None or a positive int"),
        (dict(qkv_bias=1), "qkv_bias must be None or a bool"),
    ],
)
def test_config_errors_name_the_option(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        GPTConfig(vocab_size=10, max_len=8, dim=32, n_heads=4, **overrides)


def test_gpt2_only_paths_refuse_the_llama_family_by_name() -> None:
    """nanoGPT and GPT-2 export and tensor parallelism cover GPT-2's architecture: a model with any of
    the Llama family's options (or SiLU) is refused naming them, never written as something else."""
    from causal_attention.integrations.parallel import parallelize_gpt
    from causal_attention.models import nanogpt_model_args, to_nanogpt_state_dict
    from causal_attention.models.convert import config_to_huggingface

    rms = GPT(GPTConfig(vocab_size=10, max_len=8, dim=32, n_heads=4, norm="rmsnorm", bias=False))
    for export in (to_nanogpt_state_dict, nanogpt_model_args):
        with pytest.raises(CheckpointError, match=re.escape("Llama family's options; this model sets ['norm']")):
            export(rms)
    with pytest.raises(ValueError, match=re.escape("sets the Llama family's ['norm']")):
        parallelize_gpt(rms, None)  # type: ignore[arg-type]
    silu = GPTConfig(vocab_size=10, max_len=8, dim=32, n_heads=4, activation="silu")
    with pytest.raises(CheckpointError, match="GPT-2 has no activation 'silu'"):
        config_to_huggingface(silu)
    with pytest.raises(CheckpointError, match="nanoGPT uses the exact GELU; this model's activation is 'silu'"):
        to_nanogpt_state_dict(GPT(silu))


def test_windowed_attention_for_onnx_is_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ONNX export the window takes the reference's operations (no translation of the engine's
    op): the same values."""
    from causal_attention.attention import backends
    from causal_attention.models import layers

    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, 13, (4 + 2 * 2) * 8, generator=gen, dtype=F64)
    mask = torch.arange(13)[None, :] < torch.tensor([13, 6])[:, None]
    engine, _ = layers.windowed_attention(qkv, mask, 4, 2, 5)
    monkeypatch.setattr(backends, "onnx_exporting", lambda: True)
    exported, _ = layers.windowed_attention(qkv, mask, 4, 2, 5)
    assert (engine - exported)[mask].abs().max() <= 1e-12
