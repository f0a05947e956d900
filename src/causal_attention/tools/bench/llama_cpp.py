"""causal-attention-generate against llama.cpp on the same weights (not part of `make test`).

Reproducible from nothing but PyPI: llama.cpp is built from the llama-cpp-python source
distribution (which vendors it; `pip download --no-binary`), a model of random weights is saved by
transformers and converted with llama.cpp's own convert_hf_to_gguf.py into float32, float16 and
bfloat16. The model (--model): a Llama-shaped one (with a small SentencePiece tokenizer so that
llama.cpp's converter takes it), or GPT-2 124M (with a small byte-level BPE tokenizer of GPT-2's
pre-tokenizer, named to the converter as "gpt-2": it recognises a tokenizer by the ids it gives a
test text, which only GPT-2's own vocabulary reproduces). Then, per dtype, on the same thread count:

- batch 1: prefill of 512 tokens, then 128 decode steps;
- batch 4: four prompts of 512 tokens prefilled together, then 128 steps each;

llama.cpp by llama-batched-bench (S_PP and S_TG: tokens over the prefill's and the steps' time),
ours by the program's --bench on the transformers directory as it is (the prefill up to the first
chosen token, then the steps). Each side: the best of `runs`, run alternately. x = ours / llama.cpp
tokens/s (above 1: ours is faster). The engine's and llama.cpp's instruction sets are printed.
--isa avx2 holds both sides to AVX2 on a CPU with more (llama.cpp built with GGML_NATIVE=OFF, whose
defaults are AVX2 + FMA + F16C without AVX-512; ours under ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2), as an AVX2-only CPU would run them.

    python -m causal_attention bench-llama-cpp --work /tmp/llama_cpp_bench --out bench_out [--model gpt2] [--isa avx2]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built
# A Llama-shaped ~1B-class layer, 4 layers deep (fits a laptop's memory in float32).
FULL = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=4,
            intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, prefill=512, decode=128)
QUICK = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=512, vocab_size=1000, max_position_embeddings=512, prefill=64, decode=16)
# GPT-2 124M (transformers' GPT2Config names), the model of the issue-37 comparison.
GPT2_FULL = dict(n_embd=768, n_head=12, n_layer=12, vocab_size=50257, n_positions=1024, prefill=512, decode=128)
GPT2_QUICK = dict(n_embd=64, n_head=4, n_layer=2, vocab_size=1000, n_positions=256, prefill=64, decode=16)
MODELS = {"llama": (FULL, QUICK), "gpt2": (GPT2_FULL, GPT2_QUICK)}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# The environment that holds the engine, oneDNN and MKL to AVX2 (--isa avx2), and llama.cpp's build options.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
LLAMA_CPP_ISA = {"native": ("build", ["-DGGML_NATIVE=ON"]), "avx2": ("build-avx2", ["-DGGML_NATIVE=OFF"])}
_RUN_ONLY = ("prefill", "decode")  # shape entries that are not the model's configuration


@dataclass
class Row:
    dtype: str
    batch: int
    phase: str  # prefill or decode
    ours: float  # tokens/s
    llama_cpp: float

    @property
    def ratio(self) -> float:
        return self.ours / self.llama_cpp


def _run(cmd: list, say: Callable[[str], None], **kwargs) -> subprocess.CompletedProcess[str]:
    shown = " ".join(str(c) for c in cmd)
    say("$ " + (shown if len(shown) < 300 else shown[:300] + " ..."))
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def build_llama_cpp(work: Path, say: Callable[[str], None], isa: str = "native") -> Path:
    """llama-batched-bench from the llama-cpp-python sdist (downloaded once into work), built for isa (a build
    folder each): its bin/ folder."""
    source = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    folder, options = LLAMA_CPP_ISA[isa]
    binary = source / folder / "bin" / "llama-batched-bench"
    if binary.is_file():
        return binary.parent
    archive = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", work,
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], say)
    if not source.is_dir():
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
    ninja = shutil.which("ninja", path=str(Path(sys.executable).parent)) or shutil.which("ninja")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    _run(["cmake", "-S", source, "-B", source / folder, *generator, "-DCMAKE_BUILD_TYPE=Release", *options,
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=OFF"], say)
    say(f"building llama.cpp for {isa} (minutes on 2 cores)")
    _run(["cmake", "--build", source / folder, "--target", "llama-batched-bench", "-j", str(os.cpu_count() or 2)], say)
    return binary.parent


def save_model(model: str, shape: dict, directory: Path, dtype: torch.dtype, say: Callable[[str], None]) -> Path:
    """A LlamaForCausalLM or GPT2LMHeadModel of random weights in dtype, saved by transformers, with a small
    tokenizer of its kind (llama.cpp's converter reads the vocabulary from it, padded to vocab_size)."""
    done = directory / "tokenizer.model" if model == "llama" else directory / "tokenizer.json"
    if (directory / "config.json").is_file() and done.is_file():
        return directory
    import transformers

    options = {k: v for k, v in shape.items() if k not in _RUN_ONLY}
    torch.manual_seed(0)
    if model == "llama":
        config = transformers.LlamaConfig(**options, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                          tie_word_embeddings=False)
        say(f"saving a {dtype} Llama ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}) to {directory}")
        net = transformers.LlamaForCausalLM(config)
    else:
        # n_ctx: GPT-2's own config.json carries it, and llama.cpp's converter reads it
        config = transformers.GPT2Config(**options, n_ctx=options["n_positions"], bos_token_id=None, eos_token_id=None)
        say(f"saving a {dtype} GPT-2 ({shape['n_layer']} layers, hidden {shape['n_embd']}) to {directory}")
        net = transformers.GPT2LMHeadModel(config)
    net = net.to(dtype)
    net.generation_config.eos_token_id = None  # generation runs its full length on both sides
    net.save_pretrained(str(directory))
    (_sentencepiece_tokenizer if model == "llama" else _byte_level_tokenizer)(directory)
    return directory


def _corpus() -> list[str]:
    words = ("the of and to in is that it was for on are as with his they at be this from have or by one had not but "
             "what all were when we there can an your which their said if do will each about how up out them then").split()
    gen = torch.Generator().manual_seed(0)
    return [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=gen)) for _ in range(2000)]


