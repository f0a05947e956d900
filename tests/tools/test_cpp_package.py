"""The installed C++ package: a downstream CMake project builds README.md's C++ example against it.

The project, made in a temporary directory, does what the README tells a C++ user to do:
``find_package(causal_attention)`` with ``causal_attention.cmake_prefix_path`` and torch's prefix in
``CMAKE_PREFIX_PATH``, then links ``causal_attention::causal_attention``. Its ``main()`` is the
README's ```cpp block (its ``#include`` lines above ``main``, the rest as the body, so the README
example cannot rot), followed by checks on the example's ``attn``, ``x``, ``mask`` and ``out``.
It compiles one translation unit with torch's headers: about a minute on a two-core machine.
"""

from __future__ import annotations

import re
import subprocess
from importlib import metadata
from pathlib import Path

import cmake
import ninja
import torch

import causal_attention
from helpers import example_program, readme_cpp_block, run, tool

CMAKE_LISTS = """\
cmake_minimum_required(VERSION 3.18)
project(readme_example LANGUAGES CXX)
find_package(causal_attention {version} REQUIRED)
add_executable(readme_example main.cpp)
target_link_libraries(readme_example PRIVATE causal_attention::causal_attention)
"""

# The checks after the README's code. Each one could fail: output shape, causality with and without
# the padding mask (changing x at the last position leaves every earlier output bit-identical), and
# the padding mask honoured (a real position's output is the unmasked one: it sees only real keys;
# a padded position's is not: it sees fewer keys than without the mask).
CHECKS = """\
  const int64_t T = x.size(1);
  auto x_last = x.clone();
  x_last.select(1, T - 1).add_(1.0);  // x changed at the last position only
  const auto before = [&](const at::Tensor& y) { return y.narrow(1, 0, T - 1); };
  const auto out_last = attn->forward(x_last, mask);
  const auto plain = attn->forward(x);
  const auto plain_last = attn->forward(x_last);
  const bool causal_masked = torch::equal(before(out), before(out_last)) &&
                             !torch::equal(out.select(1, T - 1), out_last.select(1, T - 1));
  const bool causal = torch::equal(before(plain), before(plain_last)) &&
                      !torch::equal(plain.select(1, T - 1), plain_last.select(1, T - 1));
  bool padding = true;
  const auto lengths = mask.sum(1);
  for (int64_t b = 0; b < x.size(0); ++b) {
    const int64_t n = lengths[b].item<int64_t>();
    padding = padding && torch::allclose(out[b].narrow(0, 0, n), plain[b].narrow(0, 0, n), 1e-4, 1e-5);
    if (n < T) {
      padding = padding && !torch::allclose(out[b].narrow(0, n, T - n), plain[b].narrow(0, n, T - n), 1e-4, 1e-5);
    }
  }
  const auto shape = [](const at::Tensor& t) {
    std::string s;
    for (const int64_t n : t.sizes()) s += (s.empty() ? "" : "x") + std::to_string(n);
    return s;
  };
  std::cout << "readme_example: x=" << shape(x) << " out=" << shape(out) << " causal=" << causal
            << " causal_masked=" << causal_masked << " padding=" << padding << std::endl;
  return out.sizes() == x.sizes() && causal && causal_masked && padding ? EXIT_SUCCESS : EXIT_FAILURE;
"""

RESULT = re.compile(
    r"^readme_example: x=(?P<x>\S+) out=(?P<out>\S+) causal=(?P<causal>[01]) "
    r"causal_masked=(?P<causal_masked>[01]) padding=(?P<padding>[01])$",
    re.MULTILINE,
)


def test_readme_example_builds_against_installed_package(tmp_path: Path) -> None:
    config = Path(causal_attention.cmake_prefix_path) / "causal_attention" / "causal_attentionConfig.cmake"
    assert config.is_file(), f"{config} is missing: the package is not installed (make install)"
    cmake_exe = tool(cmake.CMAKE_BIN_DIR, "cmake")
    ninja_exe = tool(ninja.BIN_DIR, "ninja")
    (tmp_path / "CMakeLists.txt").write_text(CMAKE_LISTS.format(version=metadata.version("causal_attention")))
    (tmp_path / "main.cpp").write_text(example_program(
        readme_cpp_block(), made_by="tests/tools/test_cpp_package.py", includes=["cstdint", "cstdlib", "iostream", "string"],
        prologue=["torch::manual_seed(0);"], checks=CHECKS))
    build = tmp_path / "build"
    prefix_path = f"{causal_attention.cmake_prefix_path};{torch.utils.cmake_prefix_path}"
    run(
        [cmake_exe, "-S", str(tmp_path), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja_exe}",
         f"-DCMAKE_PREFIX_PATH={prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    log = run([cmake_exe, "--build", str(build), "--verbose"], cwd=tmp_path, timeout=600)
    # The exported target carries the C++ standard torch's headers need.
    assert re.search(r"-std=(gnu|c)\+\+(20|2a)\b", log), f"not compiled as C++20:\n{log}"

    proc = subprocess.run(
        [str(build / "readme_example")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=120,
    )  # fmt: skip
    result = RESULT.search(proc.stdout)
    assert result, f"readme_example printed no result line (exit {proc.returncode}):\n{proc.stdout}"
    assert result["out"] == result["x"], f"output shape: {result.group(0)}"
    causal = "with x changed at the last position, an earlier output changed or the last did not"
    assert result["causal"] == "1", f"{causal}: {result.group(0)}"
    assert result["causal_masked"] == "1", f"{causal} (with the padding mask): {result.group(0)}"
    assert result["padding"] == "1", f"the padding mask was not honoured: {result.group(0)}"
    assert proc.returncode == 0, proc.stdout
