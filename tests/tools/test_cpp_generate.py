"""causal-attention-generate (the C++ GPT, csrc/gpt.cpp) against Python's GPT on the same files.

The program loads what GPT.save / the demo wrote; its greedy tokens must equal GPT.generate's
exactly (a ragged batch), its logits (the full forward of the prompts and every generation step)
Python's to float32 rounding, and corrupt or mismatched files must give exit code 2 with the
tensor named on stderr.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from causal_attention.tools import demo
from causal_attention.models import GPT, GPTConfig
from models.checkpoint_cases import CASES, write

PROGRAM = "causal-attention-generate"
TOL = 1e-5  # float32 logits, relative to their scale (max |logit|, at least 1)


def program() -> str:
    """The installed program: next to this Python (the venv's bin/, where the wheel puts it), else on PATH."""
    beside = Path(sys.executable).parent / PROGRAM
    if beside.is_file():
        return str(beside)
    found = shutil.which(PROGRAM)
    assert found is not None, f"{PROGRAM} is not installed (make install builds it with the package)"
    return found


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([program(), *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def randomized(model: GPT, scale: float = 0.2, seed: int = 0) -> GPT:
    """Every parameter random (LayerNorm weights around 1, biases too), in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if p.dim() == 1 and name.endswith(".weight") else 0.0  # LayerNorm weights
            p.copy_(base + torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def answer_text(tokens: list[int]) -> str:
    """The demo's answer as the program prints it: the digits before EOS."""
    return "".join(str(t) for t in (tokens[: tokens.index(demo.EOS)] if demo.EOS in tokens else tokens) if t < 10)


def python_step_logits(model: GPT, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, (steps, V): the full forward's logits at the last position of prompt + answer[:s]."""
    out = []
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers):
            seq = torch.tensor([prompt + answer])
            logits = model(seq)[0]  # (n, V)
            out.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)])
    return out


def check_against_python(model: GPT, directory: Path, prompts: list[list[int]], answers: list[list[int]],
                         dump: Path) -> None:
    """The dumped logits against Python: the padded prompts' forward and every generation step."""
    dumped = load_file(str(dump))
    tokens, mask = dumped["prompt_tokens"], dumped["prompt_mask"]
    assert [row[m].tolist() for row, m in zip(tokens, mask)] == prompts
    with torch.no_grad():
        expected = model(tokens, mask)  # (B, T, V), zeros at padding
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(dumped["forward_logits"], expected, atol=TOL * scale, rtol=0)
    steps = dumped["step_logits"]  # (B, S, V)
    for b, ref in enumerate(python_step_logits(model, prompts, answers)):
        torch.testing.assert_close(steps[b, : len(ref)], ref, atol=TOL * scale, rtol=0)
    generated = [[t for t in row.tolist() if t >= 0] for row in dumped["generated"]]
    assert generated == answers


# ---------------------------------------------------------------------------------------------
# The demo's model: --prompt through tokenizer.json


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Path]:
    torch.manual_seed(0)
    model = randomized(GPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN)), scale=0.3, seed=1)
    directory = tmp_path_factory.mktemp("demo")
    demo.save_model(model, directory)
    return model, directory


def test_demo_files_include_the_tokenizer(demo_dir: tuple[GPT, Path]) -> None:
    _, directory = demo_dir
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    prompt, _ = demo.make_problem(random.Random(4))
    digits = [tokenizer["vocab"][str(d)] for d in prompt[1:-1]]
    assert [tokenizer["bos_id"], *digits, tokenizer["sep_id"]] == prompt


def test_demo_prompts_equal_python_generate(demo_dir: tuple[GPT, Path], tmp_path: Path) -> None:
    model, directory = demo_dir
    texts = ["0123456789", "42", "7", "998877665544"]
    prompts = [[demo.BOS, *map(int, t), demo.SEP] for t in texts]
    expected = model.generate(prompts, demo.MAX_DIGITS + 1, eos_id=demo.EOS, pad_id=demo.EOS)
    args = ["--model", str(directory), "--max-new-tokens", str(demo.MAX_DIGITS + 1), "--dump-logits", str(tmp_path / "d.safetensors")]
    for text in texts:
        args += ["--prompt", text]
    assert run(*args).stdout.splitlines() == [answer_text(a) for a in expected]
    dumped = load_file(str(tmp_path / "d.safetensors"))
    generated = [[t for t in row.tolist() if t >= 0] for row in dumped["generated"]]
    assert generated == expected  # the exact tokens, EOS included
    check_against_python(model, directory, prompts, expected, tmp_path / "d.safetensors")


