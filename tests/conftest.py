"""Shared helpers: the nn.MultiheadAttention twin, masks, and error measures."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from torch import Tensor, nn

from causal_attention import CausalSelfAttention

torch.set_num_threads(2)

BACKENDS = ("cpp", "sdpa", "reference")
MASK_KINDS = ("none", "right", "random")


def make_mask(kind: str, B: int, T: int, *, generator: torch.Generator | None = None) -> Tensor | None:
    """(B, T) bool, True = real. 'right': lengths uniform in [1, T]; 'random': key 0 kept real."""
    if kind == "none":
        return None
    if kind == "right":
        lengths = torch.randint(1, T + 1, (B, 1), generator=generator)
        return torch.arange(T)[None, :] < lengths
    if kind == "random":
        mask = torch.rand(B, T, generator=generator) < 0.6
        mask[:, 0] = True
        return mask
    raise ValueError(kind)


def mha_twin(attn: CausalSelfAttention) -> nn.MultiheadAttention:
    """nn.MultiheadAttention holding copies of attn's weights."""
    p = attn.qkv.weight
    mha = nn.MultiheadAttention(attn.dim, attn.n_heads, batch_first=True, device=p.device, dtype=p.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(attn.qkv.weight)
        mha.in_proj_bias.copy_(attn.qkv.bias)
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias)
    mha.train(attn.training)
    return mha


def mha_forward(mha: nn.MultiheadAttention, x: Tensor, mask: Tensor | None) -> Tensor:
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # True = not allowed
    out, _ = mha(x, x, x, attn_mask=causal, key_padding_mask=None if mask is None else ~mask, need_weights=False)
    return out


def rel_err(a: Tensor, b: Tensor) -> float:
    """max |a - b| relative to max(1, max |b|), in float64."""
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()


TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


# Every test draws its own random inputs from a seed made of its id and CA_TEST_SEED (default 0):
# reproducible by default, and a new draw of every input with another CA_TEST_SEED.
BASE_SEED = int(os.environ.get("CA_TEST_SEED", "0"))


def pytest_report_header() -> str:
    return f"causal_attention: CA_TEST_SEED={BASE_SEED}"


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ BASE_SEED)
