"""The engine inside transformers, timed against transformers' own attention implementations.

Rows are generic: (section, name, ours_ms, theirs_ms, ratio) with ratio = theirs_ms / ours_ms
(above 1, ours is faster). Everything runs in this process, interleaved (round-robin, rotated),
and is reported as medians: the machines are noisy, so the ratios are the result.

Sections:
- ``prefill``: GPT-2 124M (GPT2Config() defaults, random weights), eval, no_grad, a right-padded
  batch B=4, T=1024 (lengths 1024, 900, 700, 512), ``model(ids, attention_mask=mask,
  use_cache=False, logits_to_keep=1)`` (a generation prefill computes the logits of the last
  position only), with ``attn_implementation`` "causal_attention" against "sdpa" and "eager",
  all holding the same weights; float32, and bfloat16 when asked (skipped, with the reason, when
  one bfloat16 forward would take longer than BF16_BUDGET_S, estimated from a one-layer model).
- ``attention``: one layer's attention call alone, from the q, k, v views GPT-2 makes of its
  c_attn output, with the mask each implementation gets from transformers (made once, outside the
  timing): ours (no copy), ours given separate k and v (what a DynamicCache hands over: one join
  copy), against sdpa_attention_forward and eager_attention_forward.

- ``attention GQA``: grouped-query attention alone, the engine's fused kernel (n_kv_heads) against
  ``F.scaled_dot_product_attention(enable_gqa=True)`` with the mask transformers' sdpa_mask makes, on
  the same q | k | v projection: H=32 query heads over Hkv=8, hd=64, B=4, T=1024 right-padded,
  forward and forward + backward (issue 34's target shape).

- ``decode step``: one decode step's attention through the engine's transformers attention function,
  against a DynamicCache (keys and values (B, Hkv, context, hd) as the cache holds them, a left-padded
  batch), against ``sdpa_attention_forward`` with transformers' mask, and against one ``torch.sum`` over
  the same key and value bytes (the row's "theirs" is the sum: the ratio is the fraction of a plain
  read the step reaches): B=8, context 2048, H=32 over Hkv=8, hd=64.

- ``Llama``: a Llama-shaped model of 2 layers (hidden 2048, 32 heads over 8 key/value heads,
  intermediate 5632, vocabulary 32000, random weights) with the engine against sdpa on the same weights:
  a right-padded prefill (B=4, T=1024, lengths 1024, 900, 700, 512, the logits of the last position)
  and ``generate`` of 64 greedy tokens after 512-token prompts left-padded to lengths 512, 450, 350, 256;
  and the Python GPT (from_huggingface, the same weights) generating the same tokens from the same prompts
  (ragged, no padding) against transformers' sdpa generate.

``quick`` uses a tiny config and T=64 (a smoke test, not a measurement).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
from rich.progress import Progress
from torch import Tensor

from ...integrations import huggingface
from ...models.convert import from_huggingface
from .report import (Row, interleaved_medians, interleaved_times, medians, paired_ratio, plot_rows, print_rows,
                     rounds_within)

BF16_BUDGET_S = 60.0  # one bfloat16 forward slower than this skips the bfloat16 rows
FULL = dict(B=4, T=1024, lengths=[1024, 900, 700, 512])
QUICK = dict(B=4, T=64, lengths=[64, 56, 44, 32])
GQA_FULL = dict(H=32, Hkv=8, hd=64)
GQA_QUICK = dict(H=4, Hkv=2, hd=16)


def _config(quick: bool) -> Any:
    from transformers import GPT2Config

    if quick:
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128)
    return GPT2Config()  # GPT-2 124M: 12 layers, 768 wide, 12 heads, 50257 tokens, 1024 positions


def _models(config: Any, impls: tuple[str, ...], dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """One GPT2LMHeadModel per attention implementation, all holding the first one's weights."""
    from transformers import GPT2LMHeadModel

    models: dict[str, torch.nn.Module] = {}
    for impl in impls:
        model = GPT2LMHeadModel._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = model.eval()
    return models


