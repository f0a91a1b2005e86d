"""Every example runs: the scripts of ``examples/`` and the code of the migration guides.

- Each ``examples/*.py`` script (not the ``_``-prefixed helpers) has a docstring, runs
  in a fresh interpreter on a real event loop with warnings as errors, exits 0 within
  the timeout, and prints the key lines listed in ``EXPECTED`` (a new script without
  an entry fails ``test_every_script_is_covered``). The FastAPI one is skipped when
  the ``examples`` extra is not installed.
- Each runnable ```python block of the migration guides runs and prints what the page
  shows, by the rules of ``tests/tools/test_docs_examples.py`` (whose runner this reuses).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: Real seconds a script may take (each is meant to end in a few).
TIMEOUT = 60.0

#: Script → regular expressions that must each match a line of its output.
EXPECTED: dict[str, list[str]] = {
    "preset_envelopes.py": [
        r"^before start: INIT, 4 buffered$",
        r"Email v1$",
        r"Email dynamic$",
        r"^main: timeout$",
        r"^stopped: 3 parked$",
        r"^terminated: 3 handed back, capacity used 0$",
        r"^queue: done$",
    ],
    "schedule_envelopes.py": [
        r"Email v3$",
        r"^runs: \{'v1': \d+, 'v2': \d+, 'v3': \d+\}$",
        r"^stopped: 3 parked$",
        r"^queue: done$",
    ],
    "dynamic_envelopes.py": [
        r"Email 1$",
        r"^sender: done$",
        r"^sent (\d+), succeeded \1$",
        r"^queue: done$",
    ],
    "combine_envelopes.py": [
        r"Email v2$",
        r"^sender: done$",
        r"^one-offs succeeded: [1-9]\d*$",
        r"^stopped: 3 parked$",
        r"^handed back: \['v1', 'v2', 'v3'\]$",
        r"^queue: done$",
    ],
    "start_stop_restart.py": [
        r"failure hook email_1 first attempt 1: ConnectionError",
        r"hook after email_2 -> StopEnvelope$",
        r"dead letter metrics_3 RuntimeError",
        r"parked after the first stop: \['email_1', 'food', 'metrics'\]$",
        r"hook after email_1 first payload name: Changed Name$",
        r"success hook email_1 first$",
        r"Email email_1 15 to John$",
        r"^final states: .*'SUCCEEDED': 18",
        r"^handed back: \['food', 'metrics'\]$",
        r"^queue: done$",
    ],
    "fastapi_app.py": [
        r"^POST /emails -> 202 \{'id': 1\}$",
        r"^POST /emails -> 202 \{'id': 3\}$",
        r"^GET /stats -> RUNNING succeeded: 3$",
        r"^GET /ops/queue/envelopes -> 200 3 succeeded listed$",
        r"^sent: \['a@example.com', 'b@example.com', 'c@example.com'\]$",
        r"^app: done$",
    ],
}
#: Scripts that need the ``examples`` extra, and the modules it brings.
NEEDS: dict[str, tuple[str, ...]] = {"fastapi_app.py": ("fastapi", "httpx", "jinja2")}
#: The pages whose ```python blocks run here.
GUIDES = ("migrating-from-rate-envelope-queue.md", "migrating-from-dowork.md")


def scripts() -> list[str]:
    """The example scripts (helpers start with ``_``)."""
    return sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def test_every_script_is_covered() -> None:
    """Each script has expected lines here, and each entry names a script."""
    assert set(scripts()) == set(EXPECTED)


@pytest.mark.parametrize("name", scripts())
def test_script_has_a_docstring(name: str) -> None:
    """Each script says what it shows and how to run it."""
    tree = ast.parse((EXAMPLES / name).read_text(encoding="utf-8"))
    doc = ast.get_docstring(tree)
    assert doc, name
    assert "Run" in doc or "run" in doc, name


@pytest.mark.parametrize("name", scripts())
def test_script_runs(name: str) -> None:
    """The script exits 0 within the timeout and prints its key lines."""
    for module in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[examples]')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        done = subprocess.run(
            [sys.executable, "-W", "error", str(EXAMPLES / name)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=ROOT,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name}: did not finish within {exc.timeout} s")
    assert done.returncode == 0, (
        f"{name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    )
    lines = done.stdout.splitlines()
    for pattern in EXPECTED[name]:
        assert any(re.search(pattern, line) for line in lines), (
            f"{name}: no line matches {pattern!r}:\n{done.stdout}"
        )


# The runner of the docs' code blocks.
from tests.tools import test_docs_examples as docs_examples  # noqa: E402

GUIDE_EXAMPLES = [example for page in GUIDES for example in docs_examples.examples(page)]


def test_guides_have_examples() -> None:
    """Each migration guide has runnable examples, each with its output shown."""
    for page in GUIDES:
        found = docs_examples.examples(page)
        assert found, page
        assert all(example.expected is not None for example in found), page


@pytest.mark.parametrize("example", GUIDE_EXAMPLES, ids=[e.name for e in GUIDE_EXAMPLES])
def test_guide_example_runs(example: object, tmp_path: Path) -> None:
    """The block runs and prints what the guide shows."""
    docs_examples.test_example_runs(example, tmp_path)
