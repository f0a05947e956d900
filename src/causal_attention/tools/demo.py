"""python -m causal_attention demo: train a tiny GPT built from the layer, then generate.

The task: reverse a digit string of length 1..12, e.g. ``BOS 3 1 4 SEP -> 4 1 3 EOS``. Sequences
vary in length, so batches are right-padded with a key_padding_mask, and the answer needs
attention (output i copies input n - 1 - i). After training, held-out problems are answered in
one ragged batch with the KV cache (greedy), and without it (recomputing the prefix) for speed.

Writes to --out: metrics.json, loss.png, attention.png, model.safetensors, config.json and
tokenizer.json (the digits' ids and BOS/SEP/EOS, for causal-attention-generate --prompt).
--load DIR answers new problems with a model a demo run saved, without training.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor

from ..models import GPT, GPTConfig

if TYPE_CHECKING:
    from .launch import Run

SEP, EOS, BOS = 10, 11, 12  # digits are 0..9
VOCAB = 13
MAX_DIGITS = 12
MAX_LEN = 2 * MAX_DIGITS + 3  # BOS digits SEP reversed EOS
FINAL_LOSS_STEPS = 20  # metrics' final_loss: the mean of the last steps' losses (one step's is noisy)


def make_problem(rng: random.Random) -> tuple[list[int], list[int]]:
    """(prompt, answer): BOS d1..dn SEP -> dn..d1 EOS."""
    digits = [rng.randrange(10) for _ in range(rng.randint(1, MAX_DIGITS))]
    return [BOS, *digits, SEP], [*reversed(digits), EOS]


def heldout_problems(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """The n problems a training run with this seed is evaluated on (a stream training never draws from)."""
    rng = random.Random(seed + 1_000_003)
    return [make_problem(rng) for _ in range(n)]


def new_problems(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """The n problems ``--load`` answers: neither the training nor the held-out stream of this seed."""
    rng = random.Random(seed + 2_000_003)
    return [make_problem(rng) for _ in range(n)]


def make_batch(rng: random.Random, batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (tokens, key_padding_mask, targets), each (B, T); targets are -100 except on
    the answer tokens (the loss is on the answers only)."""
    seqs, starts = [], []
    for _ in range(batch_size):
        prompt, answer = make_problem(rng)
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    T = max(len(s) for s in seqs)
    tokens = torch.full((batch_size, T), EOS, dtype=torch.int64)
    targets = torch.full((batch_size, T), -100, dtype=torch.int64)
    mask = torch.zeros(batch_size, T, dtype=torch.bool)
    for b, (s, start) in enumerate(zip(seqs, starts)):
        tokens[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
        targets[b, start - 1 : len(s) - 1] = torch.tensor(s[start:])  # predict each answer token
    return tokens, mask, targets


def train(model: GPT, *, steps: int, seed: int, batch_size: int = 64, lr: float = 3e-3,
          console: Console, run: Run | None = None) -> tuple[list[float], float, float]:
    """Returns (loss per step, seconds, tokens per second). With ``run`` (a distributed run), model
    is the wrapped model, every rank draws the same batches and takes its part (run.local_batch)."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item())
    )
    losses: list[float] = []
    tokens_seen = 0
    start = time.perf_counter()
    columns = (TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("step loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=steps, loss=float("nan"), tps=0.0)
        for step in range(steps):
            tokens, mask, targets = make_batch(rng, batch_size)
            if run is None:
                logits = model(tokens, mask)  # (B, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            else:  # this rank's part of the whole batch's mean (gradients are averaged over ranks)
                n_answer = int((targets != -100).sum())
                tokens, mask, targets = run.local_batch(tokens, mask, targets)
                logits = model(tokens, mask)  # (B / world or B, T, V)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
                loss = loss / n_answer * run.loss_scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if run is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                from ..integrations.parallel import clip_grad_norm_  # sharded and replicated parameters mixed

                clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item() if run is None else run.global_sum(loss.item()) / run.loss_scale)
            tokens_seen += int(mask.sum()) if run is None else int(run.global_sum(int(mask.sum())))
            if step % 10 == 0 or step == steps - 1:
                progress.update(task, completed=step + 1, loss=losses[-1], tps=tokens_seen / (time.perf_counter() - start))
    seconds = time.perf_counter() - start
    return losses, seconds, tokens_seen / seconds


def evaluate(model: GPT, problems: list[tuple[list[int], list[int]]], *, use_cache: bool) -> tuple[float, float, list[list[int]]]:
    """(exact-match accuracy, generated tokens per second, answers) for one ragged batch."""
    model.eval()
    start = time.perf_counter()
    answers = model.generate([p for p, _ in problems], MAX_DIGITS + 1, use_cache=use_cache, eos_id=EOS, pad_id=EOS)
    seconds = time.perf_counter() - start
    correct = sum(a == expected for a, (_, expected) in zip(answers, problems))
    return correct / len(problems), sum(len(a) for a in answers) / seconds, answers


def plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(losses, alpha=0.35, label="per step")
    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
    ax.plot(smooth, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer tokens")
    ax.set_title("GPT (demo configuration) on digit reversal (right-padded batches)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attention(model: GPT, problem: tuple[list[int], list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompt, answer = problem
    seq = prompt + answer
    names = [str(t) if t < 10 else {SEP: "SEP", EOS: "EOS", BOS: "BOS"}[t] for t in seq]
    with torch.no_grad():
        _, maps = model(torch.tensor([seq]), return_attention=True)
    L, H = len(maps), maps[0].shape[1]
    fig, axes = plt.subplots(L, H, figsize=(3.2 * H, 3.2 * L), squeeze=False)
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            ax.imshow(maps[layer][0, head].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            ax.set_xticks(range(len(seq)), names, fontsize=6, rotation=90)
            ax.set_yticks(range(len(seq)), names, fontsize=6)
    fig.suptitle("attention weights (query rows, key columns) for " + " ".join(names))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def tokenizer_json() -> dict[str, object]:
    """The demo's tokenizer as ``causal-attention-generate --prompt`` reads it: a prompt is
    [bos_id] + one token per character + [sep_id]; an answer is shown up to eos_id."""
    return {"format": "causal_attention.char_tokenizer", "vocab": {str(d): d for d in range(10)},
            "bos_id": BOS, "sep_id": SEP, "eos_id": EOS}


def save_model(model: GPT, out: Path) -> None:
    model.save(out)  # model.safetensors + config.json
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(), indent=2) + "\n")


def load_model(directory: Path) -> GPT:
    """A model a demo run saved; ValueError if the directory holds another model (its answers
    would be meaningless): the vocabulary must be the demo's, max_len must fit its problems and
    tokenizer.json must be the demo's."""
    model = GPT.load(directory)
    config = model.config
    if config.vocab_size != VOCAB or config.max_len < MAX_LEN:
        raise ValueError(f"not a demo model: config.json has vocab_size={config.vocab_size}, max_len={config.max_len}; "
                         f"the demo's has vocab_size={VOCAB} and max_len >= {MAX_LEN}")
    path = directory / "tokenizer.json"
    try:
        tokenizer = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"not a demo model: {path} not found (a demo run writes it beside the model)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not well-formed JSON ({exc})") from None
    if tokenizer != tokenizer_json():
        raise ValueError(f"not a demo model: {path} is not the demo's tokenizer (digits 0..9, BOS={BOS}, SEP={SEP}, "
                         f"EOS={EOS})")
    return model


