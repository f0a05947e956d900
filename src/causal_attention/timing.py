"""Interleaved timing: the machines are noisy, so implementations are timed side by side in one
process, round-robin, and compared by the median of their runs."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 1,
    after_call: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median wall time in seconds of each function; each round runs every function once, in an
    order rotated from round to round so that none always runs first. after_call (e.g. advancing
    a progress bar) runs after every call, warm-up included, outside the timed region."""
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
    return {name: statistics.median(ts) for name, ts in times.items()}
