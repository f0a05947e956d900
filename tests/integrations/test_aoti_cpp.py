"""AOTInductor packages with the engine's ops inside, loaded in C++ (docs/deployment.md's example).

Python exports the demo-sized GPT and the layer (dynamic B and T), compiles each with
``torch._inductor.aoti_compile_and_package`` and writes them as ``gpt.pt2`` and ``layer.pt2``. A
downstream CMake project, built against the installed package as docs/cpp-api.md tells a C++ user, runs
docs/deployment.md's ```cpp block of the section "### An AOTInductor package in C++" (its #include lines above
``main``, the rest as the body), then runs the layer package on inputs written by Python
(``torch.save``, read with ``torch::pickle_load``) and writes every output with ``torch::pickle_save``.
Python reads them back (``torch.load``) and compares with the eager models on the same inputs, at
other sizes than the ones exported, with padding. The linker flag ``--as-needed`` is forced, so the
example must keep ``libcausal_attention.so`` linked by itself (the ops resolve by name at load time).
Two AOTInductor compiles and one C++ translation unit: about two minutes on two cores.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import cmake
import ninja
import pytest
import torch

import causal_attention
from causal_attention import CausalSelfAttention
from causal_attention.models import GPT, GPTConfig
from helpers import README, example_program, readme_cpp_block, rel_err, run, tool

SECTION = "### An AOTInductor package in C++"
DEPLOYMENT = README.parent / "docs" / "deployment.md"

CMAKE_LISTS = """\
cmake_minimum_required(VERSION 3.18)
project(aoti_example LANGUAGES CXX)
find_package(causal_attention {version} REQUIRED)
add_executable(aoti_example main.cpp)
target_link_libraries(aoti_example PRIVATE causal_attention::causal_attention)
# Linkers that drop shared libraries nothing references (many distributions' default): the example
# must reference the engine itself, or the package's calls to its ops find no schema.
target_link_options(aoti_example PRIVATE "LINKER:--as-needed")
"""

# After the example's code: the layer package on Python's inputs, then every output to cpp_out.pt.
CHECKS = """\
  std::ifstream file("layer_in.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto inputs = torch::pickle_load(bytes).toGenericDict();
  const auto x = inputs.at("x").toTensor();
  const auto x_mask = inputs.at("mask").toTensor();
  torch::inductor::AOTIModelPackageLoader layer("layer.pt2");
  const auto y = layer.run({x, x_mask})[0];
  c10::Dict<std::string, at::Tensor> outputs;
  outputs.insert("tokens", tokens);
  outputs.insert("mask", mask);
  outputs.insert("logits", logits);
  outputs.insert("layer_out", y);
  const auto saved = torch::pickle_save(c10::IValue(outputs));
  std::ofstream("cpp_out.pt", std::ios::binary).write(saved.data(), static_cast<std::streamsize>(saved.size()));
  std::cout << "aoti_example: done" << std::endl;
  return EXIT_SUCCESS;
"""

GPT_CONFIG = GPTConfig(vocab_size=13, max_len=27)  # the demo's model
LAYER_DIM, LAYER_HEADS = 96, 4  # head_dim 24


def compile_package(model: torch.nn.Module, args: tuple[torch.Tensor, ...], max_T: int, path: Path) -> None:
    """Exports model(*args) with dynamic B and T (every argument is (B, T, ...)) and compiles it."""
    B = torch.export.Dim("B", min=1, max=64)
    T = torch.export.Dim("T", min=1, max=max_T)
    program = torch.export.export(model, args, dynamic_shapes=tuple({0: B, 1: T} for _ in args), strict=False)
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def ragged_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) bool, right padding


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT, CausalSelfAttention]:
    """(directory holding gpt.pt2, layer.pt2, layer_in.pt and cpp_out.pt after the run, the GPT, the layer)."""
    work = tmp_path_factory.mktemp("aoti")
    program = example_program(
        readme_cpp_block(SECTION, page=DEPLOYMENT), made_by="tests/integrations/test_aoti_cpp.py", prologue=[], checks=CHECKS,
        includes=["cstdlib", "fstream", "iostream", "iterator", "string", "vector", "torch/serialize.h"])
    config = Path(causal_attention.cmake_prefix_path) / "causal_attention" / "causal_attentionConfig.cmake"
    assert config.is_file(), f"{config} is missing: the package is not installed (make install)"
    cmake_exe, ninja_exe = tool(cmake.CMAKE_BIN_DIR, "cmake"), tool(ninja.BIN_DIR, "ninja")
    project = work / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(CMAKE_LISTS.format(version=metadata.version("causal_attention")))
    (project / "main.cpp").write_text(program)
    build = project / "build"
    prefix_path = f"{causal_attention.cmake_prefix_path};{torch.utils.cmake_prefix_path}"

    def build_program() -> None:
        run(
            [cmake_exe, "-S", str(project), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja_exe}",
             f"-DCMAKE_PREFIX_PATH={prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
            cwd=project, timeout=300,
        )  # fmt: skip
        run([cmake_exe, "--build", str(build)], cwd=project, timeout=600)

    # The program compiles (one compiler process) while inductor compiles the packages.
    with ThreadPoolExecutor(max_workers=1) as pool:
        program_built = pool.submit(build_program)
        torch.manual_seed(0)
        gpt = GPT(GPT_CONFIG).eval()
        layer = CausalSelfAttention(LAYER_DIM, LAYER_HEADS).eval()
        # Exported at one size (with padding), run at others.
        tokens = torch.randint(0, GPT_CONFIG.vocab_size, (2, 9))
        compile_package(gpt, (tokens, ragged_mask([9, 6], 9)), GPT_CONFIG.max_len, work / "gpt.pt2")
        compile_package(layer, (torch.randn(2, 9, LAYER_DIM), ragged_mask([9, 6], 9)), 4096, work / "layer.pt2")
        x = torch.randn(3, 113, LAYER_DIM)
        torch.save({"x": x, "mask": ragged_mask([113, 57, 1], 113)}, work / "layer_in.pt")
        program_built.result()
    proc = subprocess.run(
        [str(build / "aoti_example")], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "aoti_example: done" in proc.stdout, (
        f"aoti_example exited with {proc.returncode}:\n{proc.stdout[-4000:]}"
    )
    return work, gpt, layer


def cpp_outputs(work: Path) -> dict[str, torch.Tensor]:
    """cpp_out.pt: torch::pickle_save of a typed Dict, which carries a type tag that weights_only refuses;
    the file is the test's own program's output."""
    return torch.load(work / "cpp_out.pt", weights_only=False)


def test_gpt_package_in_cpp_equals_eager(built: tuple[Path, GPT, CausalSelfAttention]) -> None:
    work, gpt, _ = built
    out = cpp_outputs(work)
    tokens, mask, logits = out["tokens"], out["mask"], out["logits"]
    assert tokens.shape == (2, 5) and mask.dtype == torch.bool and not bool(mask.all()), "the example's inputs changed"
    with torch.no_grad():
        expected = gpt(tokens, mask)  # (B, T, V), zeros at padding
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    assert rel_err(logits, expected) <= 1e-5
    assert bool((logits[~mask] == 0).all()), "padding logits are not zero"


def test_layer_package_in_cpp_equals_eager(built: tuple[Path, GPT, CausalSelfAttention]) -> None:
    work, _, layer = built
    inputs, out = torch.load(work / "layer_in.pt"), cpp_outputs(work)
    with torch.no_grad():
        expected = layer(inputs["x"], inputs["mask"])
    assert out["layer_out"].shape == expected.shape
    assert rel_err(out["layer_out"], expected) <= 1e-5


def test_gpt_package_in_python_equals_eager(built: tuple[Path, GPT, CausalSelfAttention]) -> None:
    """The same package through Python's loader, at the longest T it allows and B = 1."""
    work, gpt, _ = built
    loaded = torch._inductor.aoti_load_package(str(work / "gpt.pt2"))
    T = GPT_CONFIG.max_len
    for tokens, mask in [
        (torch.randint(0, GPT_CONFIG.vocab_size, (1, T)), ragged_mask([T], T)),
        (torch.randint(0, GPT_CONFIG.vocab_size, (4, 7)), ragged_mask([7, 1, 4, 6], 7)),
    ]:
        with torch.no_grad():
            assert rel_err(loaded(tokens, mask), gpt(tokens, mask)) <= 1e-5


def test_gpt_package_refuses_tokens_out_of_range(built: tuple[Path, GPT, CausalSelfAttention]) -> None:
    """A token id outside [0, vocab_size) is a clear error from the compiled package (not an abort
    inside the embedding's parallel loop), as in eager."""
    work, gpt, _ = built
    loaded = torch._inductor.aoti_load_package(str(work / "gpt.pt2"))
    for bad in (GPT_CONFIG.vocab_size, -1):
        tokens = torch.randint(0, GPT_CONFIG.vocab_size, (2, 5))
        tokens[1, 3] = bad
        for model in (loaded, gpt):
            with pytest.raises(RuntimeError, match=r"tokens must be in \[0, vocab_size=13\)"):
                model(tokens, ragged_mask([5, 4], 5))
