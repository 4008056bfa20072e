"""The README is a front page whose examples run: every ```python block runs as
written and prints the ```text block shown right after it; the page stays short
and its links to docs/ (and the docs' own relative links) resolve."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 200
TIMEOUT_S = 300

# A fenced block: ```lang on its own line, the body, ``` on its own line.
FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# A Markdown link or image target, up to an optional #anchor.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def fenced_blocks(text: str) -> list[tuple[str, str, int, int]]:
    """(language, body, start offset, end offset) of every fenced block, in order."""
    return [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]


def examples(text: str) -> list[tuple[int, str, str | None]]:
    """(line, code, expected stdout or None) of every python block. The expected
    output is a ```text block separated from the code by blank lines only."""
    blocks = fenced_blocks(text)
    found = []
    for i, (lang, body, start, end) in enumerate(blocks):
        if lang != "python":
            continue
        expected = None
        if i + 1 < len(blocks):
            next_lang, next_body, next_start, _ = blocks[i + 1]
            if next_lang == "text" and not text[end:next_start].strip():
                expected = next_body
        found.append((text.count("\n", 0, start) + 1, body, expected))
    return found


README_TEXT = README.read_text(encoding="utf-8")
EXAMPLES = examples(README_TEXT)


def _environment() -> dict[str, str]:
    """This process's environment, less a global float64 switch (each example must
    enable float64 itself), with this checkout first on the import path."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every example at once, each in its own process and empty folder (so
    nothing it sets, such as jax_enable_x64, reaches this process, and whatever it
    writes lands there); the tests wait for their own."""
    env = _environment()
    procs = {}
    for line, code, _ in EXAMPLES:
        cwd = tmp_path_factory.mktemp(f"readme_line{line}")
        procs[line] = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_parser_finds_blocks_and_their_outputs():
    text = "```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n```python\npass\n```\n"
    assert examples(text) == [(1, "print(1)\n", "1\n"), (9, "pass\n", None)]


def test_readme_has_the_three_examples_with_outputs():
    assert len(EXAMPLES) >= 3
    assert all(expected is not None for _, _, expected in EXAMPLES)


@pytest.mark.parametrize(
    "line, code, expected", EXAMPLES, ids=[f"line{line}" for line, _, _ in EXAMPLES]
)
def test_example_runs_and_prints_what_is_shown(runs, line, code, expected):
    proc = runs[line]
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"README example at line {line} ran past {TIMEOUT_S} s\n{stderr}")
    assert proc.returncode == 0, f"README example at line {line} failed:\n{stderr}"
    if expected is not None:
        assert stdout == expected, f"README example at line {line} printed:\n{stdout}"


def test_readme_is_a_short_front_page():
    lines = README_TEXT.count("\n") + (not README_TEXT.endswith("\n"))
    assert lines <= MAX_LINES, f"README.md: expected at most {MAX_LINES} lines, got {lines}"


def _relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_readme_links_to_docs_exist():
    links = [t for t in _relative_links(README_TEXT) if t.startswith("docs/")]
    assert links, "README.md links to nothing under docs/"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_docs_relative_links_exist(page):
    missing = [
        t
        for t in _relative_links(page.read_text(encoding="utf-8"))
        if not (page.parent / t).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
