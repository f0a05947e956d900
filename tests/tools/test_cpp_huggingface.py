"""causal-attention-generate on transformers' save_pretrained directories as they are (the C++ GPT's
huggingface.cpp): GPT-2, Llama (GQA, Llama 3 rope scaling), Qwen2 (q/k/v biases, a tied head) and
Mistral (a sliding window), one file or sharded with model.safetensors.index.json, in float32,
bfloat16 and float16. Its tokens must equal those of Python's GPT.from_huggingface on the same
directory (greedy and seeded top-k), its logits Python's to float32 rounding; every option GPT lacks
and every broken file is exit code 2 naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from causal_attention.models import GPT
from causal_attention.models.convert import from_huggingface
from tools.test_cpp_generate import check_against_python, expect_error, run

transformers = pytest.importorskip("transformers")

VOCAB = 90


def hf_config(kind: str, vocab_size: int = VOCAB):
    """A small config of each supported model_type, with the options that set it apart."""
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    t = transformers
    if kind == "gpt2":
        return t.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                            eos_token_id=None)
    if kind == "llama":
        return t.LlamaConfig(**common, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if kind == "qwen2":
        return t.Qwen2Config(**common, num_key_value_heads=1, tie_word_embeddings=True)
    assert kind == "mistral"
    return t.MistralConfig(**common, num_key_value_heads=2, sliding_window=5, head_dim=8)


MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}


def save_hf(kind: str, directory: Path, *, dtype: torch.dtype = torch.float32, sharded: bool = False,
            seed: int = 0, vocab_size: int = VOCAB) -> Path:
    """A model of random weights (norm weights and biases random too) saved by transformers."""
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[kind])(hf_config(kind, vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms around 1, biases around 0: every tensor's placement shows
                p.copy_((1.0 if "norm" in name or "ln_" in name else 0.0) + 0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(str(directory), max_shard_size="20KB" if sharded else "10GB")
    return directory


def token_args(prompts: list[list[int]]) -> list[str]:
    return sum((["--tokens", ",".join(map(str, p))] for p in prompts), [])


def lines_of(result) -> list[list[int]]:
    return [[int(t) for t in line.split(",")] for line in result.stdout.splitlines()]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16], [17, 18, 19, 20, 21, 22, 23]]

CASES = [("gpt2", torch.float32, False), ("llama", torch.float32, False), ("qwen2", torch.float32, False),
         ("mistral", torch.float32, False), ("llama", torch.float32, True), ("gpt2", torch.float32, True),
         ("llama", torch.bfloat16, True), ("qwen2", torch.float16, False), ("mistral", torch.bfloat16, True),
         ("gpt2", torch.float16, True)]


@pytest.mark.parametrize("kind,dtype,sharded", CASES,
                         ids=[f"{k}-{str(d)[6:]}{'-sharded' if s else ''}" for k, d, s in CASES])
def test_directories_generate_as_python(kind: str, dtype: torch.dtype, sharded: bool, tmp_path: Path) -> None:
    """The program reads the directory itself (no conversion): Python's tokens exactly (a ragged batch
    longer than Mistral's window), and in float32 Python's logits of the prompts and of every step."""
    directory = save_hf(kind, tmp_path / "hf", dtype=dtype, sharded=sharded)
    assert (directory / "model.safetensors.index.json").is_file() == sharded
    model = from_huggingface(directory).eval()
    assert model.tok.weight.dtype == dtype
    expected = model.generate(PROMPTS, 10)
    dump = tmp_path / "d.safetensors"
    result = run("--model", str(directory), "--max-new-tokens", "10", "--dump-logits", str(dump), *token_args(PROMPTS))
    assert lines_of(result) == expected
    if dtype == torch.float32:
        check_against_python(model, directory, PROMPTS, expected, dump)
    else:  # the same kernels in the same dtype: the prompts' logits agree to the dtype's rounding
        dumped = load_file(str(dump))
        with torch.no_grad():
            reference = model(dumped["prompt_tokens"], dumped["prompt_mask"])
        scale = float(reference.abs().max())
        torch.testing.assert_close(dumped["forward_logits"], reference, atol=0.02 * scale, rtol=0)


def test_seeded_top_k_equals_python(tmp_path: Path) -> None:
    directory = save_hf("llama", tmp_path, seed=3)
    model = from_huggingface(directory).eval()
    for seed, k in [(0, 5), (11, 40)]:
        expected = model.generate(PROMPTS, 8, top_k=k, generator=torch.Generator().manual_seed(seed))
        result = run("--model", str(directory), "--max-new-tokens", "8", "--top-k", str(k), "--seed", str(seed),
                     *token_args(PROMPTS))
        assert lines_of(result) == expected


def test_logits_equal_transformers_in_float32(tmp_path: Path) -> None:
    """The C++ forward against transformers' own model on the same directory (not only against Python's GPT)."""
    for kind in ("llama", "mistral"):
        directory = save_hf(kind, tmp_path / kind, seed=4)
        dump = tmp_path / f"{kind}.safetensors"
        run("--model", str(directory), "--max-new-tokens", "1", "--dump-logits", str(dump), "--tokens",
            ",".join(map(str, PROMPTS[0])))
        hf = getattr(transformers, MODEL_CLASSES[kind]).from_pretrained(str(directory)).eval()
        with torch.no_grad():
            expected = hf(torch.tensor([PROMPTS[0]])).logits
        got = load_file(str(dump))["forward_logits"]
        torch.testing.assert_close(got, expected, atol=1e-5 * max(1.0, float(expected.abs().max())), rtol=0)


def test_a_legacy_rope_scaling_replaces_rope_parameters_as_in_transformers(tmp_path: Path) -> None:
    """transformers reads a non-empty rope_scaling in place of rope_parameters (its rope_theta then from the
    top level, else the default): the C++ reader takes the same rope, and refuses one it lacks."""
    directory = save_hf("llama", tmp_path / "hf", seed=5)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    edit_config(directory, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=scaling)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory)).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"  # what the test stands on
    dump = tmp_path / "d.safetensors"
    run("--model", str(directory), "--max-new-tokens", "1", "--dump-logits", str(dump), "--tokens",
        ",".join(map(str, PROMPTS[0])))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[0]])).logits
    torch.testing.assert_close(load_file(str(dump))["forward_logits"], expected,
                               atol=1e-5 * max(1.0, float(expected.abs().max())), rtol=0)
    edit_config(directory, rope_scaling={"rope_type": "yarn", "factor": 2.0})
    expect(directory, "config.json", "rope type 'yarn'")


def test_python_from_huggingface_returns_eval_mode(tmp_path: Path) -> None:
    """As transformers' from_pretrained: GPT-2's dropout (0.1) must not reach generate."""
    assert not from_huggingface(save_hf("gpt2", tmp_path)).training


# ---------------------------------------------------------------------------------------------
# What the reader refuses: exit code 2, naming the option, the file and the tensor


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return save_hf("llama", tmp_path / "hf", sharded=True)


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def expect(directory: Path, *pieces: str) -> None:
    expect_error("--model", str(directory), "--tokens", "1", contains=list(pieces))


@pytest.mark.parametrize("changes,pieces", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, ["rope type 'yarn'"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     ["partial_rotary_factor=0.5"]),
    ({"head_dim": 16}, ["head_dim=16 is not supported"]),
    ({"hidden_act": "gelu"}, ["hidden_act=\"gelu\""]),
    ({"pretraining_tp": 2}, ["pretraining_tp=2"]),
    ({"model_type": "gemma"}, ["model_type \"gemma\" is not supported"]),
    ({"hidden_size": "32"}, ["hidden_size must be an int; got \"32\""]),
    ({"num_attention_heads": None}, ["missing option num_attention_heads"]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, ["layer_types entry \"sliding_attention\""]),
], ids=["rope-yarn", "partial-rotary", "head-dim", "activation", "pretraining-tp", "model-type", "type", "missing",
        "layer-types"])
def test_unsupported_options_are_named(llama_dir: Path, changes: dict, pieces: list[str]) -> None:
    edit_config(llama_dir, **changes)
    expect(llama_dir, "config.json", *pieces)


def test_config_values_read_as_python_reads_them(tmp_path: Path) -> None:
    """Whole numbers written as floats and num_key_value_heads 0 (multi-head), as convert_llama.py reads them."""
    config = hf_config("mistral")
    config.num_key_value_heads = config.num_attention_heads
    torch.manual_seed(2)
    transformers.MistralForCausalLM(config).save_pretrained(str(tmp_path))
    edit_config(tmp_path, num_key_value_heads=0, hidden_size=32.0, sliding_window=5.0)
    model = from_huggingface(tmp_path).eval()
    assert model.config.kv_heads == 4 and model.config.dim == 32 and model.config.sliding_window == 5
    assert lines_of(run("--model", str(tmp_path), "--max-new-tokens", "4", *token_args(PROMPTS))) == \
        model.generate(PROMPTS, 4)
    edit_config(tmp_path, hidden_size=32.5)
    expect(tmp_path, "hidden_size must be an int; got 32.5")


def test_qwen2_windows_and_gpt2_options_are_named(tmp_path: Path) -> None:
    qwen = save_hf("qwen2", tmp_path / "qwen")
    edit_config(qwen, use_sliding_window=True, max_window_layers=1, sliding_window=4)
    expect(qwen, "use_sliding_window=true is not supported for Qwen2")
    gpt2 = save_hf("gpt2", tmp_path / "gpt2")
    edit_config(gpt2, scale_attn_by_inverse_layer_idx=True)
    expect(gpt2, "scale_attn_by_inverse_layer_idx=true is not supported")
    edit_config(gpt2, scale_attn_by_inverse_layer_idx=False, activation_function="relu")
    expect(gpt2, "activation_function=\"relu\"")


def shard_of(directory: Path, name: str) -> Path:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def rewrite(path: Path, change) -> None:
    """path's tensors after change(dict) (in place)."""
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_shard_and_index_errors(llama_dir: Path) -> None:
    index_path = llama_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = shard_of(llama_dir, name)

    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], name: "../elsewhere.safetensors"}}))
    expect(llama_dir, "model.safetensors.index.json", f"weight_map['{name}'] must be a file name beside the index")
    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], name: "gone.safetensors"}}))
    expect(llama_dir, "gone.safetensors", "not found")
    index_path.write_text(json.dumps({**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}))
    expect(llama_dir, shard.name, f"tensor '{name}' is not listed for this shard")
    index_path.write_text(json.dumps(index))

    original = load_file(str(shard))
    rewrite(shard, lambda t: t.pop(name))
    expect(llama_dir, f"tensor '{name}' is listed in {shard.name} but that shard lacks it")
    save_file(original, str(shard))

    rewrite(shard, lambda t: t.update({name: t[name][:4].contiguous()}))
    expect(llama_dir, f"tensor '{name}' has shape (4, 32); the model", "expects (16, 32)")
    save_file(original, str(shard))

    # Mixed floating dtypes: a float32 model, as Python's from_huggingface builds it.
    rewrite(shard, lambda t: t.update({name: t[name].bfloat16()}))
    mixed = from_huggingface(llama_dir)
    assert mixed.tok.weight.dtype == torch.float32
    assert lines_of(run("--model", str(llama_dir), "--max-new-tokens", "5", *token_args(PROMPTS))) == \
        mixed.generate(PROMPTS, 5)
    rewrite(shard, lambda t: t.update({name: t[name].to(torch.int32)}))
    expect(llama_dir, f"tensor '{name}' has dtype I32; expected a floating dtype")
    save_file(original, str(shard))

    extra = "model.layers.1.self_attn.extra.weight"
    rewrite(shard, lambda t: t.update({extra: torch.zeros(2)}))
    expect(llama_dir, shard.name, f"tensor '{extra}' is not listed for this shard")
    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], extra: shard.name}}))
    expect(llama_dir, f"unexpected tensor(s) ['{extra}']")
    save_file(original, str(shard))
    index_path.write_text(json.dumps(index))
    assert lines_of(run("--model", str(llama_dir), "--tokens", "1", "--max-new-tokens", "2"))


