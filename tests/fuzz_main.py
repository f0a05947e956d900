"""``make fuzz``: the property-based suite (tests/test_fuzz.py) at length, from a fixed seed.

    python tests/fuzz_main.py [--examples 10000] [--seed 20240611] [--threads 1] [--report build/fuzz_report.json]

Runs tests/test_fuzz.py under the ``fuzz`` hypothesis profile with a progress bar, then prints a
summary: the examples run, the failing examples (each listed with every parameter it drew), and
per dtype the worst error relative to its tolerance. The same summary is written as JSON to
--report. Exits non-zero when an example failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def summary_lines(report: dict, seconds: float) -> list[str]:
    """The human summary of a fuzz report (as written by tests/test_fuzz.py)."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=10_000, help="examples in all (split between the tests)")
    parser.add_argument("--seed", type=int, default=20240611, help="hypothesis seed: same seed, same examples")
    parser.add_argument("--report", type=Path, default=Path("build/fuzz_report.json"), help="JSON report")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the examples (default 1: the examples are tiny, and on a busy "
                        "machine every parallel region of a tiny op can wait a scheduler tick; make test runs the "
                        "ci examples on 2 threads, and test_kernel checks thread-count independence)")
    args = parser.parse_args(argv)

    report_path = args.report.resolve()
    report_path.unlink(missing_ok=True)
    os.environ.update(CA_FUZZ_PROFILE="fuzz", CA_FUZZ_EXAMPLES=str(args.examples), CA_FUZZ_SEED=str(args.seed),
                      CA_FUZZ_THREADS=str(args.threads), CA_FUZZ_REPORT=str(report_path))
    start = time.perf_counter()
    code = pytest.main([str(HERE / "test_fuzz.py"), "-q", "-s", "-p", "no:cacheprovider"])
    seconds = time.perf_counter() - start
    if not report_path.exists():
        print(f"fuzz: no report at {report_path} (pytest exit code {code})", file=sys.stderr)
        return int(code) or 1
    report = json.loads(report_path.read_text())
    report.update(seed=args.seed, threads=args.threads, seconds=seconds)
    report_path.write_text(json.dumps(report, indent=2))
    print("\n".join(summary_lines(report, seconds)))
    print(f"report: {report_path}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