def test_a_trained_demo_model_reverses(tmp_path: Path) -> None:
    """Briefly trained (the demo's own training loop), the C++ program answers as Python does."""
    from rich.console import Console

    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        demo.train(model, steps=40, seed=2, console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)
    model.eval()
    demo.save_model(model, tmp_path)
    texts = ["31", "2718", "14142"]
    expected = model.generate([[demo.BOS, *map(int, t), demo.SEP] for t in texts], demo.MAX_DIGITS + 1,
                              eos_id=demo.EOS, pad_id=demo.EOS)
    out = run("--model", str(tmp_path), *sum((["--prompt", t] for t in texts), []), "--max-new-tokens", "13")
    assert out.stdout.splitlines() == [answer_text(a) for a in expected]


# ---------------------------------------------------------------------------------------------
# Other models: --tokens


def gpt2_shaped() -> GPT:
    """GPT-2's architecture (tanh GELU, biases, tied head, dropout in the config), small."""
    config = GPTConfig.gpt2(vocab_size=500, max_len=64, dim=128, n_layers=2, n_heads=4)
    return randomized(GPT(config), scale=0.1, seed=3)


def nobias_untied() -> GPT:
    config = GPTConfig(vocab_size=50, max_len=32, dim=32, n_layers=2, n_heads=4, mlp_hidden=48,
                       bias=False, tie_head=False, layer_norm_eps=1e-6)
    return randomized(GPT(config), scale=0.3, seed=4)


def silu_mlp() -> GPT:
    config = GPTConfig(vocab_size=60, max_len=32, dim=32, n_layers=2, n_heads=2, activation="silu")
    return randomized(GPT(config), scale=0.3, seed=5)


@pytest.mark.parametrize("make", [gpt2_shaped, nobias_untied, silu_mlp], ids=["gpt2-shaped", "nobias-untied", "silu"])
def test_token_prompts_equal_python_generate(make, tmp_path: Path) -> None:
    model = make()
    model.save(tmp_path / "model")
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (7, 1, 12, 3)]
    expected = model.generate(prompts, 10)
    args = ["--model", str(tmp_path / "model"), "--max-new-tokens", "10", "--dump-logits", str(tmp_path / "d.safetensors")]
    for p in prompts:
        args += ["--tokens", ",".join(map(str, p))]
    lines = run(*args).stdout.splitlines()
    assert [[int(t) for t in line.split(",")] for line in lines] == expected
    check_against_python(model, tmp_path / "model", prompts, expected, tmp_path / "d.safetensors")

    # An eos id stops each sequence after it, as in Python.
    eos = expected[0][3]
    stopped = model.generate(prompts, 10, eos_id=eos)
    lines = run(*args[:4], "--eos", str(eos), *args[6:]).stdout.splitlines()
    assert [[int(t) for t in line.split(",")] for line in lines] == stopped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_models_choose_from_float32_logits_as_python(dtype: torch.dtype, tmp_path: Path) -> None:
    """A bfloat16/half model: by default the program's steps choose from the head's float32 sums,
    as GPT.generate's do (the same tokens; step logits float32), and with --rounded-logits from the
    model's dtype, as generate(float32_logits=False)."""
    model = gpt2_shaped().to(dtype)
    model.save(tmp_path / "model")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (7, 1, 12, 3)]
    args = ["--model", str(tmp_path / "model"), "--max-new-tokens", "10", "--dump-logits", str(tmp_path / "d.safetensors")]
    args += sum((["--tokens", ",".join(map(str, p))] for p in prompts), [])
    for extra, float32 in (([], True), (["--rounded-logits"], False)):
        lines = run(*args, *extra).stdout.splitlines()
        assert [[int(t) for t in line.split(",")] for line in lines] == model.generate(prompts, 10,
                                                                                       float32_logits=float32)
        steps = load_file(str(tmp_path / "d.safetensors"))["step_logits"]
        assert steps.dtype == (torch.float32 if float32 else dtype)


def test_top_k_sampling_with_a_seed_equals_python(tmp_path: Path) -> None:
    """torch.multinomial with a generator seeded alike draws the same tokens in C++ and Python."""
    model = gpt2_shaped()
    model.save(tmp_path)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    # manual_seed's whole range: past 2^63, and negative (two's complement)
    for seed, k, temperature in [(0, 5, 1.0), (123, 50, 0.7), (2**63 + 5, 5, 1.0), (2**64 - 1, 5, 1.0), (-2, 5, 1.0)]:
        expected = model.generate(prompts, 8, top_k=k, temperature=temperature,
                                  generator=torch.Generator().manual_seed(seed))
        out = run("--model", str(tmp_path), "--max-new-tokens", "8", "--top-k", str(k), "--temperature", str(temperature),
                  f"--seed={seed}", *sum((["--tokens", ",".join(map(str, p))] for p in prompts), []))
        assert [[int(t) for t in line.split(",")] for line in out.stdout.splitlines()] == expected


