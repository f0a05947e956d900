"""The causal_attention commands: python -m causal_attention {check, bench, bench-transformers,
bench-deploy, bench-half, bench-llama-cpp, demo, convert} (--help after a command for its options)."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Callable, NoReturn

import torch

from . import check as check_mod


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, written as it is typed (lists spaced, shapes with commas);
    left out where the help already says it, for None (the help says what happens) and for switches."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default in (None, argparse.SUPPRESS) or isinstance(default, bool):
            return text
        if isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default)) if action.nargs in ("+", "*") else ",".join(map(str, default))
        else:
            shown = str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _sizes(*names: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type for a comma-separated tuple of positive sizes such as "B,T,dim,H"; the last
    two are (dim, H), and H must divide dim."""

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        try:
            values = tuple(int(p) for p in parts)
        except ValueError:
            values = ()
        if len(values) != len(names) or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected {len(names)} positive integers {','.join(names)}; got {text!r}")
        dim, heads = values[-2:]
        if dim % heads != 0:
            raise argparse.ArgumentTypeError(f"{names[-2]}={dim} is not divisible by {names[-1]}={heads} in {text!r}")
        return values

    parse.__name__ = ",".join(names)
    return parse


def _positive(text: str) -> int:
    """An argparse type: a positive int."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


_Command = Callable[..., argparse.ArgumentParser]


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line and each command's parser (their errors name the command)."""
    parser = argparse.ArgumentParser(prog="python -m causal_attention", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's)")
    # --threads after the command too; SUPPRESS keeps a value given before it when none is given after.
    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", type=_positive, default=argparse.SUPPRESS,
                         help="torch threads (also accepted before the command)")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter,
                                   parents=[threads])

    adders = {"check": _add_check, "bench": _add_bench, "bench-transformers": _add_bench_transformers,
              "bench-deploy": _add_bench_deploy, "bench-half": _add_bench_half,
              "bench-llama-cpp": _add_bench_llama_cpp, "demo": _add_demo, "convert": _add_convert}
    return parser, {name: add(command) for name, add in adders.items()}


def _add_check(command: _Command) -> argparse.ArgumentParser:
    check = command("check", help="error against nn.MultiheadAttention and the reference, and timings; "
                    f"{check_mod.DEFAULT_SHAPES_TIME} (progress is printed as it goes)")
    check.add_argument("--repeats", type=_positive, default=5, help="interleaved timing rounds (median)")
    check.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    check.add_argument("--shapes", type=_sizes("B", "T", "dim", "H"), nargs="+", default=None, metavar="B,T,dim,H",
                       help="shapes to check (default: GPT-2 widths, 4,256,768,12 2,1024,768,12 1,512,1024,16)")
    return check


def _add_bench(command: _Command) -> argparse.ArgumentParser:
    bench = command("bench", help="the kernel and the module against PyTorch's own, with a plot")
    bench.add_argument("--T", type=_positive, nargs="+", default=[256, 512, 1024, 2048, 4096], help="sequence lengths")
    bench.add_argument("--B", type=_positive, default=4, help="batch size of the kernel and module rows")
    bench.add_argument("--H", type=_positive, default=12, help="heads of the kernel and module rows")
    bench.add_argument("--hd", type=_positive, default=64, help="head_dim of the kernel and module rows")
    bench.add_argument("--repeats", type=_positive, default=5, help="interleaved timing rounds (median)")
    bench.add_argument("--json", type=Path, default=Path("bench_out/bench.json"), help="write the report as JSON")
    bench.add_argument("--plot", type=Path, default=Path("bench_out/bench.png"), help="write time-vs-T plot (PNG)")
    bench.add_argument("--no-bf16", dest="bf16", action="store_false",
                       help="skip the bfloat16 kernel and module rows (the generation rows keep theirs)")
    bench.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak memory rows")
    bench.add_argument("--memory-T", type=_positive, nargs="+", default=[4096, 8192],
                       help="sequence lengths of the peak memory rows")
    bench.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward pass only")
    bench.add_argument("--no-decode", dest="decode", action="store_false", help="skip the generation rows")
    bench.add_argument("--no-flex", dest="flex", action="store_false",
                       help="skip compiled FlexAttention (one compile per T, mask and dtype)")
    bench.add_argument("--no-module", dest="module", action="store_false",
                       help="skip the module rows (the whole layer against nn.MultiheadAttention)")
    bench.add_argument("--decode-shape", type=_sizes("B", "ctx", "dim", "H"), default=(8, 2048, 768, 12),
                       metavar="B,ctx,dim,H", help="the decode step's shape; the generation rows use prompts of "
                       "about ctx/2 tokens (default: 8,2048,768,12)")
    return bench


