"""``make fuzz``: the property-based suite (tests/attention/test_fuzz.py) at length, from a fixed seed, on every
instruction-set path this CPU can run.

    python tests/attention/fuzz_main.py [--examples 10000] [--seed 20240611] [--threads 1] [--paths avx2 default]
                              [--report build/fuzz_report.json]

For each path (ATEN_CPU_CAPABILITY = avx512, avx2, default, and avx512-bf16 on a CPU with AMX: by default
those this CPU runs; the engine picks its routines once per process, so each path runs in a process of
its own) it runs
tests/attention/test_fuzz.py under the ``fuzz`` hypothesis profile with a progress bar and prints a summary: the
examples run, the failing examples (each listed with every parameter it drew), and per dtype the worst
error relative to its tolerance; then a table of the paths side by side. The summaries are written as
JSON to --report (one entry per path). Exits non-zero when an example failed on any path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: helpers
from helpers import isa_env  # noqa: E402


def summary_lines(report: dict, seconds: float) -> list[str]:
    """The human summary of a fuzz report (as written by tests/attention/test_fuzz.py)."""
    per_test = ", ".join(f"{name} {n}" for name, n in report["per_test"].items())
    lines = [f"fuzz: {report['examples']} examples ({per_test}), {report['failures']} failures, "
             f"seed {report.get('seed')}, {report.get('threads')} thread(s), {seconds:.0f} s"]
    for dtype, rec in report["per_dtype"].items():
        failing = ", ".join(f"{what} {n}" for what, n in rec["failing_quantities"].items())
        lines.append(f"  {dtype:9s} {rec['examples']:6d} examples, {rec['failures']} failures"
                     + (f" ({rec['failing_draws']} distinct draws; {failing})" if rec["failures"] else "")
                     + f"; worst error {rec['worst_ratio']:.3f} of its tolerance "
                     f"({rec['worst_err']:.3g} vs {rec['worst_tol']:.3g}): {rec['worst_where']}")
    for failing in report["failing_examples"]:
        lines.append(f"  FAILED {failing}")
    return lines


PATHS = ("avx512", "avx512-bf16", "avx2", "default")


def runnable_paths() -> list[str]:
    """The instruction-set paths this CPU runs: its default and every one below it; avx512-bf16 (AVX512
    with bfloat16's pair kernel held to vdpbf16ps, below AMX) only where the default takes AMX tiles."""
    import torch

    import causal_attention  # noqa: F401  (loads the engine, so that its tile products can be read)

    default = torch.backends.cpu.get_cpu_capability().lower()
    paths = list(PATHS[PATHS.index(default):]) if default in PATHS else ["default"]
    if torch.ops.causal_attention.tile_products(torch.bfloat16) != "AMX-BF16 tiles":
        paths = [p for p in paths if p != "avx512-bf16"]
    return paths


def path_table(reports: dict[str, dict]) -> list[str]:
    """One row per (path, dtype): examples, failures and the worst error relative to its tolerance."""
    lines = [f"{'path':8s} {'dtype':9s} {'examples':>8s} {'failures':>8s} {'worst err/tol':>13s}"]
    for path, report in reports.items():
        for dtype, rec in report["per_dtype"].items():
            lines.append(f"{path:8s} {dtype:9s} {rec['examples']:8d} {rec['failures']:8d} {rec['worst_ratio']:13.3f}")
    return lines


def run_one_path(args: argparse.Namespace, report_path: Path) -> int:
    """The fuzz run of this process's path (ATEN_CPU_CAPABILITY as set by the caller)."""
    import torch

    report_path.unlink(missing_ok=True)
    os.environ.update(CA_FUZZ_PROFILE="fuzz", CA_FUZZ_EXAMPLES=str(args.examples), CA_FUZZ_SEED=str(args.seed),
                      CA_FUZZ_THREADS=str(args.threads), CA_FUZZ_REPORT=str(report_path))
    import causal_attention  # noqa: F401  (loads the engine, so that its capability can be read)

    capability = str(torch.ops.causal_attention.cpu_capability())
    capability += f" (bfloat16: {torch.ops.causal_attention.tile_products(torch.bfloat16)})"
    print(f"fuzz: the {capability} path", flush=True)
    start = time.perf_counter()
    code = pytest.main([str(HERE / "test_fuzz.py"), "-q", "-s", "-p", "no:cacheprovider"])
    seconds = time.perf_counter() - start
    if not report_path.exists():
        print(f"fuzz: no report at {report_path} (pytest exit code {code})", file=sys.stderr)
        return int(code) or 1
    report = json.loads(report_path.read_text())
    report.update(seed=args.seed, threads=args.threads, seconds=seconds, capability=capability)
    report_path.write_text(json.dumps(report, indent=2))
    print("\n".join(summary_lines(report, seconds)), flush=True)
    return int(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=10_000, help="examples in all per path (split between the tests)")
    parser.add_argument("--seed", type=int, default=20240611, help="hypothesis seed: same seed, same examples")
    parser.add_argument("--report", type=Path, default=Path("build/fuzz_report.json"), help="JSON report")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the examples (default 1: the examples are tiny, and on a busy "
                        "machine every parallel region of a tiny op can wait a scheduler tick; make test runs the "
                        "ci examples on 2 threads, and test_kernel checks thread-count independence)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None,
                        help="instruction-set paths to run (default: every one this CPU runs)")
    parser.add_argument("--one-path", action="store_true", help=argparse.SUPPRESS)  # a child: this process's path
    args = parser.parse_args(argv)
    report_path = args.report.resolve()
    if args.one_path:
        return run_one_path(args, report_path)

    paths = args.paths or runnable_paths()
    unknown = sorted(set(paths) - set(runnable_paths()))
    if unknown:
        parser.error(f"--paths: this CPU cannot run {unknown}; it runs {runnable_paths()}")
    reports: dict[str, dict] = {}
    code = 0
    for path in paths:
        child_report = report_path.with_name(f"{report_path.stem}_{path}.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one-path", "--examples", str(args.examples),
               "--seed", str(args.seed), "--threads", str(args.threads), "--report", str(child_report)]
        rc = subprocess.run(cmd, env=isa_env(path)).returncode
        code = code or rc
        if child_report.exists():
            reports[path] = json.loads(child_report.read_text())
        else:
            code = code or 1
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(reports, indent=2))
    print("\nfuzz: every path (seed {}, {} examples each)".format(args.seed, args.examples))
    print("\n".join(path_table(reports)))
    print(f"report: {report_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