def _batch(config: Any, B: int, T: int, lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Token ids (B, T) and the right-padded attention_mask (B, T), 1 = real token."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=generator)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


def _timed(fns: dict[str, Callable[[], object]], repeats: int, progress: Progress, label: str) -> dict[str, float]:
    """interleaved_medians of fns (1 warm-up round), in ms, advancing a progress bar per call."""
    task = progress.add_task(label, total=len(fns) * (repeats + 1))
    with torch.no_grad():
        medians = interleaved_medians(fns, repeats=repeats, warmup=1, after_call=lambda: progress.advance(task))
    return {k: v * 1e3 for k, v in medians.items()}


def _rows(section: str, times: dict[str, float], ours: str, theirs: dict[str, str]) -> list[Row]:
    """One row per baseline: theirs[key] names it, times[key] is its median (ms)."""
    return [Row(section, name, times[ours], times[key], times[key] / times[ours]) for key, name in theirs.items()]


def prefill_rows(*, dtype: torch.dtype, repeats: int, quick: bool, progress: Progress,
                 budget_s: float | None = None) -> tuple[list[Row], str | None]:
    """The whole-model prefill rows at dtype, or ([], why) when one forward exceeds budget_s."""
    name = huggingface.register()
    shape = QUICK if quick else FULL
    config = _config(quick)
    ids, mask = _batch(config, shape["B"], shape["T"], shape["lengths"])

    def forward(model: torch.nn.Module) -> Callable[[], object]:
        return lambda: model(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)

    dt = str(dtype).replace("torch.", "")
    if budget_s is not None:
        # One layer's forward times n_layer estimates a forward without waiting for a slow one.
        one_layer = copy.deepcopy(config)
        one_layer.n_layer = 1
        probe = _models(one_layer, ("sdpa",), dtype)["sdpa"]
        start = time.perf_counter()
        with torch.no_grad():
            forward(probe)()
        estimate = (time.perf_counter() - start) * config.n_layer
        if estimate > budget_s:
            return [], (f"{dt} prefill: one sdpa forward would take about {estimate:.0f} s "
                        f"(one layer's time x {config.n_layer}; > {budget_s:.0f} s)")
    models = _models(config, (name, "sdpa", "eager"), dtype)
    times = _timed({k: forward(m) for k, m in models.items()}, repeats, progress, f"prefill {dt}")
    section = f"transformers + engine: prefill {dt} B={shape['B']} T={shape['T']} lengths={shape['lengths']}"
    return _rows(section, times, name, {"sdpa": "prefill vs sdpa", "eager": "prefill vs eager"}), None


def attention_rows(*, dtype: torch.dtype, repeats: int, quick: bool, progress: Progress) -> list[Row]:
    """One GPT-2 layer's attention call alone, each implementation given its own mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    shape = QUICK if quick else FULL
    config = _config(quick)
    B, T = shape["B"], shape["T"]
    dim, H = config.n_embd, config.n_head
    hd = dim // H
    module = torch.nn.Module()
    module.is_causal = True  # what GPT2Attention says of itself
    module.training = False
    generator = torch.Generator().manual_seed(0)
    fused = torch.randn(B, T, 3 * dim, generator=generator).to(dtype)  # c_attn's output
    q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in fused.split(dim, 2))  # each (B, H, T, hd), views
    k_copy, v_copy = k.contiguous(), v.contiguous()  # as a DynamicCache hands them back
    padding = torch.arange(T)[None, :] < torch.tensor(shape["lengths"])[:, None]  # (B, T) bool
    sdpa_4d = sdpa_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=padding)
    eager_4d = eager_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=padding, dtype=dtype)
    scaling = hd**-0.5
    ours_mask = huggingface.engine_mask(padding)  # what the engine's mask function hands every layer
    fns = {
        "ours": lambda: huggingface.causal_attention_forward(module, q, k, v, ours_mask, scaling=scaling),
        "ours_copy": lambda: huggingface.causal_attention_forward(module, q, k_copy, v_copy, ours_mask,
                                                                  scaling=scaling),
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, sdpa_4d, scaling=scaling),
        "eager": lambda: eager_attention_forward(module, q, k, v, eager_4d, scaling=scaling),
    }
    dt = str(dtype).replace("torch.", "")
    times = _timed(fns, repeats, progress, f"attention {dt}")
    section = f"transformers + engine: attention (one layer) {dt} B={B} T={T} H={H} hd={hd}"
    rows = _rows(section, times, "ours", {"sdpa": "attention vs sdpa", "eager": "attention vs eager"})
    rows += _rows(section, times, "ours_copy", {"sdpa": "attention, separate k/v (cache) vs sdpa"})
    return rows


def gqa_rows(*, dtype: torch.dtype, repeats: int, quick: bool, progress: Progress) -> list[Row]:
    """Grouped-query attention alone, forward and forward + backward, engine against SDPA(enable_gqa)."""
    from transformers.masking_utils import sdpa_mask

    from ...attention import _ops

    shape, heads = (QUICK, GQA_QUICK) if quick else (FULL, GQA_FULL)
    B, T, H, Hkv, hd = shape["B"], shape["T"], heads["H"], heads["Hkv"], heads["hd"]
    generator = torch.Generator().manual_seed(0)
    fused = (torch.randn(B, T, (H + 2 * Hkv) * hd, generator=generator) * 0.5).to(dtype)  # q | k | v projection
    padding = torch.arange(T)[None, :] < torch.tensor(shape["lengths"])[:, None]  # (B, T) bool
    sdpa_4d = sdpa_mask(batch_size=B, q_length=T, kv_length=T, attention_mask=padding)

    def ours(qkv: Tensor) -> Tensor:
        return _ops.attention(qkv, padding, H, n_kv_heads=Hkv)  # (B, T, H * hd)

    def sdpa(qkv: Tensor) -> Tensor:
        q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=2)
        q, k, v = (t.unflatten(2, (-1, hd)).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd) views
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_4d, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, T, H * hd)

    def train_step(fn: Callable[[Tensor], Tensor]) -> Callable[[], object]:
        def step() -> None:
            with torch.enable_grad():
                x = fused.detach().requires_grad_()
                fn(x).sum().backward()
        return step

    with torch.no_grad():  # the two time the same attention
        torch.testing.assert_close(ours(fused), sdpa(fused), rtol=0, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    fns = {"ours": lambda: ours(fused), "sdpa": lambda: sdpa(fused),
           "ours_train": train_step(ours), "sdpa_train": train_step(sdpa)}
    dt = str(dtype).replace("torch.", "")
    times = _timed(fns, repeats, progress, f"attention GQA {dt}")
    section = (f"attention GQA {dt} B={B} T={T} lengths={shape['lengths']} H={H} Hkv={Hkv} hd={hd} "
               f"({torch.ops.causal_attention.cpu_capability()})")
    return (_rows(section, times, "ours", {"sdpa": "forward vs SDPA(enable_gqa)"})
            + _rows(section, times, "ours_train", {"sdpa_train": "forward + backward vs SDPA(enable_gqa)"}))


LLAMA_FULL = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=5632,
                  vocab_size=32000, prompt=512, new_tokens=64)
LLAMA_QUICK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                   vocab_size=101, prompt=32, new_tokens=4)


def llama_rows(*, dtype: torch.dtype, repeats: int, quick: bool, progress: Progress) -> list[Row]:
    """A Llama-shaped model of 2 layers inside transformers, the engine against sdpa: padded prefill and
    generate after left-padded prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    name = huggingface.register()
    sizes = dict(LLAMA_QUICK if quick else LLAMA_FULL)
    prompt, new_tokens = sizes.pop("prompt"), sizes.pop("new_tokens")
    config = LlamaConfig(num_hidden_layers=2, max_position_embeddings=2048, **sizes)
    models: dict[str, torch.nn.Module] = {}
    for impl in (name, "sdpa"):
        model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = model.eval()
    shape = QUICK if quick else FULL
    ids, mask = _batch(config, shape["B"], shape["T"], shape["lengths"])
    lengths = [prompt, prompt * 7 // 8, prompt * 11 // 16, prompt // 2]
    prompts, prompt_mask = _batch(config, len(lengths), prompt, lengths)
    prompt_mask = prompt_mask.flip(1)  # left padding, as generate takes prompts
    options = dict(attention_mask=prompt_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0)
    with torch.no_grad():  # the two generate the same tokens
        assert torch.equal(models[name].generate(prompts, **options), models["sdpa"].generate(prompts, **options))
    fns: dict[str, Callable[[], object]] = {}
    for impl, model in models.items():
        fns[f"prefill {impl}"] = lambda m=model: m(ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
        fns[f"generate {impl}"] = lambda m=model: m.generate(prompts, **options)
    # The Python GPT on the same weights (from_huggingface), its ragged prompts without padding.
    gpt = from_huggingface(models["sdpa"])
    prompt_lists = [row[m].tolist() for row, m in zip(prompts, prompt_mask)]
    fns["generate GPT"] = lambda: gpt.generate(prompt_lists, new_tokens)
    dt = str(dtype).replace("torch.", "")
    times = _timed(fns, repeats, progress, f"Llama {dt}")
    section = (f"Llama 2 layers hidden {config.hidden_size} heads {config.num_attention_heads}/"
               f"{config.num_key_value_heads} {dt} ({torch.ops.causal_attention.cpu_capability()})")
    return (_rows(section + f" prefill B={shape['B']} T={shape['T']}", times, f"prefill {name}",
                  {"prefill sdpa": "prefill vs sdpa"})
            + _rows(section + f" generate {new_tokens} after {prompt}-token prompts", times, f"generate {name}",
                    {"generate sdpa": "generate vs sdpa"})
            + _rows(section + f" Python GPT generate {new_tokens} after {prompt}-token prompts", times, "generate GPT",
                    {"generate sdpa": "GPT.generate vs transformers sdpa"}))


DECODE_FULL = dict(B=8, context=2048, H=32, Hkv=8, hd=64)
DECODE_QUICK = dict(B=2, context=64, H=4, Hkv=2, hd=16)
DECODE_EVICT_BYTES = 64 << 20  # read between the decode calls: twice the largest last-level cache here
DECODE_BUDGET_S = 4.0  # per dtype: as many rounds as fit, at least `repeats`
DECODE_MAX_ROUNDS = 201


def decode_rows(*, dtype: torch.dtype, repeats: int, quick: bool, progress: Progress) -> list[Row]:
    """One decode step's attention against a DynamicCache: the engine, sdpa, and a plain read."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    shape = DECODE_QUICK if quick else DECODE_FULL
    B, T, H, Hkv, hd = shape["B"], shape["context"], shape["H"], shape["Hkv"], shape["hd"]
    module = torch.nn.Module()
    module.is_causal = True
    module.training = False
    module.num_key_value_groups = H // Hkv  # what LlamaAttention says of itself (sdpa reads it)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(B, 1, H, hd, generator=generator).to(dtype).transpose(1, 2)  # (B, H, 1, hd), a view
    k = torch.randn(B, Hkv, T, hd, generator=generator).to(dtype)  # as a DynamicCache holds them
    v = torch.randn(B, Hkv, T, hd, generator=generator).to(dtype)
    padding = torch.arange(T)[None, :] >= torch.linspace(0, T // 4, B).long()[:, None]  # left padding
    ours_mask = huggingface.key_padding_mask(B, 1, T, q_offset=T - 1, attention_mask=padding)
    theirs_mask = sdpa_mask(batch_size=B, q_length=1, kv_length=T, q_offset=T - 1, attention_mask=padding)
    scaling = hd**-0.5
    with torch.no_grad():
        torch.testing.assert_close(huggingface.causal_attention_forward(module, q, k, v, ours_mask, scaling=scaling)[0],
                                   sdpa_attention_forward(module, q, k, v, theirs_mask, scaling=scaling)[0],
                                   rtol=0, atol=2e-2 if dtype != torch.float32 else 1e-5)
    fns = {
        "ours": lambda: huggingface.causal_attention_forward(module, q, k, v, ours_mask, scaling=scaling),
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, theirs_mask, scaling=scaling),
        "read": lambda: (k.sum(), v.sum()),
    }
    dt = str(dtype).replace("torch.", "")
    # A step of a real model reads each layer's cache cold (all layers' caches exceed the last-level
    # cache) after reading that layer's weights, so every call here starts after a read of other bytes
    # that clears k and v from the caches; the calls are short, so the ratios are medians over many
    # rounds of the per-round ratios (paired_ratio).
    evict = torch.zeros((1 << 20 if quick else DECODE_EVICT_BYTES) // 4)
    task = progress.add_task(f"decode step {dt}", total=None)

    def after_call() -> None:
        evict.sum()
        progress.advance(task)

    with torch.no_grad():
        rounds = rounds_within(fns, budget_s=0.2 if quick else DECODE_BUDGET_S, minimum=repeats,
                               maximum=DECODE_MAX_ROUNDS)
        times = interleaved_times(fns, repeats=rounds, warmup=1, after_call=after_call)
    m = {name: seconds * 1e3 for name, seconds in medians(times).items()}
    section = (f"decode step {dt} B={B} context={T} H={H} Hkv={Hkv} hd={hd} "
               f"({torch.ops.causal_attention.cpu_capability()}, {rounds} rounds, caches cleared)")
    return [Row(section, "decode attention vs sdpa", m["ours"], m["sdpa"], paired_ratio(times, "sdpa", "ours")),
            Row(section, "decode attention vs torch.sum of its K/V bytes", m["ours"], m["read"],
                paired_ratio(times, "read", "ours"))]


def main(*, out_dir: Path, repeats: int, bf16: bool, quick: bool, gpt: bool = True) -> dict:
    """Times the rows (float32; bfloat16 too when bf16): the project's GPT against GPT2LMHeadModel on
    the same weights (gpt2.py; bfloat16 at reduced sizes) when gpt, then the engine inside
    transformers; prints the table, writes
    out_dir/bench_transformers.json and out_dir/bench_transformers.png, returns the report."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # random configs: no token id warnings
    rows: list[Row] = []
    skipped: list[str] = []
    try:
        with Progress(transient=True) as progress:
            if gpt:
                from . import gpt2

                say = progress.console.print
                rows += gpt2.gpt2_rows(size="quick" if quick else "full", repeats=repeats, progress=say)
                if bf16:
                    rows += gpt2.gpt2_rows(size="quick" if quick else "reduced", dtype=torch.bfloat16,
                                                 repeats=max(1, repeats // 2), progress=say)
            rows += prefill_rows(dtype=torch.float32, repeats=repeats, quick=quick, progress=progress)[0]
            rows += attention_rows(dtype=torch.float32, repeats=repeats, quick=quick, progress=progress)
            rows += gqa_rows(dtype=torch.float32, repeats=repeats, quick=quick, progress=progress)
            rows += decode_rows(dtype=torch.float32, repeats=repeats, quick=quick, progress=progress)
            rows += llama_rows(dtype=torch.float32, repeats=max(1, repeats // 2), quick=quick, progress=progress)
            if bf16:
                bf16_rows, why = prefill_rows(dtype=torch.bfloat16, repeats=repeats, quick=quick, progress=progress,
                                              budget_s=BF16_BUDGET_S)
                rows += bf16_rows
                if why is not None:
                    skipped.append(why)
                rows += attention_rows(dtype=torch.bfloat16, repeats=repeats, quick=quick, progress=progress)
                rows += gqa_rows(dtype=torch.bfloat16, repeats=repeats, quick=quick, progress=progress)
                rows += decode_rows(dtype=torch.bfloat16, repeats=repeats, quick=quick, progress=progress)
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
    report = {
        "threads": 2,
        "repeats": repeats,
        "quick": quick,
        "shape": QUICK if quick else FULL,
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }
    print_rows(rows, skipped)
    (out_dir / "bench_transformers.json").write_text(json.dumps(report, indent=2))
    title = (f"GPT and the engine against transformers, GPT-2 {'tiny' if quick else '124M'}, "
             f"2 threads, medians of {repeats}")
    plot_rows(rows, out_dir / "bench_transformers.png", title=title)
    return report
