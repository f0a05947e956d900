"""``python -m causal_attention check|bench|demo`` at tiny sizes: the files they write hold the rows
they should, with numbers that make sense; bad arguments are argparse errors (exit code 2)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from causal_attention.tools import cli
from causal_attention.tools.bench.decode import DECODE_READ_ROW, DECODE_UNFUSED_ROW

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHECK_KEYS = {"shape", "mask", "impl", "err_vs_mha", "err_vs_ref64", "fwd_ms", "fwd_bwd_ms", "fwd_vs_mha",
              "fwd_bwd_vs_mha"}
IMPLS = {"nn.MultiheadAttention", "ours:cpp", "ours:sdpa", "ours:reference"}


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """``--threads`` sets torch's thread count for the whole process: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_rows(rows: list[dict], shapes: list[tuple[int, int, int, int]]) -> None:
    """The rows of ``check``: every (shape, mask, impl), errors of float32 size, ratios that are ratios."""
    expected = {(f"B={B} T={T} dim={dim} H={H}", mask, impl)
                for B, T, dim, H in shapes for mask in ("none", "right") for impl in IMPLS}
    assert {(r["shape"], r["mask"], r["impl"]) for r in rows} == expected and len(rows) == len(expected)
    for r in rows:
        assert set(r) == CHECK_KEYS
        assert 0 <= r["err_vs_mha"] < 1e-4 and 0 < r["err_vs_ref64"] < 1e-4, r  # float32 against float64: not 0
        for key in ("fwd_ms", "fwd_bwd_ms", "fwd_vs_mha", "fwd_bwd_vs_mha"):
            assert _positive_finite(r[key]), (key, r)
        if r["impl"] == "nn.MultiheadAttention":
            assert r["err_vs_mha"] == 0 and r["fwd_vs_mha"] == 1 and r["fwd_bwd_vs_mha"] == 1
        else:
            base = next(b for b in rows if (b["shape"], b["mask"], b["impl"]) == (r["shape"], r["mask"], "nn.MultiheadAttention"))
            assert r["fwd_bwd_vs_mha"] == pytest.approx(base["fwd_bwd_ms"] / r["fwd_bwd_ms"], rel=1e-9)


def test_check_at_tiny_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "deep" / "check.json"
    cli.main(["--threads", "1", "check", "--shapes", "2,16,32,4", "1,9,24,3", "--repeats", "1", "--json", str(out)])
    assert torch.get_num_threads() == 1
    _check_rows(json.loads(out.read_text()), [(2, 16, 32, 4), (1, 9, 24, 3)])
    printed = capsys.readouterr()
    assert "causal_attention check (float32, 1 thread;" in printed.out and "B=1 T=9 dim=24 H=3" in printed.out
    # Off a terminal the progress bar never draws: a line says what is being done, shape by shape.
    progress = printed.err.splitlines()
    assert progress[0].startswith("check: 2 shape(s) x 2 masks") and "1 interleaved rounds" in progress[0]
    assert progress[1:] == ["check 1/4: B=2 T=16 dim=32 H=4 mask=none", "check 2/4: B=2 T=16 dim=32 H=4 mask=right",
                            "check 3/4: B=1 T=9 dim=24 H=3 mask=none", "check 4/4: B=1 T=9 dim=24 H=3 mask=right"]


