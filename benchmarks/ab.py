"""Paired A/B of envq's hot path: the working tree against a git revision, in one process.

    python -m benchmarks.ab REV                  # e.g. HEAD, main~3, a commit hash
    python -m benchmarks.ab REV --n 100000 --reps 7 --periodic 10000 --window 3

Why one process: on a shared or virtualised machine the same script can run up to 2×
faster or slower from one process to the next (memory placement, the neighbours), so
numbers from two separate runs cannot be compared. Here REV's ``envq`` is extracted
with ``git archive`` into a temporary directory as a second package, ``envq_rev``, and
both are measured in the same process, interleaved, repetition by repetition.

Cases: one-off no-op throughput (send phase and run phase apart, µs per envelope, with
the bare-asyncio floor of ``benchmarks.oneoff``); the four one-off envelope shapes of
the suite (``benchmarks.oneoff.SHAPES``: plain as one batch and one ``send`` per
envelope, ``deadline=10``, before/after hooks + a stamp), each timed from the first
send until the last envelope has run and paired with the floor of the same repetition;
and FIXED_RATE periodic precision with every envelope due at once (p99 lateness and
CPU s/s, with raw ``loop.call_at``). It prints medians; it judges nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import envq
from benchmarks import periodic
from benchmarks._core import ONEOFF_FIELDS, WORKERS, run_async
from benchmarks.oneoff import SHAPES, floor_run

ROOT = Path(__file__).resolve().parent.parent
REV_PACKAGE = "envq_rev"


def load_revision(rev: str, into: Path) -> ModuleType:
    """``envq`` as it is at ``rev``, imported as :data:`REV_PACKAGE` from ``into``."""
    tar = subprocess.run(
        ["git", "archive", rev, "envq"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    (into / "envq").rename(into / REV_PACKAGE)
    for source in (into / REV_PACKAGE).rglob("*.py"):
        text = source.read_text(encoding="utf-8")
        text = re.sub(r"\bfrom envq\b", f"from {REV_PACKAGE}", text)
        text = re.sub(r"^import envq$", f"import {REV_PACKAGE} as envq", text, flags=re.M)
        source.write_text(text, encoding="utf-8")
    sys.path.insert(0, str(into))
    return importlib.import_module(REV_PACKAGE)


async def oneoff(mod: Any, envs: Sequence[Any]) -> tuple[float, float]:
    """µs per envelope: ``send(*envs)`` into a started queue, then ``await stop()``."""
    q = mod.Queue("ab", workers=WORKERS)
    gc.collect()
    q.start()
    t0 = time.perf_counter()
    q.send(*envs)
    t1 = time.perf_counter()
    await q.stop()
    t2 = time.perf_counter()
    await q.terminate()
    n = len(envs)
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def _ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-repetition ratios ``num / den``."""
    return [a / b for a, b in zip(num, den, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
    parser.add_argument("rev", help="the git revision to compare the working tree with")
    parser.add_argument("--n", type=int, default=100_000, help="one-off envelopes per run")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every case")
    parser.add_argument("--periodic", type=int, default=10_000, help="periodic envelopes")
    parser.add_argument("--window", type=float, default=3.0, help="periodic window, s")
    parser.add_argument(
        "--no-shapes", action="store_true", help="skip the one-off shapes (plain only)"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="envq-ab-") as tmp:
        rev_mod = load_revision(args.rev, Path(tmp))
        sides: dict[str, Any] = {"tree": envq, args.rev: rev_mod}
        print(f"tree: {envq.__file__}\n{args.rev}: {rev_mod.__name__} from {rev_mod.__file__}")
        shapes = () if args.no_shapes else SHAPES
        kinds = ["plain", *sorted({shape.kind for shape in shapes} - {"plain"})]
        # Built interleaved, so that neither side's envelopes get the better memory
        # layout by being built first.
        pools: dict[str, dict[str, list[Any]]] = {
            name: {kind: [] for kind in kinds} for name in sides
        }
        for _ in range(args.n):
            for kind in kinds:
                for name, mod in sides.items():
                    pools[name][kind].append(mod.Envelope(**ONEOFF_FIELDS[kind]))
        floor: list[float] = []
        sends: dict[str, list[float]] = {name: [] for name in sides}
        runs: dict[str, list[float]] = {name: [] for name in sides}
        # µs per envelope of every shape and side, repetition by repetition
        shaped: dict[str, dict[str, list[float]]] = {
            shape.key: {name: [] for name in sides} for shape in shapes
        }
        p99: dict[str, list[float]] = {name: [] for name in [*sides, "raw call_at"]}
        cpu: dict[str, list[float]] = {name: [] for name in p99}
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            floor.append(run_async(partial(floor_run, pools["tree"]["plain"])) / args.n * 1e6)
            for name in order:
                send_us, run_us = run_async(partial(oneoff, sides[name], pools[name]["plain"]))
                sends[name].append(send_us)
                runs[name].append(run_us)
            for shape in shapes:
                for name in order:
                    seconds = shape.run(pools[name][shape.kind], mod=sides[name])
                    shaped[shape.key][name].append(seconds / args.n * 1e6)
            if args.periodic:
                raw = run_async(partial(periodic.raw_periodic, args.periodic, args.window, False))
                p99["raw call_at"].append(raw["p99"])
                cpu["raw call_at"].append(raw["cpu"])
                for name in order:
                    mod = sides[name]
                    m = run_async(
                        partial(
                            periodic.envq_periodic,
                            args.periodic,
                            args.window,
                            False,
                            schedule=mod.FIXED_RATE,
                            mod=mod,
                        )
                    )
                    p99[name].append(m["p99"])
                    cpu[name].append(m["cpu"])

    med = statistics.median
    fl = med(floor)
    print(f"one-off, {args.n:,} no-ops, {args.reps} reps (µs per envelope; floor {fl:.3f})")
    for name in sides:
        s, r = med(sends[name]), med(runs[name])
        print(
            f"  {name:<12} send {s:.3f}  run {r:.3f}  total {s + r:.3f}  {fl / (s + r):.2f}× floor"
        )
    if shapes:
        rev = args.rev
        print(
            f"one-off shapes, {args.n:,} no-ops, first send → last run (µs per envelope, "
            f"median; × floor and tree ÷ {rev} paired per repetition: below 1, the tree is "
            "faster)"
        )
        for shape in shapes:
            times = shaped[shape.key]
            cells = [
                f"{name} {med(times[name]):7.3f} ({med(_ratios(floor, times[name])):.2f}× floor)"
                for name in sides
            ]
            change = med(_ratios(times["tree"], times[rev]))
            print(f"  {shape.label:<34} {'  '.join(cells)}  tree ÷ {rev} {change:.2f}")
    if args.periodic:
        print(f"periodic FIXED_RATE, {args.periodic:,} aligned, {args.window:g} s window")
        raw_p99, raw_cpu = med(p99["raw call_at"]), med(cpu["raw call_at"])
        for name, lateness in p99.items():
            a, c = med(lateness), med(cpu[name])
            print(
                f"  {name:<12} p99 {a:8.2f} ms ({a / raw_p99:.2f}× raw)"
                f"  CPU {c:.3f} s/s ({c / raw_cpu:.2f}× raw)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