def _add_bench_transformers(command: _Command) -> argparse.ArgumentParser:
    bench_tf = command("bench-transformers",
                       help="GPT and the engine against transformers' GPT-2 on the same weights, with a plot")
    bench_tf.add_argument("--repeats", type=_positive, default=3, help="interleaved timing rounds (median)")
    bench_tf.add_argument("--out", type=Path, default=Path("bench_out"),
                          help="where to write bench_transformers.json and bench_transformers.png")
    bench_tf.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bfloat16 rows")
    bench_tf.add_argument("--no-gpt", dest="gpt", action="store_false",
                          help="skip the GPT-vs-GPT2LMHeadModel rows (keep the engine-inside-transformers rows)")
    bench_tf.add_argument("--quick", action="store_true", help="a tiny model and short sequences (a smoke test)")
    return bench_tf


def _add_bench_deploy(command: _Command) -> argparse.ArgumentParser:
    bench_dep = command("bench-deploy",
                        help="the layer and the GPT in onnxruntime and AOTInductor against eager, with a plot")
    bench_dep.add_argument("--repeats", type=_positive, default=3, help="interleaved timing rounds (median)")
    bench_dep.add_argument("--out", type=Path, default=Path("bench_out"),
                           help="where to write bench_deploy.json and bench_deploy.png")
    bench_dep.add_argument("--peers", nargs="+", choices=("onnxruntime", "onnxruntime-opset23", "aoti"),
                           default=["onnxruntime", "onnxruntime-opset23", "aoti"], help="the peers to time")
    bench_dep.add_argument("--quick", action="store_true", help="tiny models and short sequences (a smoke test)")
    return bench_dep


def _add_bench_half(command: _Command) -> argparse.ArgumentParser:
    bench_half = command("bench-half", help="bfloat16 and float16 against float32 on this CPU (the layer's "
                         "forward+backward, GPT-2's prefill), with the projections' route and a plot")
    bench_half.add_argument("--repeats", type=_positive, default=5, help="interleaved timing rounds (median)")
    bench_half.add_argument("--out", type=Path, default=Path("bench_out"),
                            help="where to write bench_half.json and bench_half.png")
    bench_half.add_argument("--quick", action="store_true", help="a tiny layer and model (a smoke test)")
    return bench_half


def _add_bench_llama_cpp(command: _Command) -> argparse.ArgumentParser:
    bench = command("bench-llama-cpp", help="causal-attention-generate against llama.cpp (built from the "
                    "llama-cpp-python sdist, needs PyPI) on a Llama-shaped model or GPT-2 124M: prefill 512 and decode 128 at "
                    "batch 1 and 4, float32 / float16 / bfloat16, tokens/s and ratios, with a plot")
    bench.add_argument("--work", type=Path, default=Path("bench_out/llama_cpp_work"),
                       help="where llama.cpp is built and the models are kept (reused by later runs)")
    bench.add_argument("--out", type=Path, default=Path("bench_out"),
                       help="where to write bench_llama_cpp.json and bench_llama_cpp.png")
    bench.add_argument("--runs", type=_positive, default=3, help="runs per side, alternately (the best is kept)")
    bench.add_argument("--dtypes", nargs="+", choices=("f32", "f16", "bf16"), default=["f32", "f16", "bf16"])
    bench.add_argument("--model", choices=("llama", "gpt2"), default="llama",
                       help="the weights: a Llama-shaped 311M (hidden 2048, 32/8 heads, 4 layers) or GPT-2 124M")
    bench.add_argument("--isa", choices=("native", "avx2"), default="native",
                       help="both sides on this CPU's widest instructions, or both held to AVX2 (llama.cpp built "
                            "without AVX-512; the engine, oneDNN and MKL capped at AVX2 by their environment)")
    bench.add_argument("--quick", action="store_true", help="a tiny model (a smoke test)")
    return bench


