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

    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.command == "check":
        from . import check as check_mod

        check_mod.main(repeats=args.repeats, json_path=args.json)


if __name__ == "__main__":
    main()
