"""The project's GPT against transformers' GPT2LMHeadModel on the same weights (GPT-2 124M by
default): a right-padded prefill forward, and generation for a ragged batch of prompts.

Both sides get the same weights (``from_huggingface``), the same thread count, and are timed
interleaved in one process (median of rounds). transformers runs with ``attn_implementation``
``"sdpa"`` and ``"eager"``; its batched generation needs left padding (given its attention_mask),
ours prefills the prompts right-padded into a static KV cache. Rows: the whole forward with logits
at every position; a prefill that needs the logits at each sequence's last real token only (ours:
``GPT.last_logits``; transformers: its hidden states, then lm_head at those positions); generation.

Shapes: B prompts / sequences, T tokens, V vocabulary.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .report import Row, interleaved_medians

# (lengths of the padded forward, prompt lengths, new tokens)
SIZES = {
    "full": ([1024, 900, 700, 512], [512, 480, 530, 500], 32),
    "reduced": ([128, 113, 88, 64], [64, 60, 66, 62], 8),  # bfloat16 on CPUs without native bf16 GEMMs
    "quick": ([64, 57, 40, 23], [40, 37, 44, 31], 8),  # a 2-layer width-64 model (tests)
}


def _row(section: str, name: str, ours_s: float, theirs_s: float) -> Row:
    return Row(section, name, ours_s * 1e3, theirs_s * 1e3, theirs_s / ours_s)


def _models(config_kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(ours, transformers sdpa, transformers eager) on the same random weights, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from ...models.convert import from_huggingface

    torch.manual_seed(0)
    hf_sdpa = GPT2LMHeadModel(GPT2Config(**config_kwargs, attn_implementation="sdpa")).to(dtype).eval()
    hf_eager = GPT2LMHeadModel(GPT2Config(**config_kwargs, attn_implementation="eager")).to(dtype).eval()
    hf_eager.load_state_dict(hf_sdpa.state_dict())
    ours = from_huggingface(hf_sdpa).eval()
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


def gpt2_rows(*, size: str = "full", dtype: torch.dtype = torch.float32, repeats: int = 3,
              progress: Callable[[str], None] | None = None) -> list[Row]:
    """The rows for one dtype at one of SIZES ("quick": a 2-layer width-64 model, for tests)."""
    say = progress or (lambda _: None)
    quick = size == "quick"
    config: dict[str, Any] = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=257, n_positions=160) if quick else {}
    lengths, prompt_lengths, new_tokens = SIZES[size]
    say(f"building the models ({dtype})")
    ours, hf_sdpa, hf_eager = _models(config, dtype)
    V, T = ours.config.vocab_size, max(lengths)
    label = "GPT (ours) vs GPT-2 124M" if not quick else "GPT (ours) vs GPT-2 (tiny)"
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype, str(dtype))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (len(lengths), T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T), right padding
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in prompt_lengths]
    ids, attention_mask = left_padded(prompts)
    rows: list[Row] = []
    with torch.no_grad():
        say(f"{label} {name}: right-padded forward, B={len(lengths)} T={T}")
        fwd = interleaved_medians({
            "ours": lambda: ours(tokens, mask),
            "sdpa": lambda: hf_sdpa(tokens, attention_mask=mask.long()).logits,
            "eager": lambda: hf_eager(tokens, attention_mask=mask.long()).logits,
        }, repeats=repeats, warmup=1)
        section = f"{label} {name}"
        shape = f"B={len(lengths)} T={T} lengths {lengths}"
        rows.append(_row(section, f"forward, logits everywhere ({shape}) vs transformers sdpa", fwd["ours"], fwd["sdpa"]))
        rows.append(_row(section, f"forward, logits everywhere ({shape}) vs transformers eager", fwd["ours"], fwd["eager"]))
        say(f"{label} {name}: prefill for generation (logits at each sequence's last real token)")
        lengths_t = torch.tensor(lengths)
        rows_b = torch.arange(len(lengths))

        def hf_last(model: Any) -> Callable[[], Tensor]:
            # What a careful transformers user does with right padding: hidden states, then the head
            # at each sequence's last real token only.
            def run() -> Tensor:
                hidden = model.transformer(tokens, attention_mask=mask.long(), use_cache=False).last_hidden_state
                return model.lm_head(hidden[rows_b, lengths_t - 1])  # (B, V)
            return run

        last = interleaved_medians({
            "ours": lambda: ours.last_logits(tokens, lengths_t),
            "sdpa": hf_last(hf_sdpa),
            "eager": hf_last(hf_eager),
        }, repeats=repeats, warmup=1)
        what_last = f"prefill, logits at the last real token ({shape})"
        rows.append(_row(section, f"{what_last} vs transformers sdpa", last["ours"], last["sdpa"]))
        rows.append(_row(section, f"{what_last} vs transformers eager", last["ours"], last["eager"]))
        say(f"{label} {name}: generate {new_tokens} tokens for {len(prompts)} ragged prompts")
        gen_t = interleaved_medians({
            "ours": lambda: ours.generate(prompts, new_tokens),
            "sdpa": lambda: hf_sdpa.generate(ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0),
        }, repeats=max(1, repeats - 1), warmup=1)
        what = f"generate {new_tokens} tokens, prompts of {min(prompt_lengths)}..{max(prompt_lengths)}"
        rows.append(_row(section, f"{what} (prefill included) vs transformers generate, sdpa, left-padded",
                         gen_t["ours"], gen_t["sdpa"]))
    return rows
