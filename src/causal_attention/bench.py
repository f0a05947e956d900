"""``python -m causal_attention bench``: the fused kernel and the module against PyTorch's own.

Everything runs in this process, interleaved (round-robin, rotated), and is reported as medians;
the machines are noisy, so ratios within one run are the result, not absolute times. Work is
counted as causal FLOPs (DESIGN.md section 3): forward 2*B*H*T^2*hd, backward 2.5x that, plus
8*B*T*dim^2 for the module's projections. The ceiling is a large torch.mm timed in the same run.

Rows:
- kernel: the attention core from a qkv tensor (B, T, 3*dim): ours; F.scaled_dot_product_attention
  with is_causal=True (no padding only) and with the combined (B, 1, T, T) bool mask; the reference.
- module: the whole layer: ours; nn.MultiheadAttention (need_weights=False) with the same masks.
- memory: extra peak memory (resident set) of the kernel's forward+backward, in a fresh process.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import Tensor, nn

from . import _ops
from .module import CausalSelfAttention
from .reference import attention_core
from .timing import interleaved_medians

# Materialising B*H*T*T scores (reference, nn.MultiheadAttention) past this length costs many GB.
MATERIALISING_MAX_T = 2048


@dataclass
class Row:
    level: str  # kernel | module
    dtype: str
    T: int
    mask: str  # causal | padded
    impl: str
    fwd_ms: float
    fwd_bwd_ms: float | None
    fwd_speedup: float = 1.0  # baseline time / this time
    fwd_bwd_speedup: float | None = None
    fwd_gflops: float = 0.0
    fwd_ceiling_fraction: float = 0.0
    baseline: str = ""


@dataclass
class Report:
    B: int
    H: int
    hd: int
    threads: int
    capability: str
    mm_gflops: dict[str, float]  # per dtype
    copy_gbs: float
    rows: list[Row] = field(default_factory=list)
    memory: list[dict[str, float]] = field(default_factory=list)
    decode: list[dict[str, float | str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def mm_ceiling(dtype: torch.dtype, repeats: int = 5) -> float:
    """GFLOP/s of a large torch.mm at dtype, in this process."""
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / interleaved_medians({"mm": lambda: torch.mm(a, b)}, repeats=repeats)["mm"] / 1e9


def copy_ceiling(repeats: int = 5) -> float:
    """GB/s (read + write) of a large tensor copy, in this process."""
    src, dst = torch.randn(64 * 2**20 // 4), torch.empty(64 * 2**20 // 4)
    return 2 * src.numel() * 4 / interleaved_medians({"copy": lambda: dst.copy_(src)}, repeats=repeats)["copy"] / 1e9


def _padded_mask(B: int, T: int, generator: torch.Generator) -> Tensor:
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=generator)  # uniform in [T/2, T]
    return torch.arange(T)[None, :] < lengths  # (B, T), True = real


def _timed(fns: dict[str, Callable[[Tensor], Tensor]], x: Tensor, repeats: int, backward: bool) -> dict[str, float]:
    g = None

    def fwd(fn: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn(x)

        return run

    def fwd_bwd(fn: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            nonlocal g
            xg = x.detach().requires_grad_()
            y = fn(xg)
            if g is None:
                g = torch.randn_like(y)
            y.backward(g)

        return run

    make = fwd_bwd if backward else fwd
    # Two warm-up rounds: the first calls of a new shape pay for library set-up (oneDNN, MKL).
    return interleaved_medians({name: make(fn) for name, fn in fns.items()}, repeats=repeats, warmup=2)


def _kernel_impls(T: int, H: int, hd: int, mask: Tensor | None) -> dict[str, Callable[[Tensor], Tensor]]:
    def split(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = qkv.unflatten(2, (3, H, hd)).unbind(2)  # each (B, T, H, hd)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # each (B, H, T, hd)

    def join(o: Tensor) -> Tensor:  # (B, H, T, hd) -> (B, T, dim), as the output projection needs
        return o.transpose(1, 2).flatten(2)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    combined = causal[None, None] if mask is None else (causal & mask[:, None, :])[:, None]  # (B|1, 1, T, T)
    impls: dict[str, Callable[[Tensor], Tensor]] = {
        "ours": lambda qkv: _ops.attention(qkv, mask, H),
        "sdpa(bool mask)": lambda qkv: join(F.scaled_dot_product_attention(*split(qkv), attn_mask=combined)),
    }
    if mask is None:
        impls["sdpa(is_causal)"] = lambda qkv: join(F.scaled_dot_product_attention(*split(qkv), is_causal=True))
    if T <= MATERIALISING_MAX_T:
        impls["reference"] = lambda qkv: attention_core(qkv, mask, H)[0]
    return impls


def _module_impls(T: int, dim: int, H: int, mask: Tensor | None, dtype: torch.dtype) -> dict[str, Callable[[Tensor], Tensor]]:
    attn = CausalSelfAttention(dim, H, dtype=dtype)
    impls: dict[str, Callable[[Tensor], Tensor]] = {"ours": lambda x: attn(x, mask)}  # type: ignore[misc]
    if T <= MATERIALISING_MAX_T:
        mha = nn.MultiheadAttention(dim, H, batch_first=True, dtype=dtype)
        with torch.no_grad():
            mha.in_proj_weight.copy_(attn.qkv.weight)
            mha.in_proj_bias.copy_(attn.qkv.bias)
            mha.out_proj.weight.copy_(attn.proj.weight)
            mha.out_proj.bias.copy_(attn.proj.bias)
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        kpm = None if mask is None else ~mask
        impls["nn.MultiheadAttention"] = lambda x: mha(x, x, x, attn_mask=causal, key_padding_mask=kpm, need_weights=False)[0]
    return impls


def decode_rows(*, repeats: int = 9) -> list[dict[str, float | str]]:
    """A single-token decode step at B=8, context 2048, dim 768, 12 heads (float32): the layer and
    its attention op alone, with the bytes of K and V read per second against a copy of the same
    size (read + write bytes per second) timed interleaved with them; then a tiny
    GPT generating at context ~1024 with the KV cache and without it (recomputing the prefix)."""
    from .gpt import GPTConfig, TinyGPT

    rows: list[dict[str, float | str]] = []
    B, ctx, dim, H = 8, 2048, 768, 12
    hd = dim // H
    attn = CausalSelfAttention(dim, H)
    cache = attn.make_cache(B, ctx + 1)
    with torch.no_grad():
        cache.k.normal_()
        cache.v.normal_()
        cache.lengths.fill_(ctx - 1)  # the step's token is the ctx-th: it reads ctx keys
        x = torch.randn(B, 1, dim)
        qkv = attn.qkv(x)
        start = cache.lengths.clone()
        end = start + 1

        def layer_step() -> None:
            cache.lengths.copy_(start)
            attn(x, cache=cache)

        def attention_op() -> None:
            torch.ops.causal_attention.decode_attention(qkv, cache.k, cache.v, start, end, H)

        # The ceiling, interleaved with them: a copy of as many bytes as K and V hold.
        src, dst = torch.randn(2 * B * H * ctx * hd), torch.empty(2 * B * H * ctx * hd)
        t = interleaved_medians({"layer": layer_step, "op": attention_op, "copy": lambda: dst.copy_(src)},
                                repeats=repeats, warmup=2)
    kv_bytes = 2 * B * H * ctx * hd * 4
    copy_gbs = 2 * kv_bytes / t["copy"] / 1e9  # read + write
    for name, label in (("layer", "decode step: whole layer"), ("op", "decode step: attention op")):
        gbs = kv_bytes / t[name] / 1e9
        rows.append({"row": label, "ms": t[name] * 1e3, "kv_GB_per_s": gbs, "of_copy": gbs / copy_gbs,
                     "copy_GB_per_s": copy_gbs, "shape": f"B={B} ctx={ctx} dim={dim} H={H} float32"})

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, max_len=1100, dim=256, n_layers=4, n_heads=4)).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1024, 1000, 990, 1012)]
    new_tokens = 32
    t = interleaved_medians({
        "cache": lambda: model.generate(prompts, new_tokens),
        "nocache": lambda: model.generate(prompts, new_tokens, use_cache=False),
    }, repeats=3, warmup=1)
    produced = len(prompts) * new_tokens
    rows.append({"row": "generate, KV cache", "ms": t["cache"] * 1e3, "tokens_per_s": produced / t["cache"],
                 "speedup": t["nocache"] / t["cache"], "shape": "TinyGPT dim=256 L=4, 4 prompts ~1024 + 32 new"})
    rows.append({"row": "generate, no cache", "ms": t["nocache"] * 1e3, "tokens_per_s": produced / t["nocache"],
                 "speedup": 1.0, "shape": "recomputes the prefix every step"})
    return rows


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _rows(level: str, dtype: torch.dtype, T: int, mask_name: str, fwd: dict[str, float], fwd_bwd: dict[str, float] | None,
          flops: float, mm_gflops: float, baseline: str) -> list[Row]:
    rows = []
    for impl, t in fwd.items():
        tb = None if fwd_bwd is None else fwd_bwd[impl]
        rows.append(Row(
            level=level, dtype=_name(dtype), T=T, mask=mask_name, impl=impl, fwd_ms=t * 1e3,
            fwd_bwd_ms=None if tb is None else tb * 1e3, fwd_speedup=fwd[baseline] / t,
            fwd_bwd_speedup=None if fwd_bwd is None or tb is None else fwd_bwd[baseline] / tb,
            fwd_gflops=flops / t / 1e9, fwd_ceiling_fraction=flops / t / 1e9 / mm_gflops, baseline=baseline,
        ))
    return rows


def run_bench(*, lengths: list[int], B: int = 4, H: int = 12, hd: int = 64, repeats: int = 5,
              dtypes: tuple[torch.dtype, ...] = (torch.float32,), memory_lengths: tuple[int, ...] = (4096, 8192),
              backward: bool = True, decode: bool = True) -> Report:
    report = Report(B=B, H=H, hd=hd, threads=torch.get_num_threads(),
                    capability=str(torch.ops.causal_attention.cpu_capability()),
                    mm_gflops={_name(dt): mm_ceiling(dt) for dt in dtypes}, copy_gbs=copy_ceiling())
    report.skipped.append(f"reference and nn.MultiheadAttention above T={MATERIALISING_MAX_T}: they materialise "
                          "B*H*T*T scores (6+ GB with their backward at T=4096)")
    dim = H * hd
    gen = torch.Generator().manual_seed(0)
    steps = [(dt, T, m) for dt in dtypes for T in lengths for m in ("causal", "padded")]
    with Progress(transient=True) as progress:
        task = progress.add_task("bench", total=len(steps) + len(memory_lengths) + int(decode))
        for dtype, T, mask_name in steps:
            progress.update(task, description=f"{str(dtype)[6:]} T={T} {mask_name}")
            mask = None if mask_name == "causal" else _padded_mask(B, T, gen)
            attn_flops = 2 * B * H * T * T * hd
            baseline = "sdpa(is_causal)" if mask is None else "sdpa(bool mask)"
            qkv = torch.randn(B, T, 3 * dim, dtype=dtype)
            impls = _kernel_impls(T, H, hd, mask)
            fwd = _timed(impls, qkv, repeats, backward=False)
            fb = _timed(impls, qkv, max(3, repeats // 2), backward=True) if backward else None
            mm_gflops = report.mm_gflops[_name(dtype)]
            report.rows += _rows("kernel", dtype, T, mask_name, fwd, fb, attn_flops, mm_gflops, baseline)
            x = torch.randn(B, T, dim, dtype=dtype)
            mimpls = _module_impls(T, dim, H, mask, dtype)
            mbase = "nn.MultiheadAttention" if "nn.MultiheadAttention" in mimpls else "ours"
            fwd = _timed(mimpls, x, repeats, backward=False)
            fb = _timed(mimpls, x, max(3, repeats // 2), backward=True) if backward else None
            report.rows += _rows("module", dtype, T, mask_name, fwd, fb, attn_flops + 8 * B * T * dim * dim,
                                 mm_gflops, mbase)
            progress.advance(task)
        for T in memory_lengths:
            progress.update(task, description=f"memory T={T}")
            report.memory.append({"T": T, **{impl: peak_extra_mb(impl, B, T, H, hd) for impl in ("ours", "sdpa(bool mask)")}})
            progress.advance(task)
        if decode:
            progress.update(task, description="decode")
            report.decode = decode_rows()
            progress.advance(task)
    return report


_MEMORY_SCRIPT = """
import sys, torch, causal_attention
from causal_attention.bench import _kernel_impls, _padded_mask, _peak_rss_mb, _rss_mb
impl, B, T, H, hd = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads({threads})
mask = _padded_mask(B, T, torch.Generator().manual_seed(0))
fn = _kernel_impls(T, H, hd, mask)[impl]
qkv = torch.randn(B, T, 3 * H * hd, requires_grad=True)
g = torch.randn(B, T, H * hd)
before = _rss_mb()
fn(qkv).backward(g)
print(_peak_rss_mb() - before)
"""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    """High-water resident set of this process (VmHWM: unlike ru_maxrss, not inherited over fork)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def peak_extra_mb(impl: str, B: int, T: int, H: int, hd: int) -> float:
    """Peak resident memory of one forward+backward above what was resident before it, in MiB."""
    script = _MEMORY_SCRIPT.format(threads=torch.get_num_threads())
    out = subprocess.run([sys.executable, "-c", script, impl, str(B), str(T), str(H), str(hd)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def print_report(report: Report, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 160))
    console.print(f"B={report.B} H={report.H} head_dim={report.hd}, {report.threads} threads, kernel ISA "
                  f"{report.capability}; ceiling: torch.mm "
                  + ", ".join(f"{dt} {v:.0f} GFLOP/s" for dt, v in report.mm_gflops.items())
                  + f"; copy {report.copy_gbs:.1f} GB/s")
    table = Table(title="causal_attention bench (medians of interleaved runs; x = baseline time / time)")
    for col in ("level", "dtype", "T", "mask", "impl", "fwd ms", "fwd x", "fwd+bwd ms", "fwd+bwd x", "fwd GFLOP/s",
                "of mm", "baseline"):
        table.add_column(col, justify="left" if col in ("level", "dtype", "mask", "impl", "baseline") else "right")
    for r in report.rows:
        table.add_row(r.level, r.dtype, str(r.T), r.mask, r.impl, f"{r.fwd_ms:.2f}", f"{r.fwd_speedup:.2f}x",
                      "-" if r.fwd_bwd_ms is None else f"{r.fwd_bwd_ms:.2f}",
                      "-" if r.fwd_bwd_speedup is None else f"{r.fwd_bwd_speedup:.2f}x",
                      f"{r.fwd_gflops:.0f}", f"{100 * r.fwd_ceiling_fraction:.0f}%", r.baseline)
    console.print(table)
    if report.memory:
        mem = Table(title="extra peak memory of the kernel's forward+backward (MiB, padded, float32)")
        impls = [k for k in report.memory[0] if k != "T"]
        for col in ["T", *impls]:
            mem.add_column(col, justify="right")
        for m in report.memory:
            mem.add_row(str(m["T"]), *(f"{m[i]:.0f}" for i in impls))
        if len(report.memory) >= 2:
            a, b = report.memory[0], report.memory[-1]
            mem.caption = "growth " + ", ".join(f"{i}: {b[i] / a[i]:.2f}x" for i in impls) + f" from T={a['T']} to T={b['T']}"
        console.print(mem)
    if report.decode:
        dec = Table(title="generation (of copy: K and V bytes read per second over a same-size copy's bytes per "
                          "second, interleaved)")
        for col in ("row", "ms", "K+V GB/s", "of copy", "tokens/s", "x vs no cache", "shape"):
            dec.add_column(col, justify="left" if col in ("row", "shape") else "right")
        for d in report.decode:
            dec.add_row(str(d["row"]), f"{d['ms']:.2f}",
                        f"{d['kv_GB_per_s']:.1f}" if "kv_GB_per_s" in d else "-",
                        f"{100 * float(d['of_copy']):.0f}%" if "of_copy" in d else "-",
                        f"{d['tokens_per_s']:,.0f}" if "tokens_per_s" in d else "-",
                        f"{d['speedup']:.1f}x" if "speedup" in d else "-", str(d["shape"]))
        console.print(dec)
    for s in report.skipped:
        console.print(f"skipped: {s}")


def plot_report(report: Report, path: Path) -> None:
    """Time against T per implementation: one panel per (level, mask, pass), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype = report.rows[0].dtype
    panels = [(lvl, m, p) for lvl in ("kernel", "module") for m in ("causal", "padded") for p in ("fwd", "fwd+bwd")]
    fig, axes = plt.subplots(2, 4, figsize=(20, 9))
    impls = list(dict.fromkeys(r.impl for r in report.rows))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}  # one colour per implementation everywhere
    for ax, (lvl, m, p) in zip(axes.flat, panels):
        rows = [r for r in report.rows if r.level == lvl and r.mask == m and r.dtype == dtype]
        for impl in dict.fromkeys(r.impl for r in rows):
            pts = [(r.T, r.fwd_ms if p == "fwd" else r.fwd_bwd_ms) for r in rows if r.impl == impl]
            pts = [(t, v) for t, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, color=colors[impl])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{lvl}, {m}, {p}")
        ax.set_xlabel("T")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"causal_attention vs PyTorch: B={report.B} H={report.H} hd={report.hd} {dtype}, "
                 f"{report.threads} threads (padded: lengths uniform in [T/2, T])")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(*, lengths: list[int], repeats: int, json_path: Path | None, plot_path: Path | None, bf16: bool,
         memory: bool, backward: bool, decode: bool) -> Report:
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    report = run_bench(lengths=lengths, repeats=repeats, dtypes=dtypes,
                       memory_lengths=(4096, 8192) if memory else (), backward=backward, decode=decode)
    print_report(report)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(asdict(report), indent=2))
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, plot_path)
        print(f"plot: {plot_path}")
    return report