def _show(console: Console, problems: list[tuple[list[int], list[int]]], answers: list[list[int]], n: int = 5) -> None:
    for (prompt, expected), got in list(zip(problems, answers))[:n]:
        digits = "".join(map(str, prompt[1:-1]))
        text = "".join(str(t) for t in got if t < 10)
        mark = "[green]ok[/green]" if got == expected else "[red]wrong[/red]"
        console.print(f"  reverse({digits}) -> {text}  {mark}")


def main(*, steps: int, seed: int, out: Path, load: Path | None, n_eval: int = 500,
         distributed_strategy: str | None = None) -> dict[str, float]:
    if distributed_strategy is not None:
        return _main_distributed(distributed_strategy, steps=steps, seed=seed, out=out, n_eval=n_eval)
    console = Console()
    torch.manual_seed(seed)
    if load is not None:
        problems = new_problems(seed, n_eval)
        model = load_model(load)
        acc, tps, answers = evaluate(model, problems, use_cache=True)
        console.print(f"loaded {load}: exact match {acc:.1%} on {n_eval} new problems ({tps:,.0f} tokens/s with the cache)")
        _show(console, problems, answers)
        return {"accuracy": acc, "tokens_per_s_cache": tps}

    problems = heldout_problems(seed, n_eval)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_len=MAX_LEN))  # the demo's small configuration
    console.print(f"GPT: {sum(p.numel() for p in model.parameters()):,} parameters, {model.config}")
    model.train()
    losses, train_seconds, train_tps = train(model, steps=steps, seed=seed, console=console)
    return _finish(model, losses, train_seconds, train_tps, problems, steps=steps, seed=seed, out=out, n_eval=n_eval,
                   console=console)


