"""``python -m causal_attention bench``: the fused kernel and the module against PyTorch's own.

Everything runs in this process, interleaved (round-robin, rotated), and is reported as medians;
the machines are noisy, so ratios within one run are the result, not absolute times. The ratios
that the targets read from two functions timed together (bfloat16 against float32, 1 thread against
2, a decode step against the copy) are medians of the per-round ratios (timing.paired_ratio).

Counting the work (every implementation is credited with the same useful FLOPs, whatever it
actually computes, so GFLOP/s compare like with like):
- attention forward, causal: 2*B*H*T^2*hd, half of the 4*B*H*T^2*hd of a full T x T attention
  (q k^T and P v are 2*T^2*hd each per head; causality keeps half of them); padding does not
  reduce the count;
- attention backward: 2.5x the forward (five T x T products instead of two);
- the module adds its projections, 8*B*T*dim^2 forward (qkv: 6*B*T*dim^2, proj: 2*B*T*dim^2);
- the ceiling is a large n x n torch.mm (2*n^3 FLOPs; n up to 2048, see mm_ceiling) at the same
  dtype, timed in every round of the rows' own forward timings; a row's "of mm" is the median over
  those rounds of its forward GFLOP/s over the product's in the same round (a ceiling measured once,
  at another moment, moved the fraction by 70-93% on a shared machine). For bfloat16 it is
  the faster of torch's bfloat16 mm and its float32 mm: a bfloat16 product is exactly a float32
  product of the widened operands, so the hardware's bfloat16 ceiling is never below sgemm's (on a
  CPU without bfloat16 dot products, torch's bfloat16 mm runs far below it);
- decode moves bytes, not FLOPs: a step reads the K and V of its context once, 2*B*H*ctx*hd
  elements; its GB/s is over a copy of as many float32 bytes (read + write) timed with it. The layer
  also reads its weights (qkv and proj, 4*dim^2 + 4*dim values) and writes the step's K and V rows:
  "all bytes" counts them too (for the op alone it equals K+V).

Rows:
- kernel: the attention core from a qkv tensor (B, T, 3*dim): ours; F.scaled_dot_product_attention
  with is_causal=True (no padding only) and with the combined (B, 1, T, T) bool mask; compiled
  FlexAttention with a causal (+ padding) BlockMask, forward only (it has no CPU backward); the reference.
- module: the whole layer: ours; nn.MultiheadAttention (need_weights=False) with the same masks.
- memory: extra peak memory (resident set) of the kernel's forward+backward, in a fresh process.
- generation: one decode step (the whole layer, and the attention op alone) in float32, bfloat16
  and float16, timed in one interleaved group (each call after an untimed read of twice the L3, at least
  64 MB: clean, cold caches, as a step finds them in a model), with each half-precision time against float32's;
  with them the float32 layer's step op by op (what its fused decode_layer op replaces) and the
  decode target's attainable best: one torch.sum over a buffer as large as what the float32
  layer reads (weights, K, V), credited with the same K and V bytes; then a tiny GPT generating with the
  KV cache and without it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import Tensor, nn

from ...attention import _ops
from ...attention.module import CausalSelfAttention
from ...attention.reference import attention_core
from .decode import DECODE_DTYPES, DECODE_READ_ROW, decode_rows
from .report import dtype_name as _name
from .report import interleaved_medians, interleaved_times, medians, paired_ratio, rounds_within

# Materialising B*H*T*T scores (reference, nn.MultiheadAttention) past this length costs many GB.
MATERIALISING_MAX_T = 2048
# The ceiling's product among a group's timings (not a row of its own).
CEILING = "torch.mm (ceiling)"


@dataclass
class Row:
    level: str  # kernel | module
    dtype: str
    T: int
    mask: str  # causal | padded
    impl: str
    fwd_ms: float
    fwd_bwd_ms: float | None
    fwd_speedup: float = 1.0  # baseline time / this time: the median of the rounds' ratios (paired_ratio)
    fwd_bwd_speedup: float | None = None
    fwd_gflops: float = 0.0
    fwd_ceiling_fraction: float = 0.0  # of the ceiling's product timed in the same rounds (median of rounds)
    ceiling_ms: float = 0.0  # that product's median time in those rounds
    baseline: str = ""


@dataclass
class Report:
    B: int
    H: int
    hd: int
    threads: int
    capability: str
    mm_gflops: dict[str, float]  # per dtype
    mm_n: dict[str, int]  # the size of the product that measured it
    copy_gbs: float
    # dtype -> what measured its ceiling when not its own torch.mm, and what its own measured
    mm_source: dict[str, str] = field(default_factory=dict)
    # dtype -> what runs the kernel's tile products of it (torch.ops.causal_attention.tile_products)
    products: dict[str, str] = field(default_factory=dict)
    # Whether the CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX); None: unknown.
    bf16_dot_products: bool | None = None
    rows: list[Row] = field(default_factory=list)
    memory: list[dict[str, float]] = field(default_factory=list)
    decode: list[dict[str, float | str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # fwd+bwd of our kernel at one T, padded, float32, on 1 thread and on all of them (interleaved).
    thread_scaling: dict[str, float] = field(default_factory=dict)
    # fwd+bwd of our kernel, padded, float32 against bfloat16 at each T (interleaved with each other).
    bf16_speedup: list[dict[str, float]] = field(default_factory=list)
    targets: list[dict[str, object]] = field(default_factory=list)


def mm_ceiling(dtype: torch.dtype, repeats: int = 5, *, max_n: int = 2048, enough_s: float = 0.2) -> tuple[float, int]:
    """(GFLOP/s, n) of a large n x n torch.mm at dtype, in this process: n doubles from 256 until
    one product takes enough_s or n reaches max_n (torch's bfloat16 mm without AVX512-BF16 runs
    at well under 1 GFLOP/s, where a 2048 product takes minutes and a 512 one is large enough)."""
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        start = time.perf_counter()
        torch.mm(a, b)
        if n >= max_n or time.perf_counter() - start >= enough_s:
            break
        n *= 2
    c = torch.empty(n, n, dtype=dtype)
    seconds = interleaved_medians({"mm": lambda: torch.mm(a, b, out=c)}, repeats=repeats)["mm"]
    return 2 * n**3 / seconds / 1e9, n


def bf16_dot_products() -> bool | None:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16), from the
    kernel's CPU flags (Linux); None where they cannot be read. Without them a bfloat16 product runs
    at float32's rate at best (widen, then float32 FMAs)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def copy_ceiling(repeats: int = 5) -> float:
    """GB/s (read + write) of a large tensor copy, in this process."""
    src, dst = torch.randn(64 * 2**20 // 4), torch.empty(64 * 2**20 // 4)
    return 2 * src.numel() * 4 / interleaved_medians({"copy": lambda: dst.copy_(src)}, repeats=repeats)["copy"] / 1e9


def _padded_mask(B: int, T: int, generator: torch.Generator) -> Tensor:
    lengths = torch.randint(T // 2, T + 1, (B, 1), generator=generator)  # uniform in [T/2, T]
    return torch.arange(T)[None, :] < lengths  # (B, T), True = real


def _timed(fns: dict[str, Callable[[Tensor], Tensor]], x: Tensor, repeats: int,
           backward: bool) -> dict[str, list[float]]:
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
    return interleaved_times({name: make(fn) for name, fn in fns.items()}, repeats=repeats, warmup=2)


FLEX = "flex_attention(compiled)"
FORWARD_ONLY = (FLEX,)  # no CPU backward: timed in the forward only


def _flex_impl(B: int, T: int, H: int, hd: int, mask: Tensor | None) -> Callable[[Tensor], Tensor]:
    """torch.compile(flex_attention) with a BlockMask for causal (+ key padding), built here,
    outside the timed region: what a PyTorch user picks for block-sparse masks on CPU (forward
    only). The first call of each shape and dtype compiles (the timing's warm-up rounds pay it)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if mask is None:
        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return q >= k
    else:
        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return (q >= k) & mask[b, k]
    block_mask = create_block_mask(mask_mod, B, None, T, T, device="cpu")
    # One compiled flex per shape (a fresh torch.compile; dynamo's recompile limit is raised by the
    # caller so that many shapes never fall back to the eager flex, which is orders slower).
    flex = torch.compile(flex_attention, dynamic=False)

    def run(qkv: Tensor) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in qkv.unflatten(2, (3, H, hd)).unbind(2))  # (B, H, T, hd)
        return flex(q, k, v, block_mask=block_mask).transpose(1, 2).flatten(2)  # type: ignore[union-attr]

    return run


