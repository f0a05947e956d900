"""Every code block of README.md works: python blocks run, sh commands exist, layout paths exist.

The README's fenced blocks are parsed here, and every block must carry a language tag this file
knows how to check; a block in a new language fails until a check for it is added:

- ``python``: run in order in one fresh interpreter (the blocks form one session: the second
  continues from the first), at the README's own sizes;
- ``sh``: every command exists (``make -n TARGET`` succeeds; ``python -m causal_attention CMD
  --help`` succeeds and lists every ``--option`` the README gives it);
- ``text``: the repository layout: every path in its first column exists;
- inline commands: ``make TARGET`` and ``python -m causal_attention CMD`` as for sh blocks, and
  ``build/...`` programs exist;
- ``cpp``: compiled against the installed package and run by tests/test_cpp_package.py, not here
  (CPP_BLOCKS says how many that test covers, so a new C++ block fails here until it is covered).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CHECKED_LANGUAGES = {"python", "sh", "text", "cpp"}
CPP_BLOCKS = 2  # built and run: the C++ example by tests/test_cpp_package.py, the AOTInductor one by tests/test_aoti_cpp.py


@dataclass(frozen=True)
class Block:
    language: str
    line: int  # 1-based line of the first line of code
    code: str


def readme_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,}|~{3,})\s*(\S*)", lines[i])
        if fence is None:
            i += 1
            continue
        marker, language = fence.group(1), fence.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(marker)), None)
        assert end is not None, f"README.md:{i + 1}: a code block is never closed"
        blocks.append(Block(language, i + 2, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def _blocks(language: str) -> list[Block]:
    return [b for b in BLOCKS if b.language == language]


def test_the_parser_finds_fenced_blocks() -> None:
    text = "intro\n```python\nx = 1\n```\ntext\n````sh\nmake a\n```\nstill sh\n````\n```\nplain\n```\n"
    assert readme_blocks(text) == [
        Block("python", 3, "x = 1\n"),
        Block("sh", 7, "make a\n```\nstill sh\n"),
        Block("", 12, "plain\n"),
    ]


def test_every_block_has_a_language_this_file_checks() -> None:
    assert BLOCKS, "no code block found in README.md"
    for block in BLOCKS:
        assert block.language, f"README.md:{block.line - 1}: a code block without a language tag"
        assert block.language in CHECKED_LANGUAGES, (
            f"README.md:{block.line - 1}: a ```{block.language} block, which no test checks; add a check here"
        )
    assert len(_blocks("cpp")) == CPP_BLOCKS, "C++ blocks changed: update tests/test_cpp_package.py and CPP_BLOCKS"
    assert _blocks("python") and _blocks("sh")


_SESSION = """
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for line, code in blocks:
    exec(compile(code, f"README.md (block at line {{line}})", "exec"), namespace)
"""


def test_python_blocks_run_in_order() -> None:
    """The python blocks as one session in a fresh interpreter; a traceback names the README line."""
    blocks = [(b.line, b.code) for b in _blocks("python")]
    script = _SESSION.format(blocks=blocks)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, f"a README python block failed:\n{result.stderr[-4000:]}"


def _inline_and_sh_commands() -> list[str]:
    """The commands of the sh blocks (a comment after # dropped) and of inline code spans that start
    with ``make `` or ``python -m causal_attention``."""
    commands = []
    for block in _blocks("sh"):
        for line in block.code.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append(command)
    for span in re.findall(r"`([^`\n]+)`", README.read_text()):
        if span.startswith(("make ", "python -m causal_attention ")):
            commands.append(span.strip())
    return commands


COMMANDS = _inline_and_sh_commands()


def test_every_sh_command_is_one_this_file_checks() -> None:
    for command in COMMANDS:
        assert command.startswith(("make ", "python -m causal_attention ")), f"unchecked README command: {command}"


@pytest.mark.parametrize("target", sorted({c.split()[1] for c in COMMANDS if c.startswith("make ")}))
def test_make_targets_exist(target: str) -> None:
    result = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, f"make -n {target}: {result.stderr}"


def _cli_commands() -> dict[str, set[str]]:
    """Subcommand -> the --options the README passes it."""
    found: dict[str, set[str]] = {}
    for command in COMMANDS:
        words = command.split()
        if words[:3] == ["python", "-m", "causal_attention"] and len(words) > 3:
            found.setdefault(words[3], set()).update(w for w in words[4:] if w.startswith("--"))
    return found


@pytest.mark.parametrize("subcommand", sorted(_cli_commands()))
def test_cli_commands_exist_with_their_options(subcommand: str) -> None:
    result = subprocess.run([sys.executable, "-m", "causal_attention", subcommand, "--help"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in _cli_commands()[subcommand]:
        assert re.search(rf"(^|\s){re.escape(option)}\b", result.stdout), f"{subcommand} has no option {option}"


def test_programs_it_names_under_build_exist() -> None:
    """Inline commands such as `build/py/causal_attention_bench` (built by make install / make test)."""
    programs = [span.split()[0] for span in re.findall(r"`([^`\n]+)`", README.read_text()) if span.startswith("build/")]
    for program in programs:
        assert (ROOT / program).is_file(), f"README names {program}, which the build did not make"


def test_layout_paths_exist() -> None:
    """Each entry of the layout block starts with a path of the repository (an indented line
    continues the description above it)."""
    blocks = _blocks("text")
    assert blocks, "the README has no layout block"
    for block in blocks:
        for offset, line in enumerate(textwrap.dedent(block.code).splitlines()):
            if line.strip() and not line[0].isspace():
                path = line.split()[0]
                assert (ROOT / path).exists(), f"README.md:{block.line + offset}: {path} does not exist"
