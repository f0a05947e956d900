"""``python -m causal_attention {check, bench, bench-transformers, bench-deploy, demo, convert}``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m causal_attention", description=__doc__)
    parser.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's)")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="error against nn.MultiheadAttention and the reference, and timings")
    check.add_argument("--repeats", type=_positive, default=5, help="interleaved timing rounds (median)")
    check.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    check.add_argument("--shapes", type=_sizes("B", "T", "dim", "H"), nargs="+", default=None, metavar="B,T,dim,H",
                       help="shapes to check (default: GPT-2 widths, 4,256,768,12 2,1024,768,12 1,512,1024,16)")

    bench = sub.add_parser("bench", help="the kernel and the module against PyTorch's own, with a plot")
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

    bench_tf = sub.add_parser("bench-transformers",
                              help="GPT and the engine against transformers' GPT-2 on the same weights, with a plot")
    bench_tf.add_argument("--repeats", type=_positive, default=3, help="interleaved timing rounds (median)")
    bench_tf.add_argument("--out", type=Path, default=Path("bench_out"),
                          help="where to write bench_transformers.json and bench_transformers.png")
    bench_tf.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bfloat16 rows")
    bench_tf.add_argument("--no-gpt", dest="gpt", action="store_false",
                          help="skip the GPT-vs-GPT2LMHeadModel rows (keep the engine-inside-transformers rows)")
    bench_tf.add_argument("--quick", action="store_true", help="a tiny model and short sequences (a smoke test)")

    bench_dep = sub.add_parser("bench-deploy",
                               help="the layer and the GPT in onnxruntime and AOTInductor against eager, with a plot")
    bench_dep.add_argument("--repeats", type=_positive, default=3, help="interleaved timing rounds (median)")
    bench_dep.add_argument("--out", type=Path, default=Path("bench_out"),
                           help="where to write bench_deploy.json and bench_deploy.png")
    bench_dep.add_argument("--peers", nargs="+", choices=("onnxruntime", "onnxruntime-opset23", "aoti"),
                           default=["onnxruntime", "onnxruntime-opset23", "aoti"], help="the peers to time")
    bench_dep.add_argument("--quick", action="store_true", help="tiny models and short sequences (a smoke test)")

    demo = sub.add_parser("demo", help="train a tiny GPT on digit reversal, then generate with the KV cache")
    demo.add_argument("--steps", type=int, default=1500, help="training steps")
    demo.add_argument("--seed", type=int, default=0, help="same seed, same result")
    demo.add_argument("--out", type=Path, default=Path("demo_out"), help="where to write metrics, plots, model")
    demo.add_argument("--load", type=Path, default=None, help="answer new problems with a saved model instead")
    demo.add_argument("--n-eval", type=_positive, default=500, help="problems to answer after training or loading")
    demo.add_argument("--distributed", choices=("ddp", "fsdp", "tp"), default=None,
                      help="train on torchrun's processes (gloo): ddp, fsdp (FSDP2), or tp (tensor parallel by "
                      "heads); e.g. torchrun --nproc-per-node 2 -m causal_attention demo --distributed ddp")

    convert = sub.add_parser("convert", help="convert a GPT checkpoint between transformers, nanoGPT and this project")
    convert.add_argument("--from", dest="source_format", choices=("huggingface", "nanogpt", "ours"), required=True,
                         help="SRC's format: a save_pretrained directory, a nanoGPT ckpt.pt, or a GPT.save directory")
    convert.add_argument("src", type=Path, help="the checkpoint to read")
    convert.add_argument("--out", type=Path, required=True, help="where to write")
    convert.add_argument("--to", dest="target_format", choices=("ours", "huggingface", "nanogpt"), default="ours",
                         help="ours: model.safetensors + config.json (GPT.load); huggingface: a save_pretrained "
                         "directory; nanogpt: a ckpt.pt with 'model' and 'model_args' (default: ours)")
    convert.add_argument("--n-heads", type=_positive, default=None,
                         help="heads, for a bare state dict without a config (default: width // 64, as every GPT-2)")

    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "check":
        from . import check as check_mod

        check_mod.main(repeats=args.repeats, json_path=args.json, shapes=args.shapes)
    elif args.command == "demo":
        from . import demo as demo_mod

        if args.distributed is not None and args.load is not None:
            parser.error("demo: --load answers with a saved model in one process; it does not take --distributed")
        demo_mod.main(steps=args.steps, seed=args.seed, out=args.out, load=args.load, n_eval=args.n_eval,
                      distributed_strategy=args.distributed)
    elif args.command == "convert":
        from . import checkpoints

        try:
            checkpoints.convert(args.src, args.out, source_format=args.source_format,
                                target_format=args.target_format, n_heads=args.n_heads)
        except (checkpoints.CheckpointError, FileNotFoundError, ValueError, TypeError) as exc:
            parser.exit(2, f"convert: error: {exc}\n")
    elif args.command == "bench-transformers":
        from . import bench_transformers

        bench_transformers.main(out_dir=args.out, repeats=args.repeats, bf16=args.bf16, quick=args.quick, gpt=args.gpt)
    elif args.command == "bench-deploy":
        from . import bench_deploy

        bench_deploy.main(out_dir=args.out, repeats=args.repeats, quick=args.quick, peers=tuple(args.peers))
    elif args.command == "bench":
        from . import bench as bench_mod

        bench_mod.main(lengths=args.T, B=args.B, H=args.H, hd=args.hd, repeats=args.repeats, json_path=args.json,
                       plot_path=args.plot, bf16=args.bf16, memory_lengths=args.memory_T if args.memory else [],
                       backward=args.backward, decode_shape=args.decode_shape if args.decode else None,
                       flex=args.flex, module=args.module)


if __name__ == "__main__":
    main()
