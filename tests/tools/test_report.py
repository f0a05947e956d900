"""timing: interleaved rounds (rotation, warm-up, after_call) and the paired ratio the targets read."""

from __future__ import annotations

import statistics
import time

import pytest

from causal_attention.tools.bench import report as timing


def test_rounds_rotate_and_warm_up():
    calls: list[str] = []
    after: list[int] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = timing.interleaved_times(fns, repeats=4, warmup=2, after_call=lambda: after.append(1))
    assert calls[:6] == list("abcabc")  # the warm-up, untimed
    rounds = [calls[6 + 3 * r: 9 + 3 * r] for r in range(4)]
    assert rounds == [list("abc"), list("bca"), list("cab"), list("abc")]  # no function always first
    assert {name: len(ts) for name, ts in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert len(after) == 6 + 12
    assert all(t >= 0 for ts in times.values() for t in ts)
    medians = timing.interleaved_medians(fns, repeats=3, warmup=0)
    assert set(medians) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="repeats must be at least 1; got 0"):
        timing.interleaved_times(fns, repeats=0)


def test_paired_ratio_cancels_drift_between_rounds():
    # b is twice as fast as a in every round, while the machine's speed changes between rounds.
    times = {"a": [1.0, 10.0, 1.2, 0.9, 8.0], "b": [0.5, 5.0, 0.6, 0.45, 4.0]}
    assert timing.paired_ratio(times, "a", "b") == pytest.approx(2.0)
    # One round where only b was disturbed moves the paired median by nothing; the ratio of the
    # medians of the same times lands elsewhere.
    times = {"a": [1.0, 10.0, 1.2, 0.9, 8.0, 9.0, 1.1], "b": [0.5, 5.0, 0.6, 0.45, 4.0, 4.5, 9.9]}
    assert timing.paired_ratio(times, "a", "b") == pytest.approx(2.0)
    assert statistics.median(times["a"]) / statistics.median(times["b"]) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="need the same rounds; got 2 and 1"):
        timing.paired_ratio({"a": [1.0, 2.0], "b": [1.0]}, "a", "b")


def test_rounds_within_fits_the_budget_at_the_warm_up_pace():
    calls: list[str] = []

    def slow() -> None:  # ~20 ms a round
        calls.append("slow")
        time.sleep(0.02)

    fns = {"slow": slow, "fast": lambda: calls.append("fast")}
    # 0.2 s at ~20 ms a round: at most 10 rounds fit (fewer where sleep overshoots), more than the minimum 3
    rounds = timing.rounds_within(fns, budget_s=0.2, minimum=3, maximum=50)
    assert calls == ["slow", "fast"]  # one warm-up round: each function once
    assert 4 <= rounds <= 10
    assert timing.rounds_within(fns, budget_s=0.2, minimum=3, maximum=5) == 5  # clamped to the maximum
    assert timing.rounds_within(fns, budget_s=0.001, minimum=3, maximum=50) == 3  # and to the minimum
    with pytest.raises(ValueError, match="need 1 <= minimum <= maximum; got 5 and 4"):
        timing.rounds_within(fns, budget_s=1.0, minimum=5, maximum=4)