def test_bench_at_tiny_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plot = tmp_path / "b" / "bench.json", tmp_path / "b" / "bench.png"
    B, H, hd, lengths = 2, 2, 8, (16, 32)
    dB, ctx, ddim, dH = 2, 64, 32, 2
    cli.main(["--threads", "1", "bench", "--T", *map(str, lengths), "--B", str(B), "--H", str(H), "--hd", str(hd),
              "--repeats", "1", "--memory-T", "32", "--decode-shape", f"{dB},{ctx},{ddim},{dH}", "--no-flex",
              "--json", str(out), "--plot", str(plot)])
    report = json.loads(out.read_text())
    assert (report["B"], report["H"], report["hd"], report["threads"]) == (B, H, hd, 1)
    assert set(report["mm_gflops"]) == {"float32", "bfloat16"} and all(map(_positive_finite, report["mm_gflops"].values()))
    # The bfloat16 ceiling is never below sgemm's (a bf16 product is an f32 product of exact widenings).
    assert report["mm_gflops"]["bfloat16"] >= report["mm_gflops"]["float32"]
    assert report["bf16_dot_products"] in (True, False, None)
    assert _positive_finite(report["copy_gbs"])

    # Kernel and module rows: every (dtype, T, mask) and implementation, times and ratios that add up.
    expected = set()
    for dtype in ("float32", "bfloat16"):
        for T in lengths:
            for impl in ("ours", "sdpa(bool mask)", "sdpa(is_causal)", "reference"):
                expected.add(("kernel", dtype, T, "causal", impl))
                if impl != "sdpa(is_causal)":
                    expected.add(("kernel", dtype, T, "padded", impl))
            for mask in ("causal", "padded"):
                expected |= {("module", dtype, T, mask, impl) for impl in ("ours", "nn.MultiheadAttention")}
    rows = report["rows"]
    assert {(r["level"], r["dtype"], r["T"], r["mask"], r["impl"]) for r in rows} == expected
    assert len(rows) == len(expected)
    dim = H * hd
    for r in rows:
        for key in ("fwd_ms", "fwd_bwd_ms", "fwd_speedup", "fwd_bwd_speedup", "fwd_gflops", "fwd_ceiling_fraction"):
            assert _positive_finite(r[key]), (key, r)
        flops = 2 * B * H * r["T"] ** 2 * hd + (8 * B * r["T"] * dim**2 if r["level"] == "module" else 0)
        assert r["fwd_gflops"] == pytest.approx(flops / (r["fwd_ms"] / 1e3) / 1e9, rel=1e-9)  # the counting rule
        base = next(b for b in rows if (b["level"], b["dtype"], b["T"], b["mask"], b["impl"])
                    == (r["level"], r["dtype"], r["T"], r["mask"], r["baseline"]))
        assert r["fwd_speedup"] == pytest.approx(base["fwd_ms"] / r["fwd_ms"], rel=1e-9)
        # Of the ceiling's n x n product timed in the same round (one round here: a plain ratio of rates).
        n = report["mm_n"][r["dtype"]]
        assert r["fwd_ceiling_fraction"] == pytest.approx(
            r["fwd_gflops"] / (2 * n**3 / (r["ceiling_ms"] / 1e3) / 1e9), rel=1e-9)

    # Peak memory at the one length asked for.
    assert [m["T"] for m in report["memory"]] == [32]
    assert all(math.isfinite(v) and v >= 0 for k, v in report["memory"][0].items() if k != "T")

    # Generation: the decode step in float32, bfloat16 and float16 with its ratio to float32, then generate.
    steps = [d for d in report["decode"] if str(d["row"]).startswith("decode step")]
    assert {(d["row"], d["dtype"]) for d in steps} == {
        (row, dt) for row in ("decode step: whole layer", "decode step: attention op")
        for dt in ("float32", "bfloat16", "float16")} | {(DECODE_READ_ROW, "float32"), (DECODE_UNFUSED_ROW, "float32")}
    for d in steps:
        assert _positive_finite(d["ms"]) and _positive_finite(d["vs_f32"]) and _positive_finite(d["kv_GB_per_s"])
        f32 = next(e for e in steps if e["row"] == d["row"] and e["dtype"] == "float32")
        assert d["vs_f32"] == pytest.approx(f32["ms"] / d["ms"], rel=1e-9)
        itemsize = 4 if d["dtype"] == "float32" else 2
        kv_bytes = 2 * dB * dH * ctx * (ddim // dH) * itemsize  # K and V of the context, read once
        assert d["kv_GB_per_s"] * 1e9 * d["ms"] / 1e3 == pytest.approx(kv_bytes, rel=1e-9)
        # All bytes: the layer's qkv and proj weights and biases and the K and V rows it writes, too.
        # The read-only ceiling: the weights and the cache's spare position (max_len = ctx + 1).
        extra = {"decode step: whole layer": 4 * ddim * ddim + 4 * ddim + 2 * dB * ddim,
                 DECODE_UNFUSED_ROW: 4 * ddim * ddim + 4 * ddim + 2 * dB * ddim,
                 DECODE_READ_ROW: 4 * ddim * ddim + 4 * ddim + 2 * dB * ddim}.get(d["row"], 0) * itemsize
        assert d["all_GB_per_s"] * 1e9 * d["ms"] / 1e3 == pytest.approx(kv_bytes + extra, rel=1e-9)
        assert d["all_of_copy"] / d["of_copy"] == pytest.approx((kv_bytes + extra) / kv_bytes, rel=1e-9)
    generate = {d["row"]: d for d in report["decode"] if str(d["row"]).startswith("generate")}
    assert set(generate) == {"generate, KV cache", "generate, no cache"}
    assert all(_positive_finite(d["tokens_per_s"]) and _positive_finite(d["speedup"]) for d in generate.values())

    assert plot.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "causal_attention bench" in printed and "vs f32" in printed and f"plot: {plot}" in printed


def test_bench_switches_leave_out_their_rows(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cli.main(["--threads", "1", "bench", "--T", "8", "--B", "1", "--H", "1", "--hd", "4", "--repeats", "1",
              "--no-bf16", "--no-memory", "--no-backward", "--no-decode", "--json", str(out), "--plot", str(tmp_path / "p.png")])
    report = json.loads(out.read_text())
    assert {r["dtype"] for r in report["rows"]} == {"float32"} and set(report["mm_gflops"]) == {"float32"}
    assert all(r["fwd_bwd_ms"] is None and r["fwd_bwd_speedup"] is None for r in report["rows"])
    assert report["memory"] == [] and report["decode"] == []
    assert {r["level"] for r in report["rows"]} == {"kernel", "module"}

    cli.main(["--threads", "1", "bench", "--T", "8", "--B", "1", "--H", "1", "--hd", "4", "--repeats", "1",
              "--no-bf16", "--no-memory", "--no-backward", "--no-decode", "--no-flex", "--no-module", "--json", str(out),
              "--plot", str(tmp_path / "p.png")])
    report = json.loads(out.read_text())
    assert {r["level"] for r in report["rows"]} == {"kernel"} and {r["impl"] for r in report["rows"]} == {
        "ours", "sdpa(bool mask)", "sdpa(is_causal)", "reference"}


def test_bench_flex_rows(tmp_path: Path) -> None:
    """Compiled FlexAttention among the kernel rows, forward only, and computing the same attention
    as ours on the real positions (a peer timed on a different problem would be no peer)."""
    from causal_attention.tools.bench.kernel import FLEX, _flex_impl

    out = tmp_path / "bench.json"
    cli.main(["--threads", "1", "bench", "--T", "24", "--B", "2", "--H", "2", "--hd", "8", "--repeats", "1",
              "--no-bf16", "--no-memory", "--no-decode", "--json", str(out), "--plot", str(tmp_path / "p.png")])
    rows = json.loads(out.read_text())["rows"]
    flex = {r["mask"]: r for r in rows if r["impl"] == FLEX}
    assert set(flex) == {"causal", "padded"} and all(r["level"] == "kernel" for r in flex.values())
    assert all(_positive_finite(r["fwd_ms"]) and r["fwd_bwd_ms"] is None for r in flex.values())
    assert all(r["fwd_bwd_ms"] is not None for r in rows if r["impl"] != FLEX)

    torch.manual_seed(0)
    B, T, H, hd = 3, 37, 2, 16
    qkv = torch.randn(B, T, 3 * H * hd)
    mask = torch.arange(T)[None, :] < torch.tensor([[37], [20], [1]])
    for m in (None, mask):
        with torch.no_grad():
            got, want = _flex_impl(B, T, H, hd, m)(qkv), torch.ops.causal_attention.attention_forward(qkv, m, H)[0]
        real = slice(None) if m is None else m  # flex gives padding queries the real keys before them
        assert (got[real] - want[real]).abs().max() <= 1e-5


def test_bench_rows_take_speedups_round_by_round() -> None:
    from causal_attention.tools.bench.kernel import CEILING, _rows

    # ours is twice as fast as the baseline in every round while the machine's speed drifts 10x
    # between rounds, but for one round where only ours was disturbed; the ratio of the two medians
    # (taken from different rounds) says 0.24x. The ceiling's product (as many FLOPs as ours) runs
    # in 40% of ours' time in every round but one, where only it was disturbed.
    fwd = {"sdpa(bool mask)": [1.0, 10.0, 1.1, 9.0, 0.9], "ours": [0.5, 5.0, 0.55, 4.5, 5.0],
           CEILING: [0.2, 2.0, 5.0, 1.8, 2.0]}
    fwd_bwd = {"sdpa(bool mask)": [3.0, 30.0, 2.0], "ours": [1.0, 10.0, 20.0]}
    rows = {r.impl: r for r in _rows("kernel", torch.float32, 64, "padded", fwd, fwd_bwd, 1e9, 1e9,
                                     "sdpa(bool mask)")}
    assert set(rows) == {"sdpa(bool mask)", "ours"}  # the ceiling is no row of its own
    assert rows["ours"].fwd_ceiling_fraction == pytest.approx(0.4)  # round by round
    assert rows["ours"].ceiling_ms == pytest.approx(statistics.median(fwd[CEILING]) * 1e3)
    assert rows["ours"].fwd_speedup == pytest.approx(2.0)
    assert statistics.median(fwd["sdpa(bool mask)"]) / statistics.median(fwd["ours"]) == pytest.approx(1.1 / 4.5)
    assert rows["ours"].fwd_ms == pytest.approx(statistics.median(fwd["ours"]) * 1e3)  # times stay medians
    assert rows["ours"].fwd_bwd_speedup == pytest.approx(3.0)
    assert rows["sdpa(bool mask)"].fwd_speedup == pytest.approx(1.0)
    assert rows["ours"].fwd_gflops == pytest.approx(1e9 / statistics.median(fwd["ours"]) / 1e9)


def test_bench_targets_from_rows() -> None:
    """The performance-target summary reads the right rows: a synthetic report with known times."""
    from causal_attention.tools.bench.kernel import FLEX, Report, Row, targets

    rows = []
    for dtype, scale in (("float32", 1.0), ("bfloat16", 0.5)):
        for T in (1024, 2048, 4096):
            for mask, base in (("padded", "sdpa(bool mask)"), ("causal", "sdpa(is_causal)")):
                # float32's sgemm fraction differs by mask, so that the target is seen to read the causal row.
                fraction = (0.8 if mask == "causal" else 0.95) if dtype == "float32" else 0.3
                ours = Row("kernel", dtype, T, mask, "ours", fwd_ms=10 * scale * T / 1024, fwd_bwd_ms=30 * scale * T / 1024,
                           fwd_speedup=2.5, fwd_bwd_speedup=1.2, fwd_ceiling_fraction=fraction, baseline=base)
                flex = Row("kernel", dtype, T, mask, FLEX, fwd_ms=ours.fwd_ms * (1.5 if dtype == "float32" else 5.0),
                           fwd_bwd_ms=None, baseline=base)
                rows += [ours, flex]
    report = Report(B=4, H=12, hd=64, threads=2, capability="avx2", mm_gflops={}, mm_n={}, copy_gbs=10.0, rows=rows,
                    decode=[{"row": "decode step: whole layer", "dtype": "float32", "of_copy": 0.9, "shape": "s"},
                            {"row": DECODE_READ_ROW, "dtype": "float32", "of_copy": 0.95, "shape": "s"}],
                    thread_scaling={"T": 2048, "threads": 2, "speedup": 1.9})
    got = {t["target"]: (t["value"], t["met"]) for t in targets(report)}
    decode_note = next(t["note"] for t in targets(report) if t["target"].startswith("decode step"))
    assert decode_note == "one read of as many bytes as the layer's: 95%; the layer is at 95% of that"
    assert got == {
        "bf16 forward, of same-run bf16 GEMM ceiling, T=2048": (0.3, False),
        **{f"bf16 fwd+bwd vs f32 fwd+bwd, T={T}": (2.0, True) for T in (1024, 2048, 4096)},
        **{f"f32 padded forward vs SDPA(bool mask), T={T}": (2.5, True) for T in (1024, 2048)},
        **{f"f32 causal fwd+bwd vs SDPA(is_causal), T={T}": (1.2, False) for T in (2048, 4096)},
        "f32 causal forward, of same-run sgemm, T=2048": (0.8, False),
        **{f"f32 forward vs FlexAttention, T={T}": (pytest.approx(1.5), False) for T in (1024, 2048)},
        **{f"bf16 forward vs FlexAttention, T={T}": (pytest.approx(5.0), True) for T in (1024, 2048)},
        "decode step, whole layer, f32, of copy bandwidth (s)": (0.9, True),
        "1 -> 2 threads, fwd+bwd T=2048": (1.9, True),
    }
    # Where the two dtypes were also timed side by side, that ratio is the one reported.
    report.bf16_speedup = [{"T": 2048, "float32_ms": 17.0, "bfloat16_ms": 10.0, "speedup": 1.7}]
    got = {t["target"]: (t["value"], t["met"]) for t in targets(report)}
    assert got["bf16 fwd+bwd vs f32 fwd+bwd, T=2048"] == (1.7, False)
    assert got["bf16 fwd+bwd vs f32 fwd+bwd, T=1024"] == (2.0, True)


def test_demo_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["--threads", "1", "demo", "--steps", "3", "--seed", "5", "--out", str(tmp_path), "--n-eval", "6"])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["steps"], metrics["seed"], metrics["eval_problems"]) == (3, 5, 6)
    capsys.readouterr()
    cli.main(["--threads", "1", "demo", "--load", str(tmp_path), "--n-eval", "6"])
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "on 6 new problems" in printed and "reverse(" in printed


