"""python -m causal_attention check: exactness and speed of the layer at GPT-sized shapes.

For each shape (no padding and right padding, lengths uniform in [T/2, T]), float32:
the max error of each backend against nn.MultiheadAttention (same weights) and against the
float64 reference, and the median time of forward and forward+backward beside
nn.MultiheadAttention, from interleaved runs in this process.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import Tensor, nn

from ..attention import backends, reference
from ..attention.module import CausalSelfAttention
from .bench.report import interleaved_medians

# (B, T, dim, n_heads): GPT-2 small widths at a few lengths.
SHAPES = [(4, 256, 768, 12), (2, 1024, 768, 12), (1, 512, 1024, 16)]
DEFAULT_SHAPES_TIME = "the default shapes take about 3 minutes on 2 cores"


@dataclass
class Row:
    shape: str
    mask: str
    impl: str
    err_vs_mha: float
    err_vs_ref64: float
    fwd_ms: float
    fwd_bwd_ms: float
    fwd_vs_mha: float  # nn.MultiheadAttention's time / this time, same shape and mask
    fwd_bwd_vs_mha: float


def _mha(attn: CausalSelfAttention) -> nn.MultiheadAttention:
    mha = nn.MultiheadAttention(attn.dim, attn.n_heads, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(attn.qkv.weight)
        mha.in_proj_bias.copy_(attn.qkv.bias)
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias)
    return mha


def _max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _fwd_bwd(fn: Callable[[Tensor], Tensor], x: Tensor, g: Tensor) -> Callable[[], None]:
    def run() -> None:
        xg = x.detach().requires_grad_()
        fn(xg).backward(g)

    return run


def _no_grad(fn: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn(x)

    return run


def run_check(*, repeats: int = 5, shapes: list[tuple[int, int, int, int]] | None = None,
              console: Console | None = None) -> list[Row]:
    """Rows for every (B, T, dim, n_heads) of shapes (default SHAPES), without and with padding.
    Progress goes to console (default stderr): a bar on a terminal, else a line per shape and mask."""
    shapes = shapes or SHAPES
    console = console or Console(stderr=True, soft_wrap=True)  # a line per step, unwrapped
    total = 2 * len(shapes)
    console.print(f"check: {len(shapes)} shape(s) x 2 masks (none, right padding), float32: errors, then "
                  f"forward and forward+backward timed in {repeats} interleaved rounds"
                  + (f"; {DEFAULT_SHAPES_TIME}" if shapes == SHAPES else ""))
    rows: list[Row] = []
    # The bar draws on a terminal only (elsewhere it would print one blank line): else a line a step.
    progress = Progress(console=console, transient=True, disable=not console.is_terminal)
    with progress:
        task = progress.add_task("check", total=total)
        done = 0
        for B, T, dim, H in shapes:
            for mask_kind in ("none", "right"):
                description = f"B={B} T={T} dim={dim} H={H} mask={mask_kind}"
                progress.update(task, description=description)
                if not console.is_terminal:
                    console.print(f"check {done + 1}/{total}: {description}")
                rows += _check_one(B, T, dim, H, mask_kind, repeats)
                progress.advance(task)
                done += 1
    return rows


def _check_one(B: int, T: int, dim: int, H: int, mask_kind: str, repeats: int) -> list[Row]:
    torch.manual_seed(0)
    attn = CausalSelfAttention(dim, H)
    mha = _mha(attn)
    x = torch.randn(B, T, dim)
    mask = None
    if mask_kind == "right":
        lengths = torch.randint(T // 2, T + 1, (B, 1))
        mask = torch.arange(T)[None, :] < lengths  # (B, T), True = real
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    kpm = None if mask is None else ~mask

    def mha_fn(inp: Tensor) -> Tensor:
        return mha(inp, inp, inp, attn_mask=causal, key_padding_mask=kpm, need_weights=False)[0]

    impls: dict[str, Callable[[Tensor], Tensor]] = {"nn.MultiheadAttention": mha_fn}
    for name in backends.BACKENDS:
        if not backends.unsupported_reasons(name, x):
            impls[f"ours:{name}"] = lambda inp, name=name: _with_backend(attn, name, inp, mask)

    with torch.no_grad():
        w64 = [p.double() for p in (attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias)]
        exact = reference.causal_self_attention(x.double(), *w64, H, mask)
        y_mha = mha_fn(x)
        outs = {name: fn(x) for name, fn in impls.items()}
    g = torch.randn_like(y_mha)
    fwd = interleaved_medians({n: _no_grad(fn, x) for n, fn in impls.items()}, repeats=repeats)
    fwd_bwd = interleaved_medians({n: _fwd_bwd(fn, x, g) for n, fn in impls.items()}, repeats=repeats)
    shape = f"B={B} T={T} dim={dim} H={H}"
    mha = "nn.MultiheadAttention"
    return [
        Row(shape, mask_kind, name, _max_err(outs[name], y_mha), _max_err(outs[name], exact),
            fwd[name] * 1e3, fwd_bwd[name] * 1e3, fwd[mha] / fwd[name], fwd_bwd[mha] / fwd_bwd[name])
        for name in impls
    ]


def _with_backend(attn: CausalSelfAttention, backend: str, x: Tensor, mask: Tensor | None) -> Tensor:
    saved = attn.backend
    attn.backend = backend  # type: ignore[assignment]
    try:
        return attn(x, mask)  # type: ignore[return-value]
    finally:
        attn.backend = saved


def print_rows(rows: list[Row], console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 150))
    threads = torch.get_num_threads()
    table = Table(title=f"causal_attention check (float32, {threads} thread{'s' if threads != 1 else ''}; "
                  "times are medians of interleaved runs)")
    for col in ("shape", "mask", "impl", "max err vs MHA", "max err vs ref f64", "fwd ms", "fwd+bwd ms",
                "fwd+bwd vs MHA"):
        table.add_column(col, justify="left" if col in ("shape", "mask", "impl") else "right")
    for row in rows:
        table.add_row(row.shape, row.mask, row.impl, f"{row.err_vs_mha:.1e}", f"{row.err_vs_ref64:.1e}",
                      f"{row.fwd_ms:.2f}", f"{row.fwd_bwd_ms:.2f}", f"{row.fwd_bwd_vs_mha:.2f}x")
    console.print(table)


def main(*, repeats: int, json_path: Path | None, shapes: list[tuple[int, int, int, int]] | None = None) -> list[Row]:
    """Runs the check at shapes (default SHAPES), prints the table, writes the rows to json_path."""
    rows = run_check(repeats=repeats, shapes=shapes)
    print_rows(rows)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows
