"""Deployment peers timed against eager: onnxruntime and AOTInductor running the same models.

Rows are (case, peer, ours_ms, theirs_ms, ratio, max_err) with ratio = theirs_ms / ours_ms (above 1,
eager is faster) and max_err the peer's largest difference from eager's output on the timed inputs.
Everything runs in this process with torch's thread count (``--threads``; onnxruntime's intra-op
pool gets the same), interleaved (round-robin, rotated), and is reported as medians.

Cases (float32, eval, no_grad, right-padded batches; each peer exported from the model as users do):
- ``layer``: CausalSelfAttention(768, 12), B=4, T=1024, lengths 1024/900/700/512;
- ``gpt demo``: the demo's GPT (GPTConfig defaults at the demo's vocabulary and length), B=64;
- ``gpt2``: a GPT-2-small-shaped GPT (124M, random weights), B=4, T=256, lengths 256/230/180/128.

Peers: ``onnxruntime`` (``torch.onnx.export(dynamo=True)`` at the exporter's default opset:
primitive ops), ``onnxruntime-opset23`` (the same at opset 23: ONNX ``Attention``), ``aoti``
(``torch._inductor.aoti_compile_and_package`` of ``torch.export.export``, with the engine's ops).
``quick`` uses tiny sizes (a smoke test, not a measurement).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import Tensor, nn

from ...integrations.torch_export import dynamic_shapes
from ...models import GPT, GPTConfig
from ...attention.module import CausalSelfAttention
from .report import interleaved_medians

PEERS: tuple[str, ...] = ("onnxruntime", "onnxruntime-opset23", "aoti")


@dataclass
class Row:
    case: str
    peer: str
    ours_ms: float
    theirs_ms: float
    ratio: float  # theirs_ms / ours_ms: above 1, eager is faster
    max_err: float  # max |peer - eager| over the outputs of the timed inputs


@dataclass
class Case:
    name: str
    model: nn.Module
    args: tuple[Tensor, ...]  # (x or tokens, key_padding_mask)
    max_len: int | None  # the bound of T for export (a GPT's positions)


def _mask(T: int, lengths: list[int]) -> Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool, True = real


def cases(*, quick: bool) -> list[Case]:
    """The benchmark's models and inputs (fixed seeds)."""
    from ..demo import MAX_LEN as DEMO_LEN
    from ..demo import VOCAB as DEMO_VOCAB

    torch.manual_seed(0)
    if quick:
        layer_shape = dict(dim=64, H=4, B=2, T=32, lengths=[32, 20])
        gpt2 = GPTConfig(vocab_size=101, max_len=64, dim=64, n_layers=2, n_heads=4, activation="gelu_tanh")
        gpt2_shape = dict(B=2, T=32, lengths=[32, 17])
        demo_B = 4
    else:
        layer_shape = dict(dim=768, H=12, B=4, T=1024, lengths=[1024, 900, 700, 512])
        gpt2 = GPTConfig.gpt2()
        gpt2_shape = dict(B=4, T=256, lengths=[256, 230, 180, 128])
        demo_B = 64
    out: list[Case] = []
    dim, H, B, T, lengths = (layer_shape[k] for k in ("dim", "H", "B", "T", "lengths"))
    out.append(Case(f"layer dim={dim} H={H} B={B} T={T} lengths={lengths}", CausalSelfAttention(dim, H).eval(),
                    (torch.randn(B, T, dim), _mask(T, lengths)), None))
    demo = GPT(GPTConfig(vocab_size=DEMO_VOCAB, max_len=DEMO_LEN)).eval()
    demo_lengths = torch.randint(DEMO_LEN // 2, DEMO_LEN + 1, (demo_B,)).tolist()
    out.append(Case(f"gpt demo (dim 128, 3 layers) B={demo_B} T={DEMO_LEN} ragged",
                    demo, (torch.randint(0, DEMO_VOCAB, (demo_B, DEMO_LEN)), _mask(DEMO_LEN, demo_lengths)), DEMO_LEN))
    g = GPT(gpt2).eval()
    B, T, lengths = gpt2_shape["B"], gpt2_shape["T"], gpt2_shape["lengths"]
    label = "gpt2-small-shaped (124M)" if not quick else "gpt2-shaped (tiny)"
    out.append(Case(f"{label} B={B} T={T} lengths={lengths}", g,
                    (torch.randint(0, gpt2.vocab_size, (B, T)), _mask(T, lengths)), gpt2.max_len))
    return out


def _onnxruntime(case: Case, opset: int | None, workdir: Path) -> Callable[[], Tensor]:
    import onnxruntime as ort

    shapes = dynamic_shapes(with_mask=True, max_len=case.max_len)
    program = torch.onnx.export(case.model, case.args, dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                                verbose=False)
    path = workdir / f"model_{opset or 'default'}.onnx"
    program.save(str(path))  # large models need the file (protobuf's 2 GB limit on one message)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    # Idle onnxruntime threads must not spin on the cores eager runs on next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = {n: a.numpy() for n, a in zip(names, case.args)}
    return lambda: torch.from_numpy(sess.run(None, feeds)[0])


def _aoti(case: Case, workdir: Path) -> Callable[[], Tensor]:
    shapes = dynamic_shapes(with_mask=True, max_len=case.max_len)
    ep = torch.export.export(case.model, case.args, dynamic_shapes=shapes)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / "model.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    return lambda: loaded(*case.args)


def case_rows(case: Case, *, peers: tuple[str, ...], repeats: int, progress: Progress) -> list[Row]:
    """Builds each peer of one case (export, compile), checks it against eager, then times all."""
    task = progress.add_task(f"{case.name}: export", total=len(peers) + (len(peers) + 1) * (repeats + 1))
    fns: dict[str, Callable[[], Tensor]] = {"eager": lambda: case.model(*case.args)}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for peer in peers:
            workdir = Path(tmp) / peer
            workdir.mkdir()
            progress.update(task, description=f"{case.name}: {peer} export")
            if peer == "aoti":
                fns[peer] = _aoti(case, workdir)
            else:
                fns[peer] = _onnxruntime(case, 23 if peer == "onnxruntime-opset23" else None, workdir)
            progress.advance(task)
        want = fns["eager"]()
        errors = {peer: (fns[peer]() - want).abs().max().item() for peer in peers}
        progress.update(task, description=f"{case.name}: timing")
        medians = interleaved_medians(fns, repeats=repeats, warmup=1, after_call=lambda: progress.advance(task))
    progress.remove_task(task)
    ours = medians["eager"] * 1e3
    rows = [Row(case.name, peer, ours, medians[peer] * 1e3, medians[peer] * 1e3 / ours, errors[peer]) for peer in peers]
    progress.console.print(f"{case.name}: eager {ours:.2f} ms; " + "; ".join(
        f"{r.peer} {r.theirs_ms:.2f} ms ({r.ratio:.2f}x, max err {r.max_err:.1e})" for r in rows))
    return rows


def print_rows(rows: list[Row], console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 150))
    table = Table(title=f"deployment peers against eager (float32, threads: {torch.get_num_threads()}, medians of "
                        "interleaved runs; x = peer / eager)")
    for col in ("case", "peer", "eager ms", "peer ms", "x", "max |peer - eager|"):
        table.add_column(col, justify="left" if col in ("case", "peer") else "right")
    for r in rows:
        table.add_row(r.case, r.peer, f"{r.ours_ms:.2f}", f"{r.theirs_ms:.2f}", f"{r.ratio:.2f}x", f"{r.max_err:.1e}")
    console.print(table)


def plot_rows(rows: list[Row], path: Path, *, title: str) -> None:
    """A horizontal bar per row: peer time / eager time (above 1, eager is faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.case}\n{r.peer}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(rows)))
    bars = ax.barh(range(len(rows)), [r.ratio for r in rows], color=[f"C{PEERS.index(r.peer)}" for r in rows])
    ax.bar_label(bars, labels=[f"{r.ratio:.2f}x ({r.theirs_ms:.1f} vs {r.ours_ms:.1f} ms)" for r in rows], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("peer time / eager time (above 1: eager causal_attention is faster)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(*, out_dir: Path, repeats: int, quick: bool, peers: tuple[str, ...] = PEERS) -> dict:
    """Times every case against the peers; prints the table, writes out_dir/bench_deploy.json and
    out_dir/bench_deploy.png, returns the report."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise ValueError(f"peers must be a non-empty selection of {PEERS}; got {peers}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    rows: list[Row] = []
    with Progress(transient=True) as progress:
        for case in cases(quick=quick):
            rows += case_rows(case, peers=peers, repeats=repeats, progress=progress)
    report = {"threads": threads, "repeats": repeats, "quick": quick, "rows": [asdict(r) for r in rows]}
    print_rows(rows)
    (out_dir / "bench_deploy.json").write_text(json.dumps(report, indent=2))
    plot_rows(rows, out_dir / "bench_deploy.png",
              title=f"onnxruntime and AOTInductor against eager, threads: {threads}, medians of {repeats}")
    return report
