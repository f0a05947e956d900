"""``python -m causal_attention {check, bench, demo}``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m causal_attention", description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="error against nn.MultiheadAttention and the reference, and timings")
    check.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median)")
    check.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")

    bench = sub.add_parser("bench", help="the kernel and the module against PyTorch's own, with a plot")
    bench.add_argument("--T", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="sequence lengths")
    bench.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median)")
    bench.add_argument("--json", type=Path, default=Path("bench_out/bench.json"), help="write the report as JSON")
    bench.add_argument("--plot", type=Path, default=Path("bench_out/bench.png"), help="write time-vs-T plot (PNG)")
    bench.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bfloat16 rows")
    bench.add_argument("--no-memory", dest="memory", action="store_false", help="skip peak memory at T=4096, 8192")
    bench.add_argument("--no-backward", dest="backward", action="store_false", help="time the forward pass only")
    bench.add_argument("--no-decode", dest="decode", action="store_false", help="skip the generation rows")

    demo = sub.add_parser("demo", help="train a tiny GPT on digit reversal, then generate with the KV cache")
    demo.add_argument("--steps", type=int, default=1500, help="training steps")
    demo.add_argument("--seed", type=int, default=0, help="same seed, same result")
    demo.add_argument("--out", type=Path, default=Path("demo_out"), help="where to write metrics, plots, model")
    demo.add_argument("--load", type=Path, default=None, help="answer new problems with a saved model instead")

    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "check":
        from . import check as check_mod

        check_mod.main(repeats=args.repeats, json_path=args.json)
    elif args.command == "demo":
        from . import demo as demo_mod

        demo_mod.main(steps=args.steps, seed=args.seed, out=args.out, load=args.load)
    elif args.command == "bench":
        from . import bench as bench_mod

        bench_mod.main(lengths=args.T, repeats=args.repeats, json_path=args.json, plot_path=args.plot,
                       bf16=args.bf16, memory=args.memory, backward=args.backward, decode=args.decode)


if __name__ == "__main__":
    main()