def test_demo_says_what_its_final_loss_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bar shows the last step's loss, the summary the mean of the last 20 steps: each is named."""
    cli.main(["--threads", "1", "demo", "--steps", "25", "--seed", "5", "--out", str(tmp_path), "--n-eval", "4"])
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    printed = " ".join(capsys.readouterr().out.split())
    assert f"final loss {metrics['final_loss']:.4f} (mean of the last 20 steps; the bar shows the last step's " in printed
    assert "step loss" in printed  # the bar's label


def test_demo_load_refuses_a_model_that_is_not_the_demos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from causal_attention.tools import demo
    from causal_attention.models import GPT, GPTConfig

    GPT(GPTConfig(vocab_size=50, max_len=32, dim=16, n_layers=1, n_heads=2)).save(tmp_path / "other")
    GPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN, dim=16, n_layers=1, n_heads=2)).save(tmp_path / "bare")
    cases = [("other", "not a demo model: config.json has vocab_size=50, max_len=32"),
             ("bare", "tokenizer.json not found")]
    for name, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["demo", "--load", str(tmp_path / name), "--n-eval", "4"])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no "wrong" answers
        assert captured.err.count("\n") == 1 and message in captured.err and f"--load {tmp_path / name}" in captured.err


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """cli.main(argv) must exit with code 2 (no traceback); returns its stderr's last line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_demo_bad_paths_and_steps_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for steps in ("0", "-5"):
        assert f"expected a positive integer; got '{steps}'" in _exit_2(["demo", "--steps", steps], capsys)
    line = _exit_2(["demo", "--load", str(tmp_path / "nonexistent")], capsys)
    assert f"--load {tmp_path / 'nonexistent'}: not found" in line
    (tmp_path / "file").write_text("x")
    line = _exit_2(["demo", "--steps", "1", "--out", str(tmp_path / "file")], capsys)
    assert f"--out {tmp_path / 'file'}: is a file; expected a directory" in line


def test_convert_unreadable_sources_exit_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from causal_attention.models import GPT, GPTConfig

    out = str(tmp_path / "out")
    line = _exit_2(["convert", "--from", "nanogpt", str(tmp_path), "--out", out], capsys)
    assert f"SRC {tmp_path}: is a directory; --from nanogpt takes a checkpoint file" in line
    (tmp_path / "README.md").write_text("# not a checkpoint\n")
    line = _exit_2(["convert", "--from", "nanogpt", str(tmp_path / "README.md"), "--out", out], capsys)
    assert f"{tmp_path / 'README.md'}: not a nanoGPT checkpoint (torch.load:" in line
    GPT(GPTConfig(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2)).save(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = _exit_2(["convert", "--from", "ours", str(tmp_path / "m"), "--out", out], capsys)
    assert line.startswith("python -m causal_attention convert: error: ") and str(weights) in line  # one line, the file named
    line = _exit_2(["convert", "--from", "ours", str(tmp_path / "README.md"), "--out", out], capsys)
    assert "is a file; --from ours takes a GPT.save directory" in line
    assert not (tmp_path / "out").exists()


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """cli.main(argv) must exit with code 2 and print one line (no usage block, no traceback); returns it."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m causal_attention "), err
    return err.strip()


