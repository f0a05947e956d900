"""The shared corpus of checkpoint directories, tests/data/checkpoint_cases.json (its "about" says
what a case holds): written here for GPT.load and the C++ program; csrc/tests/test_gpt.cpp writes
the same directories for load_gpt, so Python and C++ accept and refuse the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from causal_attention.models import GPT, GPTConfig

CORPUS: dict[str, Any] = json.loads((Path(__file__).resolve().parents[1] / "data" / "checkpoint_cases.json").read_text())
CASES: list[dict[str, Any]] = CORPUS["cases"]
ERROR_CASES = [case for case in CASES if "error" in case]
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def config_text(case: dict[str, Any]) -> str:
    if "config_text" in case:
        return case["config_text"]
    config = {**CORPUS["base_config"], **case.get("config", {}).get("set", {})}
    for key in case.get("config", {}).get("remove", []):
        del config[key]
    return json.dumps(config, indent=2)


def tensors(case: dict[str, Any]) -> dict[str, Tensor]:
    """The base model's state (random, float32), changed as the case says."""
    base = {k: v for k, v in CORPUS["base_config"].items() if k != "format"}
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(t.shape, generator=gen) for name, t in GPT(GPTConfig(**base)).state_dict().items()}
    spec = case.get("tensors", {})
    if "all_dtype" in spec:
        state = {name: t.to(DTYPES[spec["all_dtype"]]) for name, t in state.items()}
    for name, dtype in spec.get("dtype", {}).items():
        state[name] = state[name].to(DTYPES[dtype])
    for name, shape in spec.get("shape", {}).items():
        state[name] = torch.zeros(shape, dtype=state[name].dtype)
    for name in spec.get("remove", []):
        del state[name]
    for name, added in spec.get("add", {}).items():
        state[name] = torch.zeros(added["shape"], dtype=DTYPES[added["dtype"]])
    return state


def write(case: dict[str, Any], directory: Path) -> dict[str, Tensor]:
    """directory/config.json and directory/model.safetensors for case; returns the tensors written."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config_text(case))
    state = tensors(case)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "causal_attention.gpt"})
    return state
