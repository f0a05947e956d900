"""What the benchmarks share: interleaved timing, and the row, table and plot of a comparison of
ours against a peer.

The machines are noisy, so implementations are timed side by side in one process, round-robin,
and compared by the median of their runs; a ratio of two of them can be taken round by round
(paired_ratio), where the machine's drift between rounds cancels."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from rich.console import Console
from rich.table import Table


def interleaved_times(
    fns: Mapping[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 1,
    after_call: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Wall times in seconds of each function, one per round (in round order); each round runs
    every function once, in an order rotated from round to round so that none always runs first.
    after_call (e.g. advancing a progress bar) runs after every call, warm-up included, outside the
    timed region."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1; got {repeats}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
            if after_call is not None:
                after_call()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
            if after_call is not None:
                after_call()
    return times


def rounds_within(fns: Mapping[str, Callable[[], object]], *, budget_s: float, minimum: int, maximum: int) -> int:
    """Calls each function once (a warm-up round, timed) and returns how many rounds of all of them
    fit in budget_s at that pace, clamped to [minimum, maximum]: short calls get more rounds, so that
    a median of paired ratios rests on more than a handful of them where that costs seconds."""
    if not 1 <= minimum <= maximum:
        raise ValueError(f"rounds_within: need 1 <= minimum <= maximum; got {minimum} and {maximum}")
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    per_round = time.perf_counter() - start
    fit = int(budget_s / per_round) if per_round > 0 else maximum
    return max(minimum, min(maximum, fit))


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 1,
    after_call: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time in seconds of each function over interleaved_times' rounds."""
    return medians(interleaved_times(fns, repeats=repeats, warmup=warmup, after_call=after_call))


def medians(times: Mapping[str, list[float]]) -> dict[str, float]:
    """The median of each function's rounds (interleaved_times' result)."""
    return {name: statistics.median(ts) for name, ts in times.items()}


def paired_ratio(times: Mapping[str, list[float]], numerator: str, denominator: str) -> float:
    """The median over rounds of numerator's time / denominator's time in the same round (e.g.
    the slower implementation over the faster: a speed-up). Both ran within one round, seconds
    apart, so a change in the machine's speed between rounds (another tenant, a clock) cancels,
    which a ratio of the two medians, taken from different rounds, does not."""
    a, b = times[numerator], times[denominator]
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_ratio: {numerator!r} and {denominator!r} need the same rounds; got {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


@dataclass
class Row:
    section: str
    name: str
    ours_ms: float
    theirs_ms: float
    ratio: float  # theirs_ms / ours_ms: above 1, ours is faster


def print_rows(rows: list[Row], skipped: list[str], console: Console | None = None, *,
               title: str = "causal_attention in transformers (medians of interleaved runs; x = theirs / ours)") -> None:
    console = console or Console(width=max(Console().width, 140))
    table = Table(title=title)
    for col in ("section", "row", "ours ms", "theirs ms", "x"):
        table.add_column(col, justify="left" if col in ("section", "row") else "right")
    for r in rows:
        table.add_row(r.section, r.name, f"{r.ours_ms:.2f}", f"{r.theirs_ms:.2f}", f"{r.ratio:.2f}x")
    console.print(table)
    for reason in skipped:
        console.print(f"skipped: {reason}")


def plot_rows(rows: list[Row], path: Path, *, title: str) -> None:
    """A horizontal bar per row: theirs / ours (above 1, ours is faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.section}\n{r.name}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(rows)))
    bars = ax.barh(range(len(rows)), [r.ratio for r in rows], color=[f"C{i % 10}" for i in range(len(rows))])
    ax.bar_label(bars, labels=[f"{r.ratio:.2f}x ({r.ours_ms:.0f} vs {r.theirs_ms:.0f} ms)" for r in rows], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    if max(r.ratio for r in rows) > 10 * max(min(r.ratio for r in rows), 1e-9):
        ax.set_xscale("log")  # a 50x bar would flatten the 1.1x ones
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("their time / our time (above 1: causal_attention is faster)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