def test_convert_file_problems_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing SRC, a truncated nanoGPT checkpoint and model_args that ask for more than its tensors
    each print one line naming the file or option (argparse's usage block is for malformed arguments)."""
    from causal_attention.models import GPT, GPTConfig
    from causal_attention.models.convert import nanogpt_model_args, to_nanogpt_state_dict

    out = str(tmp_path / "out")
    line = _one_line_exit_2(["convert", "--from", "ours", str(tmp_path / "nope"), "--out", out], capsys)
    assert f"SRC {tmp_path / 'nope'}: not found" in line
    model = GPT(GPTConfig(vocab_size=13, max_len=8, dim=16, n_layers=2, n_heads=2))
    checkpoint = {"model": to_nanogpt_state_dict(model), "model_args": nanogpt_model_args(model)}
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "ckpt.pt").read_bytes()[:1000])
    line = _one_line_exit_2(["convert", "--from", "nanogpt", str(tmp_path / "trunc.pt"), "--out", out], capsys)
    assert f"{tmp_path / 'trunc.pt'}: not a nanoGPT checkpoint (torch.load: " in line
    torch.save({**checkpoint, "model_args": {**checkpoint["model_args"], "vocab_size": 10**12}}, tmp_path / "big.pt")
    line = _one_line_exit_2(["convert", "--from", "nanogpt", str(tmp_path / "big.pt"), "--out", out], capsys)
    assert "(model_args vocab_size=1000000000000, n_embd=16)" in line
    torch.save({**checkpoint, "model_args": {**checkpoint["model_args"], "n_embd": "16"}}, tmp_path / "text.pt")
    line = _one_line_exit_2(["convert", "--from", "nanogpt", str(tmp_path / "text.pt"), "--out", out], capsys)
    assert 'model_args: n_embd must be an int; got "16"' in line
    assert not (tmp_path / "out").exists()