def _add_demo(command: _Command) -> argparse.ArgumentParser:
    demo = command("demo", help="train a tiny GPT on digit reversal, then generate with the KV cache")
    demo.add_argument("--steps", type=_positive, default=1500, help="training steps")
    demo.add_argument("--seed", type=int, default=0, help="same seed, same result")
    demo.add_argument("--out", type=Path, default=Path("demo_out"), help="where to write metrics, plots, model")
    demo.add_argument("--load", type=Path, default=None,
                      help="answer new problems with a model a demo run saved (its --out) instead of training")
    demo.add_argument("--n-eval", type=_positive, default=500, help="problems to answer after training or loading")
    demo.add_argument("--distributed", choices=("ddp", "fsdp", "tp"), default=None,
                      help="train on torchrun's processes (gloo): ddp, fsdp (FSDP2), or tp (tensor parallel by "
                      "heads); e.g. torchrun --nproc-per-node 2 -m causal_attention demo --distributed ddp")
    return demo


def _add_convert(command: _Command) -> argparse.ArgumentParser:
    convert = command("convert", help="convert a GPT checkpoint between transformers, nanoGPT and this project")
    convert.add_argument("--from", dest="source_format", choices=("huggingface", "nanogpt", "ours"), required=True,
                         help="SRC's format: a save_pretrained directory, a nanoGPT ckpt.pt, or a GPT.save directory")
    convert.add_argument("src", type=Path, help="the checkpoint to read")
    convert.add_argument("--out", type=Path, required=True, help="where to write")
    convert.add_argument("--to", dest="target_format", choices=("ours", "huggingface", "nanogpt"), default="ours",
                         help="ours: model.safetensors + config.json (GPT.load); huggingface: a save_pretrained "
                         "directory; nanogpt: a ckpt.pt with 'model' and 'model_args' (default: ours)")
    convert.add_argument("--n-heads", type=_positive, default=None,
                         help="heads, for a bare state dict without a config (default: width // 64, as every GPT-2)")
    return convert


def main(argv: list[str] | None = None) -> None:
    parser, parsers = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_demo_paths(parsers["demo"], args)
    if args.command == "convert":
        _check_convert_source(parsers["convert"], args)
    # Output paths are checked before any work: a run must not fail at its end on where it writes.
    for option, kind in _OUTPUTS.get(args.command, ()):
        problem = _output_problem(getattr(args, option), directory=kind == "directory")
        if problem is not None:
            _fail(parsers[args.command], f"--{option.replace('_', '-')} {getattr(args, option)}: {problem}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    runners = {"check": _run_check, "bench": _run_bench, "bench-transformers": _run_bench_transformers,
               "bench-deploy": _run_bench_deploy, "bench-half": _run_bench_half,
               "bench-llama-cpp": _run_bench_llama_cpp, "demo": _run_demo, "convert": _run_convert}
    runners[args.command](args, parsers[args.command])


def _run_check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_mod.main(repeats=args.repeats, json_path=args.json, shapes=args.shapes)


def _run_demo(args: argparse.Namespace, demo: argparse.ArgumentParser) -> None:
    from . import demo as demo_mod

    if args.distributed is not None and args.load is not None:
        demo.error("--load answers with a saved model in one process; it does not take --distributed")
    if args.load is None:
        demo_mod.main(steps=args.steps, seed=args.seed, out=args.out, load=None, n_eval=args.n_eval,
                      distributed_strategy=args.distributed)
    else:
        try:
            demo_mod.main(steps=args.steps, seed=args.seed, out=args.out, load=args.load, n_eval=args.n_eval)
        except _load_errors() as exc:
            _fail(demo, f"--load {args.load}: {_one_line(exc)}")


def _run_convert(args: argparse.Namespace, convert: argparse.ArgumentParser) -> None:
    from ..models.convert import convert as convert_checkpoint

    try:
        convert_checkpoint(args.src, args.out, source_format=args.source_format,
                           target_format=args.target_format, n_heads=args.n_heads)
    except _load_errors() as exc:
        _fail(convert, _convert_error(args, exc))


def _run_bench_transformers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .bench import hf as bench_transformers

    bench_transformers.main(out_dir=args.out, repeats=args.repeats, bf16=args.bf16, quick=args.quick, gpt=args.gpt)


def _run_bench_deploy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .bench import deploy as bench_deploy

    bench_deploy.main(out_dir=args.out, repeats=args.repeats, quick=args.quick, peers=tuple(args.peers))