def _sentencepiece_tokenizer(directory: Path) -> None:
    import sentencepiece

    text = directory / "spm_corpus.txt"
    text.write_text("\n".join(_corpus()))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(directory / "tokenizer"),
                                             vocab_size=150, hard_vocab_limit=False, model_type="bpe",
                                             minloglevel=2)
    (directory / "tokenizer.vocab").unlink()
    text.unlink()


def _byte_level_tokenizer(directory: Path) -> None:
    """GPT-2's kind of tokenizer (byte-level BPE, GPT-2's pre-tokenizer regex), 400 tokens, saved as
    transformers saves one (tokenizer.json and its config)."""
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(str(directory))


# The converter's entry with its pre-tokenizer check answered: the byte-level tokenizer above splits text
# as GPT-2's does, so "gpt-2" is what it is (the check hashes the ids of GPT-2's own vocabulary).
_CONVERT_GPT2 = """import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def convert(model: str, source: Path, hf_dir: Path, outtype: str, gguf: Path, say: Callable[[str], None]) -> Path:
    if not gguf.is_file():
        entry = [source / "convert_hf_to_gguf.py"] if model == "llama" else ["-c", _CONVERT_GPT2, source]
        _run([sys.executable, *entry, hf_dir, "--outfile", gguf, "--outtype", outtype], say)
    return gguf


def llama_cpp_rates(bin_dir: Path, gguf: Path, shape: dict, batch: int, threads: int,
                    say: Callable[[str], None]) -> tuple[float, float]:
    """(prefill, decode) tokens/s of llama-batched-bench: `batch` sequences of `prefill` tokens, then `decode` steps."""
    p, n = shape["prefill"], shape["decode"]
    context = max(4096, -(-batch * (p + n) // 256) * 256)  # a context it skips a configuration for is silent
    cmd = [bin_dir / "llama-batched-bench", "-m", gguf, "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(p),
           "-ntg", str(n), "-npl", str(batch), "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    for _ in range(5):  # its logger writes from a thread of its own and now and then exits before it has
        out = _run(cmd, say)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                return float(row["speed_pp"]), float(row["speed_tg"])
    raise RuntimeError(f"llama-batched-bench printed no result in 5 runs:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


_RATE = re.compile(r"bench: prefill (\d+) tokens: ([0-9.]+) tokens/s; decode (\d+) tokens: ([0-9.]+) tokens/s")


def our_rates(hf_dir: Path, shape: dict, batch: int, threads: int, say: Callable[[str], None],
              env: dict[str, str] | None = None) -> tuple[float, float]:
    """(prefill, decode) tokens/s of causal-attention-generate --bench on the transformers directory, with env
    added to the environment."""
    program = Path(sys.executable).parent / "causal-attention-generate"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shape["vocab_size"], (shape["prefill"],), generator=gen).tolist() for _ in range(batch)]
    tokens = sum((["--tokens", ",".join(map(str, p))] for p in prompts), [])
    # --bench-runs 2: the first generation of a process pays the weights' first touch (page faults), as
    # llama-batched-bench's warm-up does before it times.
    out = _run([program, "--model", hf_dir, "--max-new-tokens", str(shape["decode"] + 1), "--bench", "--bench-runs",
                "2", "--threads", str(threads), *tokens], say, env={**os.environ, **(env or {})})
    found = _RATE.search(out.stdout)
    if found is None:
        raise RuntimeError(f"causal-attention-generate printed no rates:\n{out.stdout[-2000:]}")
    return float(found.group(2)), float(found.group(4))


def engine_isa(env: dict[str, str]) -> str:
    """The engine's instruction set in a process with env added to the environment."""
    code = "import causal_attention, torch; print(torch.ops.causal_attention.cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def main(*, work: Path, out_dir: Path, runs: int, threads: int, quick: bool = False,
         dtypes: tuple[str, ...] = tuple(DTYPES), model: str = "llama", isa: str = "native") -> list[Row]:
    if model not in MODELS:
        raise ValueError(f"bench-llama-cpp: model must be one of {sorted(MODELS)}, got {model!r}")
    if isa not in LLAMA_CPP_ISA:
        raise ValueError(f"bench-llama-cpp: isa must be one of {sorted(LLAMA_CPP_ISA)}, got {isa!r}")
    env = AVX2_ENV if isa == "avx2" else {}
    console = Console(stderr=True)
    say = console.print
    shape = MODELS[model][1 if quick else 0]
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for module in ("sentencepiece", "yaml"):  # llama.cpp's converter and the tokenizer above need them
        try:
            __import__(module)
        except ImportError:
            _run([sys.executable, "-m", "pip", "install", "-q", {"yaml": "pyyaml"}.get(module, module)], say)
    bin_dir = build_llama_cpp(work, say, isa)
    source = bin_dir.parent.parent
    system = subprocess.run([bin_dir / "llama-batched-bench", "--version"], capture_output=True, text=True)
    say(f"llama.cpp {LLAMA_CPP_PYTHON} (llama-cpp-python sdist, {LLAMA_CPP_ISA[isa][1][0]}): "
        f"{(system.stdout + system.stderr).strip()[:200]}")
    ours_isa = engine_isa(env)
    say(f"engine ISA: {ours_isa}{' (' + ' '.join(f'{k}={v}' for k, v in env.items()) + ')' if env else ''}; "
        f"{threads} threads")
    rows: list[Row] = []
    for name in dtypes:
        stem = f"{'' if model == 'llama' else model + '_'}model_{'quick_' if quick else ''}{name}"
        hf_dir = save_model(model, shape, work / stem, DTYPES[name], say)
        gguf = convert(model, source, hf_dir, name, work / f"{stem}.gguf", say)
        for batch in (1, 4):
            best = {"ours": [0.0, 0.0], "llama_cpp": [0.0, 0.0]}
            for _ in range(runs):  # alternately, best of runs
                for side, measure in (("llama_cpp", lambda: llama_cpp_rates(bin_dir, gguf, shape, batch, threads, say)),
                                      ("ours", lambda: our_rates(hf_dir, shape, batch, threads, say, env))):
                    rates = measure()
                    best[side] = [max(a, b) for a, b in zip(best[side], rates)]
            for i, phase in enumerate(("prefill", "decode")):
                rows.append(Row(name, batch, phase, best["ours"][i], best["llama_cpp"][i]))
                r = rows[-1]
                say(f"{name} B={batch} {phase}: ours {r.ours:.1f} tokens/s, llama.cpp {r.llama_cpp:.1f} ({r.ratio:.2f}x)")
    _report(rows, model, shape, threads, out_dir, ours_isa, isa)
    return rows