def test_output_paths_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An output that cannot be written (a file where a directory must be, or in a parent) is one
    line naming the option, before the run (which would fail at its end)."""
    from causal_attention.models import GPT, GPTConfig

    afile = tmp_path / "afile"
    afile.write_text("x")
    GPT(GPTConfig(vocab_size=13, max_len=8, dim=16, n_layers=1, n_heads=2)).save(tmp_path / "m")
    cases = [
        (["check", "--shapes", "2,64,64,4", "--repeats", "1", "--json", f"{afile}/x.json"],
         f"--json {afile}/x.json: {afile} is a file"),
        (["check", "--json", str(tmp_path)], f"--json {tmp_path}: is a directory; expected a file name"),
        (["bench", "--json", f"{afile}/b.json"], f"--json {afile}/b.json: {afile} is a file"),
        (["bench", "--json", str(tmp_path / "b.json"), "--plot", f"{afile}/deep/b.png"], f"--plot {afile}/deep/b.png"),
        (["bench-transformers", "--out", str(afile)], f"--out {afile}: is a file; expected a directory"),
        (["bench-deploy", "--out", str(afile)], f"--out {afile}: is a file"),
        (["bench-half", "--out", f"{afile}/sub"], f"--out {afile}/sub: {afile} is a file"),
        (["bench-llama-cpp", "--work", str(afile)], f"--work {afile}: is a file"),
        (["demo", "--out", f"{afile}/run"], f"--out {afile}/run: {afile} is a file"),
        (["convert", "--from", "ours", str(tmp_path / "m"), "--out", str(afile)], f"--out {afile}: is a file"),
        (["convert", "--from", "ours", str(tmp_path / "m"), "--to", "nanogpt", "--out", f"{afile}/c.pt"],
         f"--out {afile}/c.pt: {afile} is a file"),
    ]
    for argv, message in cases:
        assert message in _one_line_exit_2(["--threads", "1", *argv], capsys), argv
    assert afile.read_text() == "x"


def test_threads_after_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--threads is taken after the command as before it (after wins where both are given)."""
    cli.main(["check", "--threads", "1", "--shapes", "1,8,16,2", "--repeats", "1", "--json", str(tmp_path / "a.json")])
    assert torch.get_num_threads() == 1
    torch.set_num_threads(3)
    cli.main(["--threads", "2", "check", "--shapes", "1,8,16,2", "--repeats", "1", "--json", str(tmp_path / "b.json")])
    assert torch.get_num_threads() == 2
    cli.main(["--threads", "2", "check", "--threads", "1", "--shapes", "1,8,16,2", "--repeats", "1"])
    assert torch.get_num_threads() == 1
    capsys.readouterr()
    assert "expected a positive integer; got '0'" in _exit_2(["demo", "--threads", "0"], capsys)