def test_missing_tensors_and_oversized_configs(tmp_path: Path) -> None:
    directory = save_hf("llama", tmp_path / "hf")
    rewrite(directory / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    expect(directory, "missing tensor(s) ['lm_head.weight']")
    # A config claiming far more than the file holds is refused from the headers, before any allocation.
    edit_config(directory, num_hidden_layers=10**6, tie_word_embeddings=True)
    expect(directory, "describes a model of", "missing tensor(s) ['model.layers.2.input_layernorm.weight'")
    edit_config(directory, num_hidden_layers=2, hidden_size=2**40, num_attention_heads=2**20, intermediate_size=2**40,
                head_dim=None)
    expect(directory, "config.json describes tensors too large to address (tensor 'attn.qkv.weight')")


def test_tied_heads_must_equal_the_embedding(tmp_path: Path) -> None:
    directory = save_hf("gpt2", tmp_path / "hf")
    rewrite(directory / "model.safetensors",
            lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}))
    expect(directory, "'lm_head.weight' differs from the token embedding (transformer.wte.weight)")


def test_pickle_checkpoints_are_named(tmp_path: Path) -> None:
    directory = save_hf("gpt2", tmp_path / "hf")
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    expect(directory, "no model.safetensors", "pytorch_model.bin is not read")


