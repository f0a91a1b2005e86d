"""The user docs are executable: every ```python block of the pages under ``docs/``
listed in ``PAGES`` runs, and prints what the page says it prints.

Rules for the pages:

- A ```python block runs as a script of its own (fresh interpreter, so a fresh
  namespace, fresh logging and no event loop left over), with warnings as errors and
  envq's ``STRICT`` move checking on, under a timeout.
- A line ``<!-- no-run -->`` just before a block (blank lines allowed in between) marks
  it as a fragment that is not run.
- A line ``<!-- pytest -->`` just before a block marks it as a test module: it is
  run with ``pytest -p envq.pytest_plugin``, and every test in it must pass.
- A line ``<!-- output -->`` after a runnable block, followed by a ```text block, is
  the block's expected standard output, compared line by line (trailing blanks
  ignored).
- Relative links between the pages point at pages that exist, and their ``#anchors``
  at headings that exist (slugs as mkdocs' default ``toc`` extension makes them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The user documentation pages whose examples must run.
PAGES = (
    "index.md",
    "concepts.md",
    "lifecycle.md",
    "outcomes.md",
    "capacity.md",
    "testing.md",
    "events.md",
    "observability.md",
    "retries.md",
    "schedules.md",
    "threads.md",
    "ports.md",
    "coming-from.md",
)
NO_RUN = "<!-- no-run -->"
PYTEST = "<!-- pytest -->"
OUTPUT = "<!-- output -->"
MARKERS = (NO_RUN, PYTEST, OUTPUT)
#: Real seconds an example may take (virtual-time examples take a fraction of one).
TIMEOUT = 60.0
#: Runs an example file as ``__main__`` with envq's table checks on.
RUNNER = (
    "import runpy, sys\n"
    "import envq._machine\n"
    "envq._machine.STRICT = True\n"
    "runpy.run_path(sys.argv[1], run_name='__main__')\n"
)
#: Turns envq's table checks on for test-module examples.
CONFTEST = "import envq._machine\n\nenvq._machine.STRICT = True\n"
_FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str
    #: 1-based line of the opening fence.
    line: int
    lang: str
    code: str
    #: The nearest non-blank line before the fence.
    marker: str


@dataclass(frozen=True)
class Example:
    """A runnable ```python block and the output its page promises (if any)."""

    page: str
    line: int
    code: str
    expected: str | None
    #: Run as a pytest test module rather than as a script.
    is_test_module: bool = False

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page}:{start + 1}: unclosed code fence")
        marker = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n", marker))
        i += 1
    return found


def examples(page: str) -> list[Example]:
    """The runnable ```python blocks of ``page`` with their expected output."""
    found: list[Example] = []
    all_blocks = blocks(page)
    for n, block in enumerate(all_blocks):
        if block.lang != "python" or block.marker == NO_RUN:
            continue
        expected = None
        following = all_blocks[n + 1] if n + 1 < len(all_blocks) else None
        if following is not None and following.marker == OUTPUT:
            assert following.lang == "text", f"{page}:{following.line}: output must be ```text"
            expected = following.code
        found.append(Example(page, block.line, block.code, expected, block.marker == PYTEST))
    return found


ALL_EXAMPLES = [example for page in PAGES for example in examples(page)]


def _normalise(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


@pytest.mark.parametrize("example", ALL_EXAMPLES, ids=[e.name for e in ALL_EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path) -> None:
    """The block runs to completion, quietly on stderr, and prints what the page shows."""
    stem = re.sub(r"\W", "_", example.name)
    script = tmp_path / f"test_{stem}.py"
    script.write_text(example.code, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if example.is_test_module:
        (tmp_path / "conftest.py").write_text(CONFTEST, encoding="utf-8")
        command = [sys.executable, "-m", "pytest", "-q", "-W", "error", "-p", "envq.pytest_plugin"]
        # pytest-asyncio (a dev dependency) stays out: the page's module is envq's.
        command += ["-p", "no:cacheprovider", "-p", "no:asyncio", "--strict-markers", str(script)]
    else:
        command = [sys.executable, "-W", "error", "-c", RUNNER, str(script)]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=tmp_path,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{example.name}: did not finish within {exc.timeout} s")
    assert done.returncode == 0, (
        f"{example.name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    )
    if example.expected is not None:
        assert _normalise(done.stdout) == _normalise(example.expected), (
            f"{example.name}: output differs from the page"
        )


def test_every_page_has_examples() -> None:
    """Each page exists and has at least one runnable example."""
    for page in PAGES:
        assert (DOCS / page).is_file(), page
        assert examples(page), f"{page} has no runnable ```python block"


def test_markers_are_attached() -> None:
    """A no-run marker precedes a ```python block; an output marker a ```text block that
    follows a runnable example."""
    for page in PAGES:
        text_blocks = blocks(page)
        for n, block in enumerate(text_blocks):
            if block.marker in (NO_RUN, PYTEST):
                assert block.lang == "python", f"{page}:{block.line}: marker on a non-python block"
            if block.marker == OUTPUT:
                before = text_blocks[n - 1] if n else None
                assert block.lang == "text", f"{page}:{block.line}"
                assert before is not None, f"{page}:{block.line}"
                assert before.lang == "python", f"{page}:{block.line}"
                assert before.marker != NO_RUN, f"{page}:{block.line}"
        source = (DOCS / page).read_text(encoding="utf-8")
        markers = sum(source.count(marker) for marker in MARKERS)
        attached = sum(1 for b in text_blocks if b.marker in MARKERS)
        assert markers == attached, f"{page}: a marker is not right before a code block"


def slug(heading: str) -> str:
    """The anchor mkdocs (python-markdown ``toc``) gives a heading."""
    text = re.sub(r"[`*]", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: str) -> set[str]:
    """The heading anchors of ``page`` (outside code blocks)."""
    found: set[str] = set()
    in_code = False
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#").strip()))
    return found


def _prose(page: str) -> str:
    """``page`` without its fenced code blocks."""
    kept: list[str] = []
    in_code = False
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            kept.append(line)
    return "\n".join(kept)


def test_relative_links_resolve() -> None:
    """Links between pages name pages and headings that exist."""
    for page in PAGES:
        for target in _LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = path or page
            assert (DOCS / dest).is_file(), f"{page}: broken link {target!r}"
            if anchor and dest.endswith(".md"):
                assert anchor in anchors(dest), f"{page}: no heading for {target!r}"
