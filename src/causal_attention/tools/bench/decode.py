"""The decode benchmark: one token's step through the layer and its attention op against the copy
ceiling, and a tiny GPT generating with the KV cache and without it."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ...attention.cache import KVCache, cache_buffer
from ...attention.decode import few_rows_linear
from ...attention.module import CausalSelfAttention
from .report import dtype_name as _name
from .report import interleaved_medians, interleaved_times, medians, paired_ratio


def _cpu_list(text: str) -> set[int]:
    """CPUs of a sysfs list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def last_level_cache_bytes(*, default: int = 32 * 2**20, cap: int = 512 * 2**20,
                           root: Path = Path("/sys/devices/system/cpu"), cpus: set[int] | None = None) -> int:
    """The L3 that this process's CPUs (cpus; default: its affinity) share: the sizes of the distinct
    L3 caches (by the CPUs sharing each) that Linux's sysfs lists under root and that one of them
    uses, at most cap; default where sysfs lists none (or none can be read)."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    caches: dict[str, int] = {}
    for index in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip().upper().removesuffix("B").replace(" ", "")  # "32768K"
            shared = (index / "shared_cpu_list").read_text().strip()
            if cpus is not None and not _cpu_list(shared) & cpus:
                continue
            caches[shared] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):  # unreadable or in a format we do not know: left out
            continue
    return min(cap, sum(caches.values())) or default


DECODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DECODE_READ_ROW = "decode step: read only (one torch.sum over as many bytes as the layer reads)"
DECODE_UNFUSED_ROW = "decode step: whole layer, op by op (no decode_layer)"


def decode_rows(*, B: int = 8, ctx: int = 2048, dim: int = 768, H: int = 12,
                dtypes: tuple[torch.dtype, ...] = DECODE_DTYPES, repeats: int = 25) -> list[dict[str, float | str]]:
    """A single-token decode step at B, context ctx, dim, H heads in each of dtypes (float32 first):
    the layer and its attention op alone, all timed in one interleaved group with a copy of as many
    bytes as the float32 K and V hold (the bandwidth ceiling, read + write bytes per second); each
    row reports the bytes of K and V read per second and its speed against float32's (vs_f32 =
    float32 time / this time). Then a tiny GPT (4 layers of width min(256, dim)) generating from
    prompts of about ctx/2 tokens with the KV cache and without it (recomputing the prefix)."""
    if dtypes[0] != torch.float32:
        raise ValueError(f"decode_rows: the first dtype must be float32 (the baseline); got {dtypes}")
    fns, resets = _decode_step_fns(B, ctx, dim, H, dtypes)
    # The ceiling, interleaved with them: a copy of as many bytes as the float32 K and V hold, on
    # huge pages as the cache is (the faster of the two page sizes).
    src = cache_buffer((2 * B * H * ctx * (dim // H),), torch.float32, "cpu").normal_()
    dst = cache_buffer((2 * B * H * ctx * (dim // H),), torch.float32, "cpu")
    fns["copy"] = lambda: dst.copy_(src)
    # Every call starts from the same state: after an untimed read of twice the machine's L3 (at
    # least 64 MB), the caches hold clean lines, as a layer's step finds them after the previous
    # layer streamed its weights (else the call after the copy pays for its dirty lines).
    settle = torch.ones(max(64 * 2**20, 2 * last_level_cache_bytes()) // 4)

    def after_call() -> None:
        for reset in resets:
            reset()
        settle.sum()

    with torch.no_grad():
        times = interleaved_times(fns, repeats=repeats, warmup=2, after_call=after_call)
    copy_bytes = 2 * src.numel() * 4  # read + write
    return _decode_step_rows(times, copy_bytes, B, ctx, dim, H, dtypes) + _generate_rows(ctx, dim)


def _decode_step_fns(B: int, ctx: int, dim: int, H: int, dtypes: tuple[torch.dtype, ...],
                     ) -> tuple[dict[str, Callable[[], object]], list[Callable[[], object]]]:
    """decode_rows' timed calls (layer and op per dtype; float32's unfused step and the read of its
    bytes) and the untimed resets of the caches' lengths that each step advances."""
    fns: dict[str, Callable[[], object]] = {}
    resets: list[Callable[[], object]] = []
    for dtype in dtypes:
        attn = CausalSelfAttention(dim, H, dtype=dtype)
        cache = attn.make_cache(B, ctx + 1)
        with torch.no_grad():
            cache.k.normal_()
            cache.v.normal_()
            cache.lengths.fill_(ctx - 1)  # the step's token is the ctx-th: it reads ctx keys
            x = torch.randn(B, 1, dim, dtype=dtype)
            qkv = attn.qkv(x)
        start = cache.lengths.clone()
        end = start + 1
        resets.append(partial(cache.lengths.copy_, start))

        def layer_step(attn: CausalSelfAttention = attn, cache: KVCache = cache, x: Tensor = x) -> None:
            attn(x, cache=cache)

        def attention_op(qkv: Tensor = qkv, cache: KVCache = cache, start: Tensor = start, end: Tensor = end) -> None:
            torch.ops.causal_attention.decode_attention(qkv, cache.k, cache.v, start, end, H)

        fns[f"layer {_name(dtype)}"] = layer_step
        fns[f"op {_name(dtype)}"] = attention_op
        if dtype == torch.float32:
            # What the layer's one fused op (decode_layer) replaces: the module's step op by op (its
            # path where decode_layer does not apply), from the same checked entry point.
            def op_by_op(attn: CausalSelfAttention = attn, cache: KVCache = cache, x: Tensor = x) -> None:
                few_rows_linear(attn.proj, attn.attend(few_rows_linear(attn.qkv, x), None, cache=cache))

            fns["unfused float32"] = op_by_op
            # What the target's metric can reach: reading as many bytes as the float32 layer reads
            # (weights, biases, K and V), by one torch.sum over one buffer on huge pages.
            parts = (attn.qkv.weight, attn.qkv.bias, cache.k, cache.v, attn.proj.weight, attn.proj.bias)
            whole = cache_buffer((sum(p.numel() for p in parts),), torch.float32, "cpu").fill_(1)
            fns["read float32"] = whole.sum
    return fns, resets