def _run_bench_half(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .bench import half as bench_half

    bench_half.main(out_dir=args.out, repeats=args.repeats, quick=args.quick)


def _run_bench_llama_cpp(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .bench import llama_cpp

    llama_cpp.main(work=args.work, out_dir=args.out, runs=args.runs, threads=torch.get_num_threads(),
                   quick=args.quick, dtypes=tuple(args.dtypes), model=args.model, isa=args.isa)


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from .bench import kernel as bench_mod

    bench_mod.main(lengths=args.T, B=args.B, H=args.H, hd=args.hd, repeats=args.repeats, json_path=args.json,
                   plot_path=args.plot, bf16=args.bf16, memory_lengths=args.memory_T if args.memory else [],
                   backward=args.backward, decode_shape=args.decode_shape if args.decode else None,
                   flex=args.flex, module=args.module)


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A file's problem at the command boundary: one line on stderr and exit code 2 (no usage: the
    arguments were well-formed)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _one_line(exc: BaseException) -> str:
    """The exception's first line (torch.load's weights-only errors run to a page of advice)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _load_errors() -> tuple[type[BaseException], ...]:
    """What the checkpoint readers raise on a bad or unreadable file: ours (CheckpointError is a
    ValueError), the OS's, safetensors', pickle's (torch.load) and a truncated pickle's EOFError."""
    from safetensors import SafetensorError

    return (OSError, ValueError, TypeError, SafetensorError, pickle.UnpicklingError, EOFError)


def _convert_error(args: argparse.Namespace, exc: BaseException) -> str:
    """The message for a failed convert; names the file where the reader's own message does not."""
    from safetensors import SafetensorError

    text = _one_line(exc)
    if isinstance(exc, SafetensorError):
        files = sorted(args.src.glob("*.safetensors"))
        where = files[0] if len(files) == 1 else args.src
        return f"{where}: not a readable safetensors file ({text})"
    if isinstance(exc, (pickle.UnpicklingError, EOFError)):
        return f"{args.src}: not a nanoGPT checkpoint (torch.load: {text})"
    return text if str(args.src) in text else f"{args.src}: {text}"


# Each command's output paths (options whose value may be None are skipped): a file, or a
# directory (created if missing).
_OUTPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "check": (("json", "file"),),
    "bench": (("json", "file"), ("plot", "file")),
    "bench-transformers": (("out", "directory"),),
    "bench-deploy": (("out", "directory"),),
    "bench-half": (("out", "directory"),),
    "bench-llama-cpp": (("out", "directory"), ("work", "directory")),
}


def _output_problem(path: Path | None, *, directory: bool) -> str | None:
    """Why path cannot be written (a file where a directory must be, or the reverse, in path or a
    parent), or None."""
    if path is None:
        return None
    if path.exists():
        if directory and not path.is_dir():
            return "is a file; expected a directory (created if missing)"
        if not directory and path.is_dir():
            return "is a directory; expected a file name"
        return None
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, so nothing can be written under it"
    return None


def _check_demo_paths(demo: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--load must be a saved model's directory; --out must be one that can be made (checked before training)."""
    if args.load is not None and not args.load.is_dir():
        _fail(demo, f"--load {args.load}: {'not a directory' if args.load.exists() else 'not found'}; "
              "expected the --out directory of a demo run")
    problem = _output_problem(args.out, directory=True) if args.load is None else None
    if problem is not None:
        _fail(demo, f"--out {args.out}: {problem}")


def _check_convert_source(convert: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """SRC's kind for its format: a nanoGPT checkpoint is a file, the others are directories; --out
    a directory (--to nanogpt: a .pt file, or a directory for ckpt.pt)."""
    src: Path = args.src
    if not src.exists():
        _fail(convert, f"SRC {src}: not found")
    if args.source_format == "nanogpt" and not src.is_file():
        _fail(convert, f"SRC {src}: is a directory; --from nanogpt takes a checkpoint file (nanoGPT's ckpt.pt)")
    if args.source_format != "nanogpt" and not src.is_dir():
        what = "a save_pretrained directory" if args.source_format == "huggingface" else "a GPT.save directory"
        _fail(convert, f"SRC {src}: is a file; --from {args.source_format} takes {what}")
    out: Path = args.out
    problem = _output_problem(out, directory=not (args.target_format == "nanogpt" and out.suffix == ".pt"))
    if problem is not None:
        _fail(convert, f"--out {out}: {problem}")


if __name__ == "__main__":
    main()
