"""The benchmark suite runs end to end and writes its report.

``python -m benchmarks --smoke`` (tiny sizes, 2 repetitions) in a subprocess, into a
temporary directory. Nothing here looks at a number: the suite reports timings, tests
never judge them. Without matplotlib (the ``bench`` extra) the PNG is not asked for;
without the peers (aiojobs, APScheduler, uvloop) their cases are reported as not run.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: The benchmark script's output, not the queue's behaviour on this CPython.
pytestmark = pytest.mark.one_python

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: The envq one-off shapes, each a case paired with the floor and a target.
SHAPES = (
    "envq plain, send(*envs)",
    "envq plain, send(env) x N",
    "envq deadline=10",
    "envq before/after hooks + 1 stamp",
)


def test_smoke_run_writes_markdown_and_png(tmp_path: Path) -> None:
    plot = importlib.util.find_spec("matplotlib") is not None
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(tmp_path)]
    if not plot:
        cmd.append("--no-plot")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    md = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    for heading in (
        "## Targets",
        "## 1. One-off throughput",
        "## 2. Idle latency",
        "## 3. Periodic precision",
        "## 4. Memory per queued item",
        "## 5. Scaling",
        "## 6. uvloop",
    ):
        assert heading in md, heading
    assert "Load average" in md
    assert "asyncio.Queue + 4 workers (floor)" in md
    assert "failed:" not in md  # no case raised
    assert proc.stdout.startswith("envq benchmarks: Python 3.")
    assert "load average at start" in proc.stdout

    # The four shapes: a row with × floor in section 1 and a target each.
    targets_md, _, rest = md.partition("## 1. One-off throughput")
    oneoff_md, _, structure_md = rest.partition("### Structure")
    for label in SHAPES:
        assert f"| {label} |" in oneoff_md, label
        assert f"| one-off {label} ≥ " in targets_md, label
        assert f"| {label} |" in structure_md, label
    # The structure counters: their columns, their targets, and in the printout.
    assert "| gen-2 GCs | TimerHandles | Timeouts |" in structure_md
    for what in (
        "generation-2 collections per 100k envelopes",
        "TimerHandles created per envelope",
        "asyncio Timeouts entered per envelope",
    ):
        rows = [x for x in targets_md.splitlines() if x.startswith("| deadline=10: ")]
        assert any(what in row for row in rows), what
        assert what in proc.stdout, what
    assert "structure, per 100,000 envelopes" in proc.stdout
    assert "load average at end" in proc.stdout

    # It opens with a sentence and a chart per question, the targets table after them.
    glance, _, _ = md.partition("## Targets")
    assert "## At a glance" in glance
    assert "no-op one-off envelopes per second" in glance
    assert re.search(r"\*\*Targets:\*\* \d+ of \d+ met", glance)
    if plot:
        for name in ("throughput", "latency", "periodic", "memory", "scaling"):
            png = tmp_path / f"benchmarks-{name}.png"
            assert png.read_bytes()[:8] == PNG_MAGIC, name
            assert f"(benchmarks-{name}.png)" in glance, name
    else:
        assert not list(tmp_path.glob("*.png"))


def test_ab_runs_tree_against_a_revision() -> None:
    """``python -m benchmarks.ab HEAD`` loads HEAD's envq as a second package and
    measures both sides in one process (tiny sizes; no number is judged)."""
    cmd = [sys.executable, "-m", "benchmarks.ab", "HEAD", "--n", "2000", "--reps", "1"]
    cmd += ["--periodic", "200", "--window", "0.5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("HEAD: envq_rev from "), lines[:2]
    assert str(ROOT / "envq") not in lines[1]
    assert any(line.strip().startswith("tree ") and "× floor" in line for line in lines)
    assert any(line.strip().startswith("HEAD ") and "× floor" in line for line in lines)
    assert any(line.strip().startswith("raw call_at") for line in lines)
    shapes = lines[next(i for i, x in enumerate(lines) if x.startswith("one-off shapes")) :]
    for label in SHAPES:
        row = next((x for x in shapes if x.strip().startswith(label)), "")
        assert row.count("× floor") == 2, (label, row)
        assert " tree " in row, row
        assert " HEAD " in row, row