def test_old_gpt2_mask_buffers_are_checked(tmp_path: Path) -> None:
    """Older GPT-2 checkpoints store attn.bias (the causal mask): read when causal, refused otherwise."""
    directory = save_hf("gpt2", tmp_path / "hf")
    causal = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    rewrite(directory / "model.safetensors",
            lambda t: t.update({"transformer.h.0.attn.bias": causal.clone(), "transformer.h.0.attn.masked_bias":
                                torch.tensor(-1e4)}))
    model = from_huggingface(directory).eval()
    assert lines_of(run("--model", str(directory), "--max-new-tokens", "4", *token_args(PROMPTS))) == \
        model.generate(PROMPTS, 4)
    rewrite(directory / "model.safetensors", lambda t: t.update({"transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64,
                                                                                                        dtype=torch.bool)}))
    expect(directory, "'transformer.h.0.attn.bias' is not the causal mask")


def test_our_directories_still_load(tmp_path: Path) -> None:
    """GPT.save's files keep their reader: a model converted from transformers and saved reads as the original."""
    directory = save_hf("qwen2", tmp_path / "hf")
    model = from_huggingface(directory).eval()
    model.save(tmp_path / "ours")
    assert isinstance(model, GPT)
    ours = lines_of(run("--model", str(tmp_path / "ours"), "--max-new-tokens", "6", *token_args(PROMPTS)))
    theirs = lines_of(run("--model", str(directory), "--max-new-tokens", "6", *token_args(PROMPTS)))
    assert ours == theirs == model.generate(PROMPTS, 6)