def _main_distributed(strategy: str, *, steps: int, seed: int, out: Path, n_eval: int) -> dict[str, float]:
    """The demo on torchrun's processes: every rank builds the same model (same seed), trains it
    wrapped by the strategy; rank 0 gathers the weights into an unsharded GPT, evaluates and writes
    the same files as the single-process run (metrics.json also records the strategy)."""
    from . import launch

    run = launch.start(strategy)
    ok = False
    try:
        metrics = _train_distributed(run, steps=steps, seed=seed, out=out, n_eval=n_eval)
        ok = True
        return metrics
    finally:
        # The other ranks wait for rank 0's evaluation and files; the trained (FSDP) modules are
        # freed before the group goes: launch.finish.
        del run
        launch.finish(ok=ok)


def _train_distributed(run: Run, *, steps: int, seed: int, out: Path, n_eval: int) -> dict[str, float]:
    strategy = run.strategy
    console = Console(quiet=run.rank != 0)
    torch.manual_seed(seed)
    problems = heldout_problems(seed, n_eval)
    config = GPTConfig(vocab_size=VOCAB, max_len=MAX_LEN)
    model = GPT(config)
    console.print(f"GPT: {sum(p.numel() for p in model.parameters()):,} parameters, {model.config}; "
                  f"{strategy} on {run.world_size} processes")
    wrapped = run.wrap(model)
    wrapped.train()
    losses, train_seconds, train_tps = train(wrapped, steps=steps, seed=seed, console=console, run=run)
    gathered = run.gather(wrapped, GPT(config))
    if gathered is None:
        return {}
    metrics = _finish(gathered, losses, train_seconds, train_tps, problems, steps=steps, seed=seed, out=out,
                      n_eval=n_eval, console=console, extra={"distributed": strategy, "world_size": run.world_size})
    return metrics


def _finish(model: GPT, losses: list[float], train_seconds: float, train_tps: float,
            problems: list[tuple[list[int], list[int]]], *, steps: int, seed: int, out: Path, n_eval: int,
            console: Console, extra: dict[str, object] | None = None) -> dict[str, float]:
    """Evaluates the trained model, writes metrics, plots and the model; returns the metrics."""
    acc, tps_cache, answers = evaluate(model, problems, use_cache=True)
    acc_nocache, tps_nocache, answers_nocache = evaluate(model, problems, use_cache=False)
    if answers_nocache != answers:
        raise RuntimeError("generation with and without the cache disagree")
    out.mkdir(parents=True, exist_ok=True)
    metrics = {
        "accuracy": acc,
        "train_seconds": train_seconds,
        "train_tokens_per_s": train_tps,
        "tokens_per_s_cache": tps_cache,
        "tokens_per_s_nocache": tps_nocache,
        "steps": steps,
        "seed": seed,
        "final_loss": sum(losses[-FINAL_LOSS_STEPS:]) / len(losses[-FINAL_LOSS_STEPS:]),
        "eval_problems": n_eval,
        **(extra or {}),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    plot_loss(losses, out / "loss.png")
    plot_attention(model, problems[0], out / "attention.png")
    save_model(model, out)
    last = min(FINAL_LOSS_STEPS, len(losses))
    console.print(f"trained {steps} steps in {train_seconds:.1f} s ({train_tps:,.0f} tokens/s); final loss "
                  f"{metrics['final_loss']:.4f} (mean of the last {last} steps; the bar shows the last step's "
                  f"{losses[-1]:.4f})")
    console.print(f"held-out exact match: {acc:.1%} of {n_eval} (target >= 95%)")
    console.print(f"decode: {tps_cache:,.0f} tokens/s with the KV cache, {tps_nocache:,.0f} without "
                  f"({tps_cache / tps_nocache:.1f}x)")
    _show(console, problems, answers)
    console.print(f"wrote {out}/metrics.json, loss.png, attention.png, model.safetensors, config.json, tokenizer.json")
    return metrics