def test_bench_prints_tokens_per_second(demo_dir: tuple[GPT, Path]) -> None:
    _, directory = demo_dir
    out = run("--model", str(directory), "--prompt", "12345", "--bench", "--bench-runs", "2").stdout
    assert "tokens/s" in out.splitlines()[-2] and "best of 2 runs" in out
    out = run("--model", str(directory), "--prompt", "12345", "--bench", "--bench-runs", "1", "--threads", "1",
              "--max-new-tokens", "6", "--no-eos").stdout
    assert out.splitlines()[-2].endswith(" tokens/s (1 thread)") and "best of 1 run:" in out
    # The prompt (BOS, 5 digits, SEP) prefilled, then 5 decode steps after the first token.
    assert re.fullmatch(r"bench: prefill 7 tokens: [0-9.]+ tokens/s; decode 5 tokens: [0-9.]+ tokens/s",
                        out.splitlines()[-1]), out


def with_tokenizer(model: GPT, directory: Path, **ids: int) -> Path:
    """The demo's files with tokenizer.json's ids changed."""
    demo.save_model(model, directory)
    (directory / "tokenizer.json").write_text(json.dumps({**demo.tokenizer_json(), **ids}))
    return directory


def test_token_prompts_stop_at_the_tokenizers_eos(demo_dir: tuple[GPT, Path], tmp_path: Path) -> None:
    """--eos defaults to tokenizer.json's eos_id for --tokens as for --prompt."""
    model, _ = demo_dir
    prompt = [demo.BOS, 5, demo.SEP]
    eos = model.generate([prompt], 1)[0][0]  # the model's first token: generation stops there
    directory = with_tokenizer(model, tmp_path, eos_id=eos)
    expected = model.generate([prompt], 13, eos_id=eos)[0]
    assert expected == [eos]
    out = run("--model", str(directory), "--tokens", ",".join(map(str, prompt)), "--max-new-tokens", "13").stdout
    assert out.splitlines() == [",".join(map(str, expected))]


def test_rows_follow_the_command_line_order(demo_dir: tuple[GPT, Path]) -> None:
    model, directory = demo_dir
    prompts = [[1, 2], [demo.BOS, 1, 2, demo.SEP], [3]]
    expected = model.generate(prompts, 5, eos_id=demo.EOS)
    out = run("--model", str(directory), "--tokens", "1,2", "--prompt", "12", "--tokens", "3", "--max-new-tokens", "5")
    assert out.stdout.splitlines() == [",".join(map(str, expected[0])), answer_text(expected[1]),
                                       ",".join(map(str, expected[2]))]


def test_a_prompt_of_max_len_tokens_gets_one_token(saved: Path) -> None:
    """The logits at the prompt's last position need no new position (as GPT.generate); the
    default --max-new-tokens is what fits: max_len - prompt + 1, at most 32."""
    model = GPT.load(saved)
    full = [(7 * i) % 40 for i in range(32)]
    for prompt in (full, full[:20]):
        expected = model.generate([prompt], 32 - len(prompt) + 1)
        out = run("--model", str(saved), "--tokens", ",".join(map(str, prompt))).stdout
        assert [[int(t) for t in line.split(",")] for line in out.splitlines()] == expected
    assert len(expected[0]) == 13


def test_help_shows_the_defaults() -> None:
    out = run("--help").stdout
    assert "--bench-runs INT:POSITIVE=3" in out and "--temperature FLOAT=1" in out, out  # CLI11's OPTION TYPE=DEFAULT


# ---------------------------------------------------------------------------------------------
# Errors: exit code 2, the message on stderr, never a crash


def expect_error(*args: str, contains: list[str]) -> None:
    result = run(*args, check=False)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    for piece in contains:
        assert piece in result.stderr, result.stderr


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    config = GPTConfig(vocab_size=40, max_len=32, dim=32, n_layers=2, n_heads=4)
    randomized(GPT(config), seed=6).save(tmp_path)
    return tmp_path


