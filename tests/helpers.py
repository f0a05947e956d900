"""What several test files share: the backends and mask kinds, masks, the nn.MultiheadAttention
call, the error measure and tolerances. A plain module (not conftest), so that test files and
the subprocess workers import it like any other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

BACKENDS = ("cpp", "sdpa", "reference")
MASK_KINDS = ("none", "right", "random")

# Every test draws its own random inputs from a seed made of its id and CA_TEST_SEED (default 0):
# reproducible by default, and a new draw of every input with another CA_TEST_SEED.
BASE_SEED = int(os.environ.get("CA_TEST_SEED", "0"))

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


# oneDNN's own ISA for each path below avx512 (isa_env): ATEN_CPU_CAPABILITY avx2 and default, and
# avx512-bf16, AVX512 with bfloat16's products held below AMX.
_ONEDNN_ISA = {"avx2": "AVX2", "default": "SSE41", "avx512-bf16": "AVX512_CORE_BF16"}


def isa_env(capability: str, **extra: str) -> dict[str, str]:
    """The environment of a subprocess on one of the engine's instruction-set paths: os.environ with
    ATEN_CPU_CAPABILITY = capability and, below avx512, oneDNN held to the same ISA. (torch 2.13's CPU
    flash SDPA asks oneDNN whether to pack bfloat16 for AMX, and on an AMX CPU under avx2 it then raises
    "pack_vnni2 is only supported when avx512 is supported".) "avx512-bf16": AVX512 with oneDNN, and so
    the engine's bfloat16 pair kernel, held below AMX (vdpbf16ps instead of tiles)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.split("-")[0], **extra)
    if capability in _ONEDNN_ISA:
        env["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_ISA[capability]
    return env


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


def mha_forward(mha: nn.MultiheadAttention, x: Tensor, mask: Tensor | None) -> Tensor:
    """mha on x with the causal mask and (True = real) mask, as the contract compares them."""
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


# ---------------------------------------------------------------------------------------------
# C++ programs made from README.md's examples (the installed package's consumers).

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_cpp_block(heading: str = "## C++", *, page: Path = README) -> str:
    """The ```cpp block of page's section under heading (up to the next ## or ### heading); page:
    README.md or a docs/ page."""
    section = page.read_text().split(f"\n{heading}\n", 1)[1]
    section = section.split("\n## ", 1)[0].split("\n### ", 1)[0]
    match = re.search(r"^```cpp\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert match, f"no ```cpp block in the section '{heading}' of {page}"
    return match.group(1)


def example_program(block: str, *, made_by: str, includes: list[str], prologue: list[str], checks: str) -> str:
    """main.cpp: includes and the block's #include lines, then main() = prologue, the rest of the
    block, and the checks (which end main)."""
    lines = block.splitlines()
    body = "\n".join(line for line in lines if not line.startswith("#include")).strip("\n").splitlines()
    return "\n".join(
        [
            f"// Made by {made_by} from a README.md example.",
            *(f"#include <{name}>" for name in includes),
            *(line for line in lines if line.startswith("#include")),
            "",
            "int main() {",
            *(f"  {line}" for line in prologue),
            *(f"  {line}" if line else "" for line in body),
            checks + "}",
            "",
        ]
    )


def tool(bin_dir: str, name: str) -> str:
    """cmake or ninja from its pip package (in the venv, as the build uses), else from PATH."""
    path = shutil.which(name, path=bin_dir) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: pip install {name} (make setup does)")
    return path


def run(cmd: list[str], cwd: Path, timeout: float) -> str:
    """Runs cmd; fails the test with its output when it fails. Returns stdout and stderr together."""
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}"
    return proc.stdout


class OpLog(TorchDispatchMode):
    """The names of the ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))