def _decode_step_rows(times: dict[str, list[float]], copy_bytes: int, B: int, ctx: int, dim: int, H: int,
                      dtypes: tuple[torch.dtype, ...]) -> list[dict[str, float | str]]:
    """decode_rows' step rows from the interleaved times: bytes per second, of copy, vs float32."""
    t = medians(times)
    hd = dim // H
    copy_gbs = copy_bytes / t["copy"] / 1e9
    rows: list[dict[str, float | str]] = []
    kinds = (("layer", "decode step: whole layer", dtypes), ("unfused", DECODE_UNFUSED_ROW, dtypes[:1]),
             ("op", "decode step: attention op", dtypes), ("read", DECODE_READ_ROW, dtypes[:1]))
    for kind, label, kind_dtypes in kinds:
        for dtype in kind_dtypes:
            kv_bytes = 2 * B * H * ctx * hd * dtype.itemsize
            # The layer's weights and the K and V rows it writes (2 B dim values); the read-only
            # ceiling reads the weights and, instead, the cache's one spare position (as many values).
            layer_bytes = ((4 * dim * dim + 4 * dim) + 2 * B * dim) * dtype.itemsize if kind != "op" else 0
            ms = t[f"{kind} {_name(dtype)}"]
            gbs = kv_bytes / ms / 1e9
            all_gbs = (kv_bytes + layer_bytes) / ms / 1e9
            # Of copy: this step's bytes per second over the copy's, round by round (paired_ratio).
            copy_per_step = paired_ratio(times, "copy", f"{kind} {_name(dtype)}") / copy_bytes
            rows.append({"row": label, "dtype": _name(dtype), "ms": ms * 1e3, "kv_GB_per_s": gbs,
                         "of_copy": kv_bytes * copy_per_step, "all_GB_per_s": all_gbs,
                         "all_of_copy": (kv_bytes + layer_bytes) * copy_per_step,
                         "copy_GB_per_s": copy_gbs,
                         "vs_f32": t[f"{kind} float32"] / ms, "shape": f"B={B} ctx={ctx} dim={dim} H={H}"})
    return rows


def _generate_rows(ctx: int, dim: int) -> list[dict[str, float | str]]:
    """A tiny GPT generating from prompts of about ctx/2 tokens, with the KV cache and without it."""
    from ...models.gpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    p = max(1, ctx // 2)
    lengths = sorted({max(1, int(p * f)) for f in (1.0, 0.977, 0.967, 0.988)}, reverse=True)
    new_tokens = 32
    gpt_dim = min(256, dim)  # 256 at the default dim=768
    gpt_heads = 4 if gpt_dim % 4 == 0 else 1
    model = TinyGPT(GPTConfig(vocab_size=256, max_len=p + new_tokens + 44, dim=gpt_dim, n_layers=4,
                              n_heads=gpt_heads)).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    t = interleaved_medians({
        "cache": lambda: model.generate(prompts, new_tokens),
        "nocache": lambda: model.generate(prompts, new_tokens, use_cache=False),
    }, repeats=3, warmup=1)
    produced = len(prompts) * new_tokens
    shape = f"TinyGPT dim={gpt_dim} L=4, {len(prompts)} prompts of {min(lengths)}..{max(lengths)} + {new_tokens} new"
    return [{"row": "generate, KV cache", "dtype": "float32", "ms": t["cache"] * 1e3,
             "tokens_per_s": produced / t["cache"], "speedup": t["nocache"] / t["cache"], "shape": shape},
            {"row": "generate, no cache", "dtype": "float32", "ms": t["nocache"] * 1e3,
             "tokens_per_s": produced / t["nocache"], "speedup": 1.0, "shape": "recomputes the prefix every step"}]
