"""Every code block of README.md and docs/*.md works on its own, and every relative link resolves.

The fenced blocks of each page are parsed here. A block's info string is its language, then
optional words (```` ```text layout ````). Every block must carry a language this file knows:

- ``python``: runs alone in a fresh interpreter (nothing from the page's other blocks), in an
  empty temporary directory; a traceback names the page and line;
- ``cpp``: compiled and linked alone against the installed package, with exactly the includes it
  shows: its ``#include`` lines go above ``main()``, the rest is the body of ``main()``. The
  downstream CMakeLists.txt is docs/cpp-api.md's ```cmake block, so that block is tested too;
- ``cmake``: the CMakeLists.txt of the C++ blocks' build (above);
- ``sh``: every command exists (``make -n TARGET`` succeeds; ``python -m causal_attention CMD
  --help``, ``torchrun ... -m causal_attention CMD`` and ``causal-attention-generate --help`` succeed
  and list every ``--option`` the page gives them);
- ``text``: not run (program output, trees). ``text layout`` is the repository layout: every path
  in it exists (an indented entry is under the entry above it; a line indented as far as the
  descriptions continues the description).

Inline code spans that start with ``make ``, ``python -m causal_attention `` or ``build/`` are
checked as commands too. README.md is at most README_MAX_LINES lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220
NOT_RUN = {"text"}
CHECKED_LANGUAGES = {"python", "cpp", "cmake", "sh"} | NOT_RUN


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    language: str
    words: tuple[str, ...]  # the info string's words after the language
    line: int  # 1-based line of the first line of code
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(text: str, page: str = "page.md") -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,}|~{3,})\s*(.*)$", lines[i])
        if fence is None:
            i += 1
            continue
        marker, info = fence.group(1), fence.group(2).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(marker)), None)
        assert end is not None, f"{page}:{i + 1}: a code block is never closed"
        language, words = (info[0], tuple(info[1:])) if info else ("", ())
        blocks.append(Block(page, language, words, i + 2, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = [b for page in PAGES if page.is_file() for b in fenced_blocks(page.read_text(), _relative(page))]


def _blocks(language: str) -> list[Block]:
    return [b for b in BLOCKS if b.language == language]


def test_the_parser_finds_fenced_blocks() -> None:
    text = "intro\n```python\nx = 1\n```\ntext\n````sh\nmake a\n```\nstill sh\n````\n```text layout\nsrc/\n```\n"
    assert fenced_blocks(text) == [
        Block("page.md", "python", (), 3, "x = 1\n"),
        Block("page.md", "sh", (), 7, "make a\n```\nstill sh\n"),
        Block("page.md", "text", ("layout",), 12, "src/\n"),
    ]


def test_the_pages_exist() -> None:
    for page in PAGES:
        assert page.is_file(), f"{_relative(page)} is missing"
    assert len(PAGES) > 2, "no page under docs/"


def test_every_block_has_a_language_this_file_checks() -> None:
    for block in BLOCKS:
        assert block.language, f"{block.page}:{block.line - 1}: a code block without a language tag"
        assert block.language in CHECKED_LANGUAGES, (
            f"{block.page}:{block.line - 1}: a ```{block.language} block, which no test checks; add a check here"
        )


def test_readme_is_a_front_door() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move details to docs/"


# --- links -------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]\n]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of each markdown link and image of a page, outside code blocks and spans."""
    found, in_block = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if re.match(r"^(`{3,}|~{3,})", line):
            in_block = not in_block
            continue
        if in_block:
            continue
        for match in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            found.append((number, match.group(1) or match.group(2)))
    return found


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation dropped, spaces to
    hyphens (a repeated heading's -1, -2 suffixes are not made)."""
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", page.read_text(), flags=re.S | re.M)  # not in code blocks
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_relative_links_resolve(page: Path) -> None:
    for line, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = page.parent / path if path else page
        assert linked.exists(), f"{_relative(page)}:{line}: the link {target} leads nowhere"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{_relative(page)}:{line}: {_relative(linked.resolve())} has no heading #{anchor}"


def test_anchors_are_githubs(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Title\n## The C++ generation program\n```sh\n# not a heading\n```\n### Our files: GPT.save\n")
    assert anchors(page) == {"title", "the-c-generation-program", "our-files-gptsave"}


def test_the_link_finder_finds_links(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[a](docs/a.md) and ![img](x.png)\n`[not](code.md)`\n```\n[no](block.md)\n```\n")
    assert _links(page) == [(1, "docs/a.md"), (1, "x.png")]


# --- python ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", _blocks("python"), ids=lambda b: b.where)
def test_python_block_runs_alone(block: Block, tmp_path: Path) -> None:
    """Each block in a fresh interpreter, in an empty directory: it imports and builds what it uses."""
    code = compile(block.code, block.where, "exec")  # a syntax error names the page and line here
    del code
    script = f"exec(compile({block.code!r}, {block.where!r}, 'exec'), {{'__name__': '__main__'}})"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, f"the python block at {block.where} failed:\n{result.stderr[-4000:]}"


# --- C++ ---------------------------------------------------------------------------------------


def _cmake_block() -> Block:
    blocks = [b for b in _blocks("cmake") if b.page == "docs/cpp-api.md"]
    assert len(blocks) == 1, "docs/cpp-api.md must show exactly one ```cmake block: the downstream CMakeLists.txt"
    return blocks[0]


def cpp_program(block: Block) -> str:
    """The block's #include lines, then main() holding the rest; nothing added."""
    lines = block.code.splitlines()
    includes = [line for line in lines if line.startswith("#include")]
    body = [line for line in lines if not line.startswith("#include")]
    return "\n".join([f"// {block.where}", *includes, "", "int main() {", *(f"  {l}" if l else "" for l in body),
                      "  return 0;", "}", ""])  # fmt: skip


def cmake_lists(cmake_block: str, targets: list[str]) -> str:
    """The page's CMakeLists.txt with its one target `app` (main.cpp) made once per C++ block."""
    lines = cmake_block.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(r"\bapp\b", line))
    head, tail = "\n".join(lines[:first]), "\n".join(lines[first:])
    assert "main.cpp" in tail, "the ```cmake block builds no main.cpp"
    per_target = [re.sub(r"\bapp\b", name, tail).replace("main.cpp", f"{name}.cpp") for name in targets]
    return "\n".join([head, *per_target, ""])


def test_cmake_lists_makes_one_target_per_block() -> None:
    block = "cmake_minimum_required(VERSION 3.18)\nproject(app LANGUAGES CXX)\nfind_package(x)\n" \
            "add_executable(app main.cpp)\ntarget_link_libraries(app PRIVATE x::x)\n"
    made = cmake_lists(block.replace("project(app", "project(demo"), ["b0", "b1"])
    assert "add_executable(b0 b0.cpp)" in made and "target_link_libraries(b1 PRIVATE x::x)" in made
    assert made.count("find_package") == 1


def _tool(name: str) -> str:
    """cmake or ninja from the venv (their pip packages), else from PATH."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: pip install {name} (make setup does)")
    return path


@pytest.fixture(scope="module")
def cpp_build(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One downstream project, one executable per C++ block, built with -k so that each block's
    result stands alone: target name -> the compiler's output for it ('' when it built)."""
    import torch

    import causal_attention

    config = Path(causal_attention.cmake_prefix_path) / "causal_attention" / "causal_attentionConfig.cmake"
    assert config.is_file(), f"{config} is missing: the package is not installed (make install)"
    source = tmp_path_factory.mktemp("cpp_blocks")
    targets = {f"block{i}": block for i, block in enumerate(_blocks("cpp"))}
    for name, block in targets.items():
        (source / f"{name}.cpp").write_text(cpp_program(block))
    lists = cmake_lists(_cmake_block().code, list(targets))
    (source / "CMakeLists.txt").write_text(lists.replace("find_package(causal_attention ",
                                                         f"find_package(causal_attention {metadata.version('causal_attention')} ", 1))
    build = source / "build"
    prefix_path = f"{causal_attention.cmake_prefix_path};{torch.utils.cmake_prefix_path}"
    configure = subprocess.run(
        [_tool("cmake"), "-S", str(source), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
         f"-DCMAKE_PREFIX_PATH={prefix_path}", "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert configure.returncode == 0, f"configuring the blocks' project failed:\n{configure.stdout}{configure.stderr}"
    jobs = str(os.cpu_count() or 1)
    subprocess.run([_tool("cmake"), "--build", str(build), "-j", jobs, "--", "-k", "0"], capture_output=True,
                   text=True, timeout=1800)  # fmt: skip
    results = {}
    for name in targets:
        if (build / name).is_file():
            results[name] = ""
        else:  # rebuild the one target to get its own errors
            one = subprocess.run([_tool("cmake"), "--build", str(build), "--target", name], capture_output=True,
                                 text=True, timeout=600)  # fmt: skip
            results[name] = one.stdout[-6000:] + one.stderr[-2000:] or "not built"
    return results


@pytest.mark.parametrize("index", range(len(_blocks("cpp"))), ids=lambda i: _blocks("cpp")[i].where)
def test_cpp_block_compiles_alone(index: int, cpp_build: dict[str, str]) -> None:
    block = _blocks("cpp")[index]
    assert not cpp_build[f"block{index}"], f"the C++ block at {block.where} does not build:\n{cpp_build[f'block{index}']}"


def test_cpp_program_adds_nothing() -> None:
    block = Block("p.md", "cpp", (), 2, "#include <a.h>\nint x = 1;\n")
    assert cpp_program(block) == "// p.md:2\n#include <a.h>\n\nint main() {\n  int x = 1;\n  return 0;\n}\n"


# --- commands ----------------------------------------------------------------------------------


def _inline_and_sh_commands() -> list[tuple[str, str]]:
    """(where, command) for the commands of sh blocks (a comment after # dropped, a line ending in
    a backslash joined to the next) and inline code spans that start with `make `,
    `python -m causal_attention ` or `build/`."""
    commands = []
    for block in _blocks("sh"):
        for line in re.sub(r"\\\n\s*", " ", block.code).splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append((block.where, command))
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            if span.startswith(("make ", "python -m causal_attention ", "build/")):
                commands.append((_relative(page), span.strip()))
    return commands


COMMANDS = _inline_and_sh_commands()
_CHECKED_PROGRAMS = ("make ", "python -m causal_attention ", "torchrun ", "causal-attention-generate ", "build/")


def test_every_command_is_one_this_file_checks() -> None:
    for where, command in COMMANDS:
        assert command.startswith(_CHECKED_PROGRAMS), f"{where}: unchecked command: {command}"


@pytest.mark.parametrize("target", sorted({c.split()[1] for _, c in COMMANDS if c.startswith("make ")}))
def test_make_targets_exist(target: str) -> None:
    result = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, f"make -n {target}: {result.stderr}"


def _cli_commands() -> dict[str, set[str]]:
    """Subcommand of `python -m causal_attention` (also under torchrun) -> the --options given it."""
    found: dict[str, set[str]] = {}
    for _, command in COMMANDS:
        words = command.split()
        if words[0] == "torchrun" and "-m" in words:
            words = ["python", *words[words.index("-m"):]]
        if words[:3] == ["python", "-m", "causal_attention"] and len(words) > 3:
            found.setdefault(words[3], set()).update(w.split("=")[0] for w in words[4:] if w.startswith("--"))
    return found


def _assert_lists_options(argv: list[str], options: set[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in options:
        assert re.search(rf"(^|\s|,){re.escape(option)}\b", result.stdout), f"{' '.join(argv)} shows no {option}"


@pytest.mark.parametrize("subcommand", sorted(_cli_commands()))
def test_cli_commands_exist_with_their_options(subcommand: str) -> None:
    _assert_lists_options([sys.executable, "-m", "causal_attention", subcommand, "--help"],
                          _cli_commands()[subcommand])  # fmt: skip


def test_generate_program_options() -> None:
    options = {w.split("=")[0] for _, c in COMMANDS if c.startswith("causal-attention-generate ")
               for w in c.split() if w.startswith("--")}  # fmt: skip
    assert options, "docs/deployment.md shows causal-attention-generate with its options; none found"
    program = shutil.which("causal-attention-generate", path=str(Path(sys.executable).parent))
    assert program, "causal-attention-generate is not installed next to the interpreter (make install)"
    _assert_lists_options([program, "--help"], options)


def test_programs_named_under_build_exist() -> None:
    """Commands such as `build/py/causal_attention_bench` (built by make install / make test)."""
    for where, command in COMMANDS:
        if command.startswith("build/"):
            program = command.split()[0]
            assert (ROOT / program).is_file(), f"{where}: {program} is not built (make install builds it)"


# --- layout ------------------------------------------------------------------------------------


def layout_paths(code: str) -> list[tuple[int, str]]:
    """(offset, path) of each entry of a layout tree. An entry is a line indented less than
    DESCRIPTION_COLUMN whose first word is a path; an indented entry is under the last entry
    indented less. Lines indented further continue a description; `<!-- ... -->` lines are
    placeholders."""
    entries: list[tuple[int, str]] = []  # (indent, path) of the open parents
    found = []
    for offset, line in enumerate(textwrap.dedent(code).splitlines()):
        indent = len(line) - len(line.lstrip())
        if not line.strip() or line.lstrip().startswith("<!--") or indent >= DESCRIPTION_COLUMN:
            continue
        name = line.split()[0]
        while entries and entries[-1][0] >= indent:
            entries.pop()
        path = (entries[-1][1] if entries else "") + name
        entries.append((indent, path if path.endswith("/") else path + "/"))
        found.append((offset, path))
    return found


DESCRIPTION_COLUMN = 16


def test_layout_paths_parse() -> None:
    tree = "src/pkg/          the package\n  sub/            a folder\n                  more words\n" \
           "    a.py          a file\n  b.py            another\n<!-- later -->\ntests/            tests\n"
    assert [p for _, p in layout_paths(tree)] == ["src/pkg/", "src/pkg/sub/", "src/pkg/sub/a.py", "src/pkg/b.py", "tests/"]


def test_layout_paths_exist() -> None:
    layouts = [b for b in _blocks("text") if "layout" in b.words]
    assert any(b.page == "README.md" for b in layouts), "the README has no ```text layout block"
    for block in layouts:
        for offset, path in layout_paths(block.code):
            assert (ROOT / path).exists(), f"{block.page}:{block.line + offset}: {path} does not exist"
