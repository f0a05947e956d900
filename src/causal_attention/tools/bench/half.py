"""Half precision against its float32 twin on this CPU: a half model should never be slower.

Rows, each timed interleaved with the same model in float32 (same weights, rounded) in one process:
the layer's forward+backward (B=4, T=1024, dim 768, 12 heads, right-padded to lengths U[T/2, T]) and
GPT-2 124M's prefill of 512 tokens (B=1, logits everywhere, no autograd), in bfloat16 and float16.
Each section names the engine's instruction set and the route of the projections: ATen's half GEMMs
where the CPU has arithmetic in the dtype (torch.ops.causal_attention.half_arithmetic), else the
engine's widened products (half operands widened exactly to float32 as the engine's AVX2 / AVX-512 GEMM
packs them, "panels", or a block at a time for oneDNN's inner product or sgemm in other builds:
torch.ops.causal_attention.widened_products); the prefill's also its
float32 twin's (oneDNN's inner product or ATen's: torch.ops.causal_attention.float32_products).

x = float32's time / the half model's (above 1: half is faster).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console

from ...attention.module import CausalSelfAttention
from ...models import GPT, GPTConfig
from .report import Row, dtype_name, interleaved_times, medians, paired_ratio, plot_rows, print_rows

FULL = dict(B=4, T=1024, dim=768, H=12, prefill=512, gpt=dict(vocab_size=50257, max_len=1024, dim=768,
                                                               n_layers=12, n_heads=12, activation="gelu_tanh"))
QUICK = dict(B=2, T=64, dim=64, H=4, prefill=32, gpt=dict(vocab_size=101, max_len=64, dim=64, n_layers=2,
                                                          n_heads=4, activation="gelu_tanh"))
HALF_DTYPES = (torch.bfloat16, torch.float16)


def route(dtype: torch.dtype) -> str:
    """How the layer and the GPT compute their projections in dtype on this CPU."""
    if torch.ops.causal_attention.half_arithmetic(dtype):
        return "projections: ATen's half GEMMs"
    return f"projections: widened to float32, {torch.ops.causal_attention.widened_products()}"


def _row(section: str, name: str, times: dict[str, list[float]]) -> Row:
    m = medians(times)
    return Row(section, name, m["half"] * 1e3, m["float32"] * 1e3, paired_ratio(times, "float32", "half"))


def layer_rows(dtype: torch.dtype, *, repeats: int, quick: bool, say: Callable[[str], None]) -> list[Row]:
    shape = QUICK if quick else FULL
    B, T, dim, H = shape["B"], shape["T"], shape["dim"], shape["H"]
    torch.manual_seed(0)
    layers = {"float32": CausalSelfAttention(dim, H)}
    layers["half"] = copy.deepcopy(layers["float32"]).to(dtype)
    layers["float32"].load_state_dict({k: v.float() for k, v in layers["half"].state_dict().items()})
    lengths = torch.linspace(T // 2, T, B).long()
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T), right padding
    x = torch.randn(B, T, dim)
    g = torch.randn(B, T, dim)

    def step(name: str) -> Callable[[], None]:
        layer = layers[name]
        xs, gs = (x, g) if name == "float32" else (x.to(dtype), g.to(dtype))

        def run() -> None:
            layer.zero_grad(set_to_none=True)
            xx = xs.detach().requires_grad_()
            layer(xx, mask).backward(gs)
        return run

    say(f"layer forward+backward {dtype_name(dtype)} vs float32")
    times = interleaved_times({"half": step("half"), "float32": step("float32")}, repeats=repeats, warmup=1)
    section = f"layer {dtype_name(dtype)} vs float32 ({torch.ops.causal_attention.cpu_capability()}; {route(dtype)})"
    return [_row(section, f"forward+backward B={B} T={T} dim={dim} H={H}, padded", times)]


def prefill_rows(dtype: torch.dtype, *, repeats: int, quick: bool, say: Callable[[str], None],
                 models: dict[str, GPT]) -> list[Row]:
    shape = QUICK if quick else FULL
    if "float32" not in models:
        torch.manual_seed(0)
        models["float32"] = GPT(GPTConfig(**shape["gpt"])).eval()
    half = copy.deepcopy(models["float32"]).to(dtype)
    tokens = torch.randint(0, shape["gpt"]["vocab_size"], (1, shape["prefill"]), generator=torch.Generator().manual_seed(0))
    say(f"GPT prefill {dtype_name(dtype)} vs float32")
    with torch.no_grad():
        times = interleaved_times({"half": lambda: half(tokens), "float32": lambda: models["float32"](tokens)},
                                  repeats=repeats, warmup=1)
    label = "GPT-2 124M" if not quick else "GPT-2 (tiny)"
    float32 = torch.ops.causal_attention.float32_products()  # the float32 twin's products (no gradient)
    section = (f"{label} {dtype_name(dtype)} vs float32 ({torch.ops.causal_attention.cpu_capability()}; {route(dtype)}; "
               f"float32: {float32})")
    return [_row(section, f"prefill of {shape['prefill']} tokens, B=1, logits everywhere", times)]


def main(*, out_dir: Path, repeats: int, quick: bool = False, dtypes: tuple[torch.dtype, ...] = HALF_DTYPES) -> dict:
    """Times the rows at 2 threads; prints the table, writes out_dir/bench_half.json and
    out_dir/bench_half.png, returns the report."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    if not dtypes or any(d not in HALF_DTYPES for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty selection of {HALF_DTYPES}; got {dtypes}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    console = Console(width=max(Console().width, 140))
    rows: list[Row] = []
    models: dict[str, GPT] = {}
    try:
        with console.status("bench-half") as status:
            def say(text: str) -> None:
                status.update(text)
                console.log(text)
            for dtype in dtypes:
                rows += layer_rows(dtype, repeats=repeats, quick=quick, say=say)
                rows += prefill_rows(dtype, repeats=repeats, quick=quick, say=say, models=models)
    finally:
        torch.set_num_threads(threads)
    report = {
        "threads": 2,
        "repeats": repeats,
        "quick": quick,
        "cpu_capability": str(torch.ops.causal_attention.cpu_capability()),
        "routes": {dtype_name(d): route(d) for d in dtypes},
        "rows": [asdict(r) for r in rows],
    }
    print_rows(rows, [], console, title="half precision against float32 on this CPU (x = float32's time / half's)")
    (out_dir / "bench_half.json").write_text(json.dumps(report, indent=2))
    plot_rows(rows, out_dir / "bench_half.png",
              title=f"half precision vs float32, 2 threads, medians of {repeats} (above 1: half is faster)")
    return report