def _kernel_impls(T: int, H: int, hd: int, mask: Tensor | None, *, B: int | None = None) -> dict[str, Callable[[Tensor], Tensor]]:
    """The attention-core implementations on qkv (B, T, 3 * H * hd); with B, also compiled
    FlexAttention (forward only)."""
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
    if B is not None:
        impls[FLEX] = _flex_impl(B, T, H, hd, mask)
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


def _ceiling_product(report: Report, dtype: torch.dtype) -> tuple[Callable[[Tensor], Tensor], float]:
    """The dtype's ceiling product as a timed function (its argument ignored) and its FLOPs: the n x n
    torch.mm that measured report.mm_gflops (float32's where that is bfloat16's ceiling)."""
    n = report.mm_n[_name(dtype)]
    mm_dtype = torch.float32 if _name(dtype) in report.mm_source else dtype
    a, b, c = torch.randn(n, n, dtype=mm_dtype), torch.randn(n, n, dtype=mm_dtype), torch.empty(n, n, dtype=mm_dtype)
    return (lambda _: torch.mm(a, b, out=c)), 2.0 * n**3  # into one buffer: no page faults timed


def _rows(level: str, dtype: torch.dtype, T: int, mask_name: str, fwd_times: dict[str, list[float]],
          fwd_bwd_times: dict[str, list[float]] | None, flops: float, ceiling_flops: float, baseline: str) -> list[Row]:
    """A row per implementation: median times, and speed-ups against the baseline round by round
    (paired_ratio: the machine's drift between rounds cancels, where a ratio of two medians taken
    from different rounds kept it); fwd_times holds the ceiling's product (CEILING) in the same rounds,
    each row's fraction of it taken round by round too."""
    fwd = medians({k: v for k, v in fwd_times.items() if k != CEILING})
    ceiling_ms = medians(fwd_times)[CEILING] * 1e3
    fwd_bwd = None if fwd_bwd_times is None else medians(fwd_bwd_times)
    rows = []
    for impl, t in fwd.items():
        tb = None if fwd_bwd is None else fwd_bwd.get(impl)  # None: forward only
        rows.append(Row(
            level=level, dtype=_name(dtype), T=T, mask=mask_name, impl=impl, fwd_ms=t * 1e3,
            fwd_bwd_ms=None if tb is None else tb * 1e3, fwd_speedup=paired_ratio(fwd_times, baseline, impl),
            fwd_bwd_speedup=None if fwd_bwd_times is None or tb is None else paired_ratio(fwd_bwd_times, baseline, impl),
            fwd_gflops=flops / t / 1e9, fwd_ceiling_fraction=paired_ratio(fwd_times, CEILING, impl) * flops / ceiling_flops,
            ceiling_ms=ceiling_ms, baseline=baseline,
        ))
    return rows


def _new_report(B: int, H: int, hd: int, dtypes: tuple[torch.dtype, ...]) -> Report:
    """An empty report holding this machine's ceilings: torch.mm per dtype and a large copy."""
    ceilings = {_name(dt): mm_ceiling(dt) for dt in dtypes}
    sources = {}
    if "bfloat16" in ceilings:  # never below sgemm's: see the module docstring
        f32 = ceilings.get("float32") or mm_ceiling(torch.float32)
        if f32[0] > ceilings["bfloat16"][0]:
            sources["bfloat16"] = f"float32 mm; torch's bfloat16 mm: {ceilings['bfloat16'][0]:.0f} GFLOP/s"
            ceilings["bfloat16"] = f32
    return Report(B=B, H=H, hd=hd, threads=torch.get_num_threads(),
                  capability=str(torch.ops.causal_attention.cpu_capability()),
                  products={_name(dt): str(torch.ops.causal_attention.tile_products(dt)) for dt in dtypes},
                  mm_gflops={k: v[0] for k, v in ceilings.items()}, mm_n={k: v[1] for k, v in ceilings.items()},
                  copy_gbs=copy_ceiling(), mm_source=sources, bf16_dot_products=bf16_dot_products())


def run_bench(*, lengths: list[int], B: int = 4, H: int = 12, hd: int = 64, repeats: int = 5,
              dtypes: tuple[torch.dtype, ...] = (torch.float32,), memory_lengths: tuple[int, ...] = (4096, 8192),
              backward: bool = True, decode_shape: tuple[int, int, int, int] | None = (8, 2048, 768, 12),
              decode_dtypes: tuple[torch.dtype, ...] = DECODE_DTYPES, flex: bool = True,
              module: bool = True) -> Report:
    """The kernel rows, and with module the module rows, for every dtype and T (causal and padded;
    with flex, compiled FlexAttention among the kernels), peak memory at memory_lengths, and the
    generation rows at decode_shape = (B, ctx, dim, H) unless None."""
    report = _new_report(B, H, hd, dtypes)
    report.skipped.append(f"reference and nn.MultiheadAttention above T={MATERIALISING_MAX_T}: they materialise "
                          "B*H*T*T scores (6+ GB with their backward at T=4096)")
    dim = H * hd
    gen = torch.Generator().manual_seed(0)
    steps = [(dt, T, m) for dt in dtypes for T in lengths for m in ("causal", "padded")]
    with Progress(transient=True) as progress:
        task = progress.add_task("bench", total=len(steps) + len(memory_lengths) + int(decode_shape is not None))

        def step(description: str) -> None:
            progress.update(task, description=description)
            if not progress.console.is_terminal:  # piped: no live bar, so a line per step
                progress.console.log(description)

        for dtype, T, mask_name in steps:
            step(f"{str(dtype)[6:]} T={T} {mask_name}")
            mask = None if mask_name == "causal" else _padded_mask(B, T, gen)
            attn_flops = 2 * B * H * T * T * hd
            baseline = "sdpa(is_causal)" if mask is None else "sdpa(bool mask)"
            qkv = torch.randn(B, T, 3 * dim, dtype=dtype)
            impls = _kernel_impls(T, H, hd, mask, B=B if flex else None)
            ceiling, ceiling_flops = _ceiling_product(report, dtype)
            with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
                fwd = _timed({**impls, CEILING: ceiling}, qkv, repeats, backward=False)
            trainable = {k: fn for k, fn in impls.items() if k not in FORWARD_ONLY}
            # As many rounds as the forward: fewer left the fwd+bwd ratios unstable from run to run.
            fb = _timed(trainable, qkv, repeats, backward=True) if backward else None
            report.rows += _rows("kernel", dtype, T, mask_name, fwd, fb, attn_flops, ceiling_flops, baseline)
            if not module:
                progress.advance(task)
                continue
            x = torch.randn(B, T, dim, dtype=dtype)
            mimpls = _module_impls(T, dim, H, mask, dtype)
            mbase = "nn.MultiheadAttention" if "nn.MultiheadAttention" in mimpls else "ours"
            fwd = _timed({**mimpls, CEILING: ceiling}, x, repeats, backward=False)
            fb = _timed(mimpls, x, max(3, repeats // 2), backward=True) if backward else None
            report.rows += _rows("module", dtype, T, mask_name, fwd, fb, attn_flops + 8 * B * T * dim * dim,
                                 ceiling_flops, mbase)
            progress.advance(task)
        for T in memory_lengths:
            step(f"memory T={T}")
            report.memory.append({"T": T, **{impl: peak_extra_mb(impl, B, T, H, hd) for impl in ("ours", "sdpa(bool mask)")}})
            progress.advance(task)
        scaling_T = max((T for T in lengths if T <= 2048), default=None)
        if backward and scaling_T is not None and report.threads > 1:
            step(f"threads 1 vs {report.threads}, T={scaling_T}")
            report.thread_scaling = thread_scaling(B, scaling_T, H, hd, report.threads,
                                                   repeats=side_by_side_repeats(repeats), generator=gen)
        if backward and torch.bfloat16 in dtypes and torch.float32 in dtypes:
            for T in (T for T in lengths if T in BF16_SPEEDUP_T):
                step(f"float32 vs bfloat16, T={T}")
                report.bf16_speedup.append(bf16_speedup(B, T, H, hd, repeats=side_by_side_repeats(repeats),
                                                        generator=gen))
        if decode_shape is not None:
            step("decode")
            dB, ctx, ddim, dH = decode_shape
            report.decode = decode_rows(B=dB, ctx=ctx, dim=ddim, H=dH, dtypes=decode_dtypes)
            progress.advance(task)
    report.targets = targets(report)
    return report


# The lengths at which the bfloat16 target compares the two dtypes side by side.
BF16_SPEEDUP_T = (1024, 2048, 4096)


def side_by_side_repeats(repeats: int) -> int:
    """The fewest rounds for the two-function comparisons that targets read directly (bfloat16 against
    float32, 1 thread against all): at least 7, so that the median of the paired ratios is one of 7+
    rounds (at 3-5 rounds the same code gave 1.73-1.85x bfloat16 against float32 at T=2048 from run to
    run)."""
    return max(7, repeats)


# Those comparisons run as many rounds as fit in this many seconds (a warm-up round sets the pace),
# up to SIDE_BY_SIDE_MAX_ROUNDS: at T=1024, 25 rounds of bfloat16 against float32 (0.24 s a round)
# spread their paired ratios over 1.68-2.14, of which a median of 7 is a loose reading; at T=4096
# (several seconds a round) the minimum holds. (Between processes float32's page faults still move
# that ratio, 1.71x to 2.01x over 25 rounds each: README, bfloat16.)
SIDE_BY_SIDE_BUDGET_S = 8.0
SIDE_BY_SIDE_MAX_ROUNDS = 25


def _side_by_side(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    rounds = rounds_within(fns, budget_s=SIDE_BY_SIDE_BUDGET_S, minimum=side_by_side_repeats(repeats),
                           maximum=max(SIDE_BY_SIDE_MAX_ROUNDS, side_by_side_repeats(repeats)))
    return interleaved_times(fns, repeats=rounds, warmup=0)


def bf16_speedup(B: int, T: int, H: int, hd: int, *, repeats: int, generator: torch.Generator) -> dict[str, float]:
    """Our kernel's fwd+bwd (padded) in float32 and in bfloat16 on the same inputs, interleaved with each
    other (the kernel rows time each dtype in its own group, minutes apart on a machine whose speed
    drifts): median milliseconds and the speed-up (float32 time / bfloat16 time, round by round:
    paired_ratio), over at least `repeats` rounds and as many more as fit in SIDE_BY_SIDE_BUDGET_S."""
    mask = _padded_mask(B, T, generator)
    qkv = torch.randn(B, T, 3 * H * hd)
    g = torch.randn(B, T, H * hd)

    def step(dtype: torch.dtype) -> Callable[[], None]:
        x, dy = qkv.to(dtype), g.to(dtype)
        return lambda: _ops.attention(x.detach().requires_grad_(), mask, H).backward(dy)

    times = _side_by_side({"float32": step(torch.float32), "bfloat16": step(torch.bfloat16)}, repeats)
    t = medians(times)
    return {"T": T, "float32_ms": t["float32"] * 1e3, "bfloat16_ms": t["bfloat16"] * 1e3,
            "speedup": paired_ratio(times, "float32", "bfloat16"), "rounds": len(times["float32"])}


def thread_scaling(B: int, T: int, H: int, hd: int, threads: int, *, repeats: int,
                   generator: torch.Generator) -> dict[str, float]:
    """Our kernel's fwd+bwd (float32, padded) on 1 thread and on `threads`, interleaved: median
    milliseconds and the speed-up (1-thread time / threads' time, round by round: paired_ratio), over at
    least `repeats` rounds and as many more as fit in SIDE_BY_SIDE_BUDGET_S."""
    mask = _padded_mask(B, T, generator)
    qkv = torch.randn(B, T, 3 * H * hd)
    g = torch.randn(B, T, H * hd)

    def on(n: int) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(n)
            _ops.attention(qkv.detach().requires_grad_(), mask, H).backward(g)

        return run

    try:
        times = _side_by_side({"1": on(1), str(threads): on(threads)}, repeats)
    finally:
        torch.set_num_threads(threads)
    t = medians(times)
    return {"T": T, "threads": threads, "one_thread_ms": t["1"] * 1e3, "all_threads_ms": t[str(threads)] * 1e3,
            "speedup": paired_ratio(times, "1", str(threads)), "rounds": len(times["1"])}


def _rounds_note(side_by_side: dict[str, float]) -> str:
    """'median of N paired rounds' for a side-by-side comparison that says how many it ran."""
    return f"median of {int(side_by_side['rounds'])} paired rounds" if "rounds" in side_by_side else ""


# The performance targets (B=4, H=12, hd=64, padding lengths U[T/2, T]): (what, target, how the
# report gives it); a row appears when its rows were measured.
def targets(report: Report) -> list[dict[str, object]]:
    """Each performance target that this report measured: value, target, met."""

    def row(level: str, dtype: str, T: int, mask: str, impl: str) -> Row | None:
        return next((r for r in report.rows if (r.level, r.dtype, r.T, r.mask, r.impl) == (level, dtype, T, mask, impl)),
                    None)

    out: list[dict[str, object]] = []

    def add(what: str, value: float | None, target: float, unit: str, note: str = "") -> None:
        if value is not None:
            out.append({"target": what, "value": value, "goal": target, "unit": unit, "met": value >= target,
                        "note": note})

    ours = lambda dt, T, m: row("kernel", dt, T, m, "ours")  # noqa: E731
    for T in (2048,):
        r = ours("bfloat16", T, "padded")
        add(f"bf16 forward, of same-run bf16 GEMM ceiling, T={T}", r and r.fwd_ceiling_fraction, 0.55, "fraction")
    no_dots = "" if report.bf16_dot_products is not False else \
        "this CPU has no bf16 dot products: bf16 products run at f32's rate (ceiling ~1x)"
    side_by_side = {int(s["T"]): s for s in report.bf16_speedup}
    for T in sorted({r.T for r in report.rows} | set(side_by_side)):
        f32, bf16 = ours("float32", T, "padded"), ours("bfloat16", T, "padded")
        if T in side_by_side:  # timed side by side (interleaved)
            add(f"bf16 fwd+bwd vs f32 fwd+bwd, T={T}", side_by_side[T]["speedup"], 1.8, "x",
                "; ".join(x for x in (_rounds_note(side_by_side[T]), no_dots) if x))
        elif f32 and bf16 and f32.fwd_bwd_ms and bf16.fwd_bwd_ms and T in BF16_SPEEDUP_T:
            add(f"bf16 fwd+bwd vs f32 fwd+bwd, T={T}", f32.fwd_bwd_ms / bf16.fwd_bwd_ms, 1.8, "x", no_dots)
    for T in (1024, 2048):
        r = ours("float32", T, "padded")
        add(f"f32 padded forward vs SDPA(bool mask), T={T}", r and r.fwd_speedup, 2.3, "x")
    for T in (2048, 4096):
        r = ours("float32", T, "causal")
        add(f"f32 causal fwd+bwd vs SDPA(is_causal), T={T}", r and r.fwd_bwd_speedup, 1.3, "x")
    # The causal row: a padded one is credited with the FLOPs of the keys it skips.
    r = ours("float32", 2048, "causal")
    add("f32 causal forward, of same-run sgemm, T=2048", r and r.fwd_ceiling_fraction, 0.85, "fraction")
    for dt, goal in (("float32", 1.8), ("bfloat16", 4.0)):
        for T in (1024, 2048):
            r, f = ours(dt, T, "padded"), row("kernel", dt, T, "padded", FLEX)
            add(f"{'f32' if dt == 'float32' else 'bf16'} forward vs FlexAttention, T={T}",
                r and f and f.fwd_ms / r.fwd_ms, goal, "x")
    layer = next((d for d in report.decode if d["row"] == "decode step: whole layer" and d["dtype"] == "float32"), None)
    read = next((d for d in report.decode if d["row"] == DECODE_READ_ROW), None)
    add(f"decode step, whole layer, f32, of copy bandwidth ({layer['shape']})" if layer else "",
        float(layer["of_copy"]) if layer else None, 0.85, "fraction",
        f"one read of as many bytes as the layer's: {float(read['of_copy']):.0%}; the layer is at "
        f"{float(layer['of_copy']) / float(read['of_copy']):.0%} of that" if layer and read else "")
    if report.thread_scaling:
        s = report.thread_scaling
        add(f"1 -> {int(s['threads'])} threads, fwd+bwd T={int(s['T'])}", s["speedup"], 0.925 * s["threads"], "x",
            _rounds_note(s))
    return out


_MEMORY_SCRIPT = """
import sys, torch, causal_attention
from causal_attention.tools.bench.kernel import _kernel_impls, _padded_mask, _peak_rss_mb, _rss_mb
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
                  f"{report.capability} (tile products: "
                  + ", ".join(f"{dt} {p}" for dt, p in report.products.items()) + f"); ceiling: torch.mm (as measured first; each row's \"of mm\" is against it in the "
                  "row's own rounds) "
                  + ", ".join(f"{dt} {v:.0f} GFLOP/s (n={report.mm_n[dt]}"
                              + (f"; {report.mm_source[dt]})" if dt in report.mm_source else ")")
                              for dt, v in report.mm_gflops.items())
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
        dec = Table(title="generation (vs f32: float32 time / this time; of copy: K and V bytes read per second "
                          "over a float32 K+V-size copy's bytes per second; all bytes: with the layer's weights "
                          "and the rows it writes; all interleaved)")
        for col in ("row", "dtype", "ms", "vs f32", "K+V GB/s", "of copy", "all bytes of copy", "tokens/s",
                    "x vs no cache", "shape"):
            dec.add_column(col, justify="left" if col in ("row", "dtype", "shape") else "right")
        for d in report.decode:
            dec.add_row(str(d["row"]), str(d["dtype"]), f"{d['ms']:.3f}",
                        f"{d['vs_f32']:.2f}x" if "vs_f32" in d else "-",
                        f"{d['kv_GB_per_s']:.1f}" if "kv_GB_per_s" in d else "-",
                        f"{100 * float(d['of_copy']):.0f}%" if "of_copy" in d else "-",
                        f"{100 * float(d['all_of_copy']):.0f}%" if "all_of_copy" in d else "-",
                        f"{d['tokens_per_s']:,.0f}" if "tokens_per_s" in d else "-",
                        f"{d['speedup']:.1f}x" if "speedup" in d else "-", str(d["shape"]))
        console.print(dec)
    if report.targets:
        tg = Table(title="performance targets (padded: lengths uniform in [T/2, T])")
        for col in ("target", "value", "goal", "met", "note"):
            tg.add_column(col, justify="left" if col in ("target", "note") else "right")
        for t in report.targets:
            fmt = (lambda v: f"{100 * v:.0f}%") if t["unit"] == "fraction" else (lambda v: f"{v:.2f}x")
            tg.add_row(str(t["target"]), fmt(float(t["value"])), fmt(float(t["goal"])), "yes" if t["met"] else "NO",
                       str(t.get("note", "")))
        console.print(tg)
    for s in report.skipped:
        console.print(f"skipped: {s}")


def plot_report(report: Report, path: Path) -> None:
    """Time against T per implementation: one panel per (level, mask, pass), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype = report.rows[0].dtype
    levels = [lvl for lvl in ("kernel", "module") if any(r.level == lvl for r in report.rows)]  # --no-module
    panels = [(lvl, m, p) for lvl in levels for m in ("causal", "padded") for p in ("fwd", "fwd+bwd")]
    fig, axes = plt.subplots(len(levels), 4, figsize=(20, 4.5 * len(levels)), squeeze=False)
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
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"causal_attention vs PyTorch: B={report.B} H={report.H} hd={report.hd} {dtype}, "
                 f"{report.threads} threads (padded: lengths uniform in [T/2, T])")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(*, lengths: list[int], repeats: int, json_path: Path | None, plot_path: Path | None, bf16: bool,
         memory_lengths: list[int], backward: bool, decode_shape: tuple[int, int, int, int] | None,
         B: int = 4, H: int = 12, hd: int = 64, flex: bool = True, module: bool = True) -> Report:
    """Runs the bench (bf16: also the bfloat16 kernel and module rows), prints the tables, writes
    the report as JSON and the time-vs-T plot as PNG where paths are given. The generation rows,
    unless decode_shape is None, are always in float32, bfloat16 and float16."""
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    report = run_bench(lengths=lengths, B=B, H=H, hd=hd, repeats=repeats, dtypes=dtypes,
                       memory_lengths=tuple(memory_lengths), backward=backward, decode_shape=decode_shape, flex=flex,
                       module=module)
    print_report(report)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(asdict(report), indent=2))
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, plot_path)
        print(f"plot: {plot_path}")
    return report