def _report(rows: list[Row], model: str, shape: dict, threads: int, out_dir: Path, isa: str,
            held: str = "native") -> None:
    from rich.table import Table

    name = {"llama": "Llama-shaped model", "gpt2": "GPT-2"}[model]
    suffix = ("" if model == "llama" else "_" + model) + ("" if held == "native" else "_" + held)
    both = "" if held == "native" else f" (both held to {held.upper()})"
    table = Table(title=f"causal-attention-generate vs llama.cpp, {name}, {threads} threads, engine ISA {isa}{both}, "
                        f"prefill {shape['prefill']} + decode {shape['decode']}")
    for column in ("dtype", "batch", "phase", "ours tokens/s", "llama.cpp tokens/s", "x"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r.dtype, str(r.batch), r.phase, f"{r.ours:.1f}", f"{r.llama_cpp:.1f}", f"{r.ratio:.2f}")
    Console().print(table)
    (out_dir / f"bench_llama_cpp{suffix}.json").write_text(json.dumps(
        {"isa": isa, "held": held, "threads": threads, "model": model, "shape": shape,
         "llama_cpp_python": LLAMA_CPP_PYTHON,
         "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r.dtype}\nB={r.batch}\n{r.phase}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.ours for r in rows], 0.4, label="causal-attention-generate")
    ax.bar([x + 0.2 for x in xs], [r.llama_cpp for r in rows], 0.4, label="llama.cpp")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{name}, {threads} threads, ISA {isa}{both}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / f"bench_llama_cpp{suffix}.png", dpi=120)