def test_corrupt_files_exit_2_naming_the_tensor(saved: Path) -> None:
    weights = saved / "model.safetensors"
    good = load_file(str(weights))
    tokens = ["--tokens", "1,2,3"]

    save_file({**good, "blocks.1.mlp.0.weight": good["blocks.1.mlp.0.weight"][:64].contiguous()}, str(weights))
    expect_error("--model", str(saved), *tokens, contains=["'blocks.1.mlp.0.weight'", "shape (64, 32)"])
    save_file({**good, "ln_f.bias": good["ln_f.bias"].double()}, str(weights))
    expect_error("--model", str(saved), *tokens, contains=["'ln_f.bias'", "F64"])
    save_file({k: v for k, v in good.items() if k != "blocks.0.attn.proj.weight"}, str(weights))
    expect_error("--model", str(saved), *tokens, contains=["missing", "'blocks.0.attn.proj.weight'"])
    save_file({**good, "head.weight": good["tok.weight"].clone()}, str(weights))
    expect_error("--model", str(saved), *tokens, contains=["unexpected", "'head.weight'"])

    save_file(good, str(weights))
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])  # truncated
    expect_error("--model", str(saved), *tokens, contains=["model.safetensors", "outside the data section"])
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["pos.weight"]["shape"] = [33, 32]  # the header lies about a size
    text = json.dumps(header).encode()
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    expect_error("--model", str(saved), *tokens, contains=["'pos.weight'", "needs"])
    weights.write_bytes((1 << 60).to_bytes(8, "little") + data[8:])  # header size huge
    expect_error("--model", str(saved), *tokens, contains=["header size", "above the limit"])
    weights.write_bytes(data[:8] + b"{not json" + data[17:])
    expect_error("--model", str(saved), *tokens, contains=["not well-formed JSON"])


def test_mismatched_config_exits_2(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "dim": 64}))
    expect_error("--model", str(saved), "--tokens", "1", contains=["'tok.weight'", "expects (40, 64)"])
    (saved / "config.json").write_text(json.dumps({**config, "n_experts": 2}))
    expect_error("--model", str(saved), "--tokens", "1", contains=["unknown option(s) ['n_experts']"])


def llama_family(kind: str) -> GPT:
    """A Llama-family GPT as from_huggingface builds it: GQA with Llama 3's rope scaling and an untied
    head; q/k/v biases only with a tied head (Qwen2); every projection biased with multi-head (Llama)."""
    common = dict(vocab_size=70, max_len=48, dim=32, n_layers=2, n_heads=4, mlp_hidden=40, norm="rmsnorm",
                  gated_mlp=True, activation="silu", positions="rope", bias=False, layer_norm_eps=1e-6)
    options = {
        "gqa-llama3": dict(n_kv_heads=2, tie_head=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}),
        "qwen2": dict(n_kv_heads=1, qkv_bias=True, rope_theta=1e6),
        "all-biases": dict(qkv_bias=True, proj_bias=True, mlp_bias=True, tie_head=False),
        "mistral": dict(n_kv_heads=2, tie_head=False, sliding_window=5),
    }[kind]
    return randomized(GPT(GPTConfig(**common, **options)), scale=0.2, seed=7)


@pytest.mark.parametrize("kind", ["gqa-llama3", "qwen2", "all-biases", "mistral"])
def test_llama_family_models_equal_python_generate(kind: str, tmp_path: Path) -> None:
    """RMSNorm, SwiGLU, rotary positions (the cache holding rotated keys), grouped-query attention,
    per-projection biases and Mistral's sliding window (prompts and answers longer than it) in the C++
    GPT: Python's tokens exactly, its logits to float32 rounding."""
    model = llama_family(kind)  # (randomized: RMSNorm weights around 1)
    model.save(tmp_path / "model")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 70, (n,), generator=gen).tolist() for n in (7, 1, 12, 3)]
    expected = model.generate(prompts, 10)
    args = ["--model", str(tmp_path / "model"), "--max-new-tokens", "10", "--dump-logits", str(tmp_path / "d.safetensors")]
    args += sum((["--tokens", ",".join(map(str, p))] for p in prompts), [])
    lines = run(*args).stdout.splitlines()
    assert [[int(t) for t in line.split(",")] for line in lines] == expected
    check_against_python(model, tmp_path / "model", prompts, expected, tmp_path / "d.safetensors")


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_checkpoint_corpus(tmp_path: Path, case: dict) -> None:
    """The program on the corpus GPT.load and load_gpt are held to (tests/data/checkpoint_cases.json):
    a refused directory exits 2 with the error's pieces on stderr; an accepted one generates, with
    the warning's pieces on stderr (or nothing there)."""
    write(case, tmp_path)
    result = run("--model", str(tmp_path), "--tokens", "1,2", "--max-new-tokens", "2", check=False)
    if "error" in case:
        assert result.returncode == 2, (result.returncode, result.stderr)
        for piece in case["error"]:
            assert piece in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1
    if case["warning"]:
        assert len(result.stderr.splitlines()) == 1, result.stderr
        for piece in case["warning"]:
            assert piece in result.stderr, result.stderr
    else:
        assert result.stderr == ""