def test_convert_to_huggingface_writes_the_models_own_token_ids(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A demo model's tokenizer.json gives bos/eos; without one a 13-token model gets none (not
    GPT-2's 50256): every id written is in the vocabulary."""
    pytest.importorskip("transformers")
    from causal_attention.models import GPT, GPTConfig
    from causal_attention.tools import demo

    GPT(GPTConfig(vocab_size=demo.VOCAB, max_len=demo.MAX_LEN, dim=16, n_layers=1, n_heads=2,
                  activation="gelu_tanh")).save(tmp_path / "m")
    cli.main(["convert", "--from", "ours", str(tmp_path / "m"), "--to", "huggingface", "--out", str(tmp_path / "bare")])
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(demo.tokenizer_json()))
    cli.main(["convert", "--from", "ours", str(tmp_path / "m"), "--to", "huggingface", "--out", str(tmp_path / "demo")])
    # A save_pretrained source's list of end ids (Llama 3's) goes through, less ids past the vocabulary.
    shutil.copytree(tmp_path / "demo", tmp_path / "llama3ish")
    config_path = tmp_path / "llama3ish" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "eos_token_id": [demo.EOS, 2, 99]}))
    cli.main(["convert", "--from", "huggingface", str(tmp_path / "llama3ish"), "--to", "huggingface",
              "--out", str(tmp_path / "listed")])
    for name, expected in (("bare", (None, None)), ("demo", (demo.BOS, demo.EOS)),
                           ("listed", (demo.BOS, [demo.EOS, 2]))):
        for file in ("config.json", "generation_config.json"):
            values = json.loads((tmp_path / name / file).read_text())
            assert (values.get("bos_token_id"), values.get("eos_token_id")) == expected, (name, file)


