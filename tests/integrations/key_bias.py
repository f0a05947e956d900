"""The key bias of a trained GPT: the one parameter whose float32 value is rounding noise (shared
by tests/integrations/test_parallel.py and tests/integrations/dist_worker.py; a plain module, so that the worker does not
import conftest)."""

from __future__ import annotations

import torch
from torch import Tensor


def without_key_bias(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters without the key third of each qkv bias. Its gradient is exactly zero in
    exact arithmetic (a key bias adds q . b_k to every score of a row, which the softmax cancels),
    so in float32 it is pure rounding residue (~1e-8, the size of Adam's eps), which Adam turns
    into steps of order lr whatever its size: its trained value is noise and does not change any
    output. The float64 comparisons keep it (there eps dwarfs the residue)."""
    out = {}
    for name, value in state.items():
        if name.endswith("attn.qkv.bias"):
            dim = value.shape[0] // 3
            value = torch.cat([value[:dim], value[2 * dim:]])
        out[name] = value
    return out


def key_biases(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The key third of each qkv bias, by parameter name."""
    out = {}
    for name, value in state.items():
        if name.endswith("attn.qkv.bias"):
            dim = value.shape[0] // 3
            out[name] = value[dim:2 * dim]
    return out