@pytest.mark.parametrize(
    "args, contains",
    [
        ([], ["--model"]),
        (["--model", "{dir}"], ["--prompt or --tokens"]),
        (["--model", "{dir}", "--tokens", "1,x"], ["--tokens", "1,x"]),
        (["--model", "{dir}", "--tokens", "1,40"], ["--tokens: id 40 (input 1) is outside the model's vocabulary 0..39"]),
        (["--model", "{dir}", "--tokens", "1", "--tokens", "39,40"], ["--tokens: id 40 (input 2)"]),
        (["--model", "{dir}", "--tokens", "1", "--eos", "40"], ["--eos: 40 is outside the model's vocabulary 0..39"]),
        (["--model", "{dir}", "--tokens", "1", "--eos=-1"], ["--eos: -1 is outside the model's vocabulary 0..39"]),
        (["--model", "{dir}", "--tokens", "1", "--eos", "3", "--no-eos"], ["--eos excludes --no-eos"]),
        (["--model", "{dir}", "--tokens", "1", "--seed", str(2**64)],
         ["--seed: expected an integer in -9223372036854775808..18446744073709551615", str(2**64)]),
        (["--model", "{dir}", "--tokens", "1", "--seed=-9223372036854775809"], ["--seed: expected an integer"]),
        (["--model", "{dir}", "--tokens", "1", "--seed", "1e5"], ["--seed: expected an integer", "'1e5'"]),
        (["--model", "{dir}", "--tokens", "1", "--dump-logits", "{dir}/nowhere/d.safetensors"],
         ["--dump-logits: cannot write", "(no such directory)"]),
        (["--model", "{dir}", "--tokens", "1", "--dump-logits", "{dir}"], ["--dump-logits: cannot write", "(a directory)"]),
        (["--model", "{dir}", "--tokens", "1", "--max-new-tokens", "40"], ["exceeds max_len=32"]),
        (["--model", "{dir}", "--tokens", "1", "--top-k", "0"], ["top_k"]),
        (["--model", "{dir}", "--tokens", "1", "--temperature", "0", "--top-k", "3"],
         ["temperature must be positive; got 0"]),
        (["--model", "{dir}", "--tokens", "1,2,"], ["--tokens: expected comma-separated", "'1,2,'"]),
        (["--model", "{dir}", "--tokens", ",1"], ["--tokens: expected comma-separated", "',1'"]),
        (["--model", "{dir}", "--tokens", "1", "--tokens", ""], ["--tokens: empty token list"]),
        (["--model", "{dir}", "--tokens", "1", "--bench", "--bench-runs", "0"],
         ["--bench-runs", "expected a positive integer; got '0'"]),
        (["--model", "{dir}", "--tokens", "1", "--threads", "0"], ["--threads", "expected a positive integer; got '0'"]),
        (["--model", "{dir}", "--tokens", "1," * 32 + "1"], ["- 1 = 33 positions exceeds max_len=32"]),
        (["--model", "{dir}", "--prompt", "12"], ["tokenizer.json"]),
        (["--model", "{dir}/nowhere", "--tokens", "1"], ["config.json not found"]),
        (["--model", "{dir}", "--tokens", "1", "--max-new-tokens", "many"], ["--max-new-tokens"]),
    ],
)
def test_bad_arguments_exit_2(saved: Path, args: list[str], contains: list[str]) -> None:
    expect_error(*[a.replace("{dir}", str(saved)) for a in args], contains=contains)


def test_prompt_errors_name_the_character_and_the_file(demo_dir: tuple[GPT, Path], tmp_path: Path) -> None:
    model, directory = demo_dir
    expect_error("--model", str(directory), "--prompt", "1é2", contains=["--prompt: character 'é' is not in the "])
    bad = with_tokenizer(model, tmp_path / "a", eos_id=13)
    expect_error("--model", str(bad), "--prompt", "12",
                 contains=["tokenizer.json: eos_id = 13 is outside the model's vocabulary 0..12 (config.json vocab_size=13)"])
    bad = with_tokenizer(model, tmp_path / "b", vocab={"0": 0, "1": 99})
    expect_error("--model", str(bad), "--tokens", "1",
                 contains=["tokenizer.json: vocab['1'] = 99 is outside the model's vocabulary 0..12"])


def test_help_exits_0() -> None:
    out = run("--help").stdout
    assert "--tokens" in out and "--top-k" in out and "--dump-logits" in out
