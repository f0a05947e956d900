"""bench-llama-cpp's parts that need no PyPI: the AVX2 hold of its --isa avx2 (the engine's side runs
under AVX2_ENV, so it must then run the AVX2 build) and its argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from causal_attention.tools.bench import llama_cpp


def test_the_avx2_environment_holds_the_engine_to_avx2() -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2: nothing to hold")
    assert llama_cpp.engine_isa(llama_cpp.AVX2_ENV) == "AVX2"
    assert llama_cpp.engine_isa({}) == torch.ops.causal_attention.cpu_capability()


@pytest.mark.parametrize("options, message", [({"isa": "avx3"}, "isa must be one of"),
                                              ({"model": "gpt3"}, "model must be one of")])
def test_bad_options_are_named(tmp_path: Path, options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_cpp.main(work=tmp_path, out_dir=tmp_path, runs=1, threads=1, **options)  # type: ignore[arg-type]