def test_help_shows_every_default_and_no_markup(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {}
    for argv in ([], ["demo"], ["bench"], ["check"], ["convert"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*argv, "--help"])
        assert exit_info.value.code == 0
        helps[" ".join(argv)] = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all("``" not in text and "%(default)" not in text for text in helps.values())
    assert "python -m causal_attention {check, bench," in helps[""]
    for expected in ("training steps (default: 1500)", "(default: demo_out)", "(default: 500)", "(default: 0)"):
        assert expected in helps["demo"], expected
    for expected in ("sequence lengths (default: 256 512 1024 2048 4096)", "(default: 8,2048,768,12)",
                     "(default: bench_out/bench.json)", "(default: 5)"):
        assert expected in helps["bench"], expected
    assert "(default: GPT-2 widths" in helps["check"] and "take about 3 minutes on 2 cores" in helps["check"]
    assert "(default: ours)" in helps["convert"] and helps["convert"].count("(default:") == 2  # --to, --n-heads


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: command"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["check", "--shapes", "2,16,30,4"], "dim=30 is not divisible by H=4"),
        (["check", "--shapes", "2,16,32"], "expected 4 positive integers B,T,dim,H; got '2,16,32'"),
        (["check", "--shapes", "2,x,32,4"], "expected 4 positive integers"),
        (["check", "--repeats", "0"], "expected a positive integer; got '0'"),
        (["bench", "--T", "0"], "expected a positive integer; got '0'"),
        (["bench", "--decode-shape", "8,2048,768"], "expected 4 positive integers B,ctx,dim,H"),
        (["bench", "--hd", "-3"], "expected a positive integer; got '-3'"),
        (["demo", "--n-eval", "many"], "expected a positive integer; got 'many'"),
        (["demo", "--steps"], "expected one argument"),
        (["demo", "--steps", "0"], "expected a positive integer; got '0'"),
        (["--threads", "0", "check"], "expected a positive integer; got '0'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "causal_attention", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_module_entry_point_help_and_a_tiny_run(tmp_path: Path) -> None:
    result = _run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(cmd in result.stdout for cmd in ("check", "bench", "demo", "--threads"))
    result = _run("--threads", "1", "check", "--shapes", "1,8,16,2", "--repeats", "1", "--json", "c.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _check_rows(json.loads((tmp_path / "c.json").read_text()), [(1, 8, 16, 2)])
    result = _run("check", "--shapes", "1,8,15,2", cwd=tmp_path)
    assert result.returncode == 2 and "dim=15 is not divisible by H=2" in result.stderr


def test_convert_round_trip_through_every_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers -> ours -> nanoGPT -> ours -> transformers: every tensor comes back bitwise, and
    the converted model's logits equal transformers' at real positions."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from causal_attention.models import GPT

    torch.manual_seed(3)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=53, n_positions=24,
                                     activation_function="gelu", bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    steps = [("huggingface", "hf", "ours", "a"), ("ours", "a", "nanogpt", "nano"), ("nanogpt", "nano/ckpt.pt", "ours", "b"),
             ("ours", "b", "huggingface", "hf2")]
    for source, src, target, out in steps:
        cli.main(["convert", "--from", source, str(tmp_path / src), "--to", target, "--out", str(tmp_path / out)])
        assert "wrote" in capsys.readouterr().out
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    model = GPT.load(tmp_path / "b").eval()
    tokens = torch.randint(0, 53, (2, 9))
    mask = torch.tensor([[True] * 9, [True] * 4 + [False] * 5])
    with torch.no_grad():
        ours, theirs = model(tokens, mask), hf(tokens, attention_mask=mask.long()).logits
    assert (ours - theirs)[mask].abs().max() < 1e-4


def test_convert_errors_name_the_problem(tmp_path: Path) -> None:
    """A missing source, and a model nanoGPT cannot hold (tanh GELU), exit with code 2 and say why."""
    missing = subprocess.run([sys.executable, "-m", "causal_attention", "convert", "--from", "nanogpt",
                              str(tmp_path / "none.pt"), "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert missing.returncode == 2 and "none.pt" in missing.stderr
    from causal_attention.models import GPT, GPTConfig

    GPT(GPTConfig(vocab_size=11, max_len=8, dim=16, n_layers=1, n_heads=2, activation="gelu_tanh")).save(tmp_path / "m")
    tanh = subprocess.run([sys.executable, "-m", "causal_attention", "convert", "--from", "ours", str(tmp_path / "m"),
                           "--to", "nanogpt", "--out", str(tmp_path / "n")], capture_output=True, text=True)
    assert tanh.returncode == 2 and "exact GELU" in tanh.stderr and not (tmp_path / "n").exists()


def test_last_level_cache_bytes_sums_the_distinct_l3_caches(tmp_path: Path) -> None:
    """The decode rows' settling read is sized from the L3 that sysfs lists: each distinct L3 (by
    the CPUs that share it) that the process's CPUs use, once; other levels and unreadable entries
    left out; at most the cap; the default where none is listed."""
    from causal_attention.tools.bench.decode import last_level_cache_bytes

    def cache(cpu: int, index: int, level: int, size: str, shared: str) -> None:
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
        (d / "shared_cpu_list").write_text(f"{shared}\n")

    assert last_level_cache_bytes(root=tmp_path, default=123) == 123
    for cpu in range(4):  # two 32 MB L3s, shared by CPUs 0-1 and 2-3; a private 1 MB L2 each
        cache(cpu, 2, 2, "1024K", str(cpu))
        cache(cpu, 3, 3, "32768K", "0-1" if cpu < 2 else "2-3")
    cache(4, 3, 3, "32M", "4,6")  # other spellings of a size
    cache(5, 3, 3, "33554432", "5,7")
    cache(8, 3, 3, "32768kB", "8-9")
    cache(10, 3, 3, "", "10-11")  # unreadable: left out
    every = set(range(12))
    assert last_level_cache_bytes(root=tmp_path, cpus=every) == 5 * 32 * 2**20
    assert last_level_cache_bytes(root=tmp_path, cpus={1}) == 32 * 2**20  # only the L3 this process can use
    assert last_level_cache_bytes(root=tmp_path, cpus={0, 3, 6}) == 3 * 32 * 2**20
    assert last_level_cache_bytes(root=tmp_path, cpus={10}, default=7) == 7
    assert last_level_cache_bytes(root=tmp_path, cpus=every, cap=40 * 2**20) == 40 * 2**20
