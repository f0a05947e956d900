"""The project's GPT against transformers' GPT2LMHeadModel on the same weights (GPT-2 124M by
default): a right-padded prefill forward, and generation for a ragged batch of prompts.

Both sides get the same weights (``GPT.from_huggingface``), the same thread count, and are timed
interleaved in one process (median of rounds). transformers runs with ``attn_implementation``
``"sdpa"`` and ``"eager"``; its batched generation needs left padding (given its attention_mask),
ours prefills the prompts right-padded into a static KV cache.

Shapes: B prompts / sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .timing import interleaved_medians


@dataclass(frozen=True)
class Row:
    """One comparison: section, what was timed, our time, theirs, and theirs / ours."""

    section: str
    name: str
    ours_ms: float
    theirs_ms: float

    @property
    def ratio(self) -> float:
        return self.theirs_ms / self.ours_ms


def _models(config_kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(ours, transformers sdpa, transformers eager) on the same random weights, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from .gpt import GPT

    torch.manual_seed(0)
    hf_sdpa = GPT2LMHeadModel(GPT2Config(**config_kwargs, attn_implementation="sdpa")).to(dtype).eval()
    hf_eager = GPT2LMHeadModel(GPT2Config(**config_kwargs, attn_implementation="eager")).to(dtype).eval()
    hf_eager.load_state_dict(hf_sdpa.state_dict())
    ours = GPT.from_huggingface(hf_sdpa).eval()
    return ours, hf_sdpa, hf_eager


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask), each (B, longest), prompts aligned to the right (left padding)."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(prompts), n, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, n - len(p):] = torch.tensor(p)
        mask[b, n - len(p):] = 1
    return ids, mask


def gpt2_rows(*, quick: bool = False, dtype: torch.dtype = torch.float32, repeats: int = 3,
              progress: Callable[[str], None] | None = None) -> list[Row]:
    """The rows for one dtype. quick: a 2-layer width-64 model and short sequences (for tests)."""
    say = progress or (lambda _: None)
    if quick:
        config: dict[str, Any] = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=257, n_positions=160)
        lengths, prompt_lengths, new_tokens = [64, 57, 40, 23], [40, 37, 44, 31], 8
    else:
        config = {}  # GPT2Config() is GPT-2 small (124M)
        lengths, prompt_lengths, new_tokens = [1024, 900, 700, 512], [512, 480, 530, 500], 32
    say(f"building the models ({dtype})")
    ours, hf_sdpa, hf_eager = _models(config, dtype)
    V, T = ours.config.vocab_size, max(lengths)
    label = "GPT-2 124M" if not quick else "GPT-2 (tiny)"
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (len(lengths), T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T), right padding
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in prompt_lengths]
    ids, attention_mask = left_padded(prompts)
    rows: list[Row] = []
    with torch.no_grad():
        say(f"{label} {name}: padded prefill forward, B={len(lengths)} T={T}")
        fwd = interleaved_medians({
            "ours": lambda: ours(tokens, mask),
            "sdpa": lambda: hf_sdpa(tokens, attention_mask=mask.long()).logits,
            "eager": lambda: hf_eager(tokens, attention_mask=mask.long()).logits,
        }, repeats=repeats, warmup=1)
        section = f"{label} {name}"
        shape = f"B={len(lengths)} T={T} lengths {lengths}"
        rows.append(Row(section, f"forward, right-padded ({shape}) vs transformers sdpa", fwd["ours"] * 1e3, fwd["sdpa"] * 1e3))
        rows.append(Row(section, f"forward, right-padded ({shape}) vs transformers eager", fwd["ours"] * 1e3, fwd["eager"] * 1e3))
        say(f"{label} {name}: generate {new_tokens} tokens for {len(prompts)} ragged prompts")
        gen_t = interleaved_medians({
            "ours": lambda: ours.generate(prompts, new_tokens),
            "sdpa": lambda: hf_sdpa.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0),
        }, repeats=max(1, repeats - 1), warmup=1)
        what = f"generate {new_tokens} tokens, prompts of {min(prompt_lengths)}..{max(prompt_lengths)}"
        rows.append(Row(section, f"{what} (prefill included) vs transformers generate, sdpa, left-padded",
                        gen_t["ours"] * 1e3, gen_t["sdpa"] * 1e3))
    return rows


def bf16_affordable(*, quick: bool, limit_s: float = 60.0) -> tuple[bool, str]:
    """Whether one bfloat16 padded forward of the model finishes within limit_s here (bfloat16
    matrix products are slow on CPUs without AVX512-BF16 / AMX)."""
    ours, _, _ = _models(dict(n_layer=2, n_embd=64, n_head=4, vocab_size=257, n_positions=160) if quick else {},
                         torch.bfloat16)
    T = 64 if quick else 1024
    tokens = torch.zeros(4, T, dtype=torch.int64)
    start = time.perf_counter()
    with torch.no_grad():
        ours(tokens[:1, : T // 4])
    seconds = (time.perf_counter() - start) * 16  # a quarter of the tokens of one of four sequences
    if seconds > limit_s:
        return False, f"one bfloat16 forward would take ~{seconds:.0f} s here (> {limit_s:.0f} s): bfloat16 GEMMs are slow on this CPU"
    return True, ""
