"""Where envq's time goes: ``cProfile`` of plain throughput and of periodic precision.

Run after the timed sections (profiling inflates every call, so these runs give
proportions, not numbers to compare with the tables). For throughput the profiler is
on around the timed region only; for periodic precision, around the observed window
only (the set-up is not profiled), and the loop's idle wait in ``epoll.poll`` is left
out of the table.
"""

from __future__ import annotations

import cProfile
import pstats
import re
from functools import partial

from benchmarks import periodic
from benchmarks._core import POOLS, Config, Metrics, run_async
from benchmarks.oneoff import envq_run

TOP = 18
#: Left out of the tables: the loop's idle wait, and the profiler's own off switch.
IDLE = ("method 'poll' of 'select.epoll' objects", "method 'disable' of '_lsprof.Profiler'")


def _where(key: tuple[str, int, str]) -> str:
    filename, line, func = key
    if filename == "~":
        return func
    path = re.sub(r".*/site-packages/", "", filename)
    path = re.sub(r".*/lib/python3\.\d+/", "", path)
    path = re.sub(r".*/(envq|benchmarks)/", r"\1/", path)
    return f"{path}:{line}({func})"


def _table(prof: cProfile.Profile, title: str, items: float) -> str:
    """The top entries by own time, with own time per item in µs."""
    stats = pstats.Stats(prof)
    rows = stats.stats  # type: ignore[attr-defined]
    entries = [
        (tt, ct, nc, cc, _where(key))
        for key, (cc, nc, tt, ct, _callers) in rows.items()
        if not any(idle in key[2] for idle in IDLE)
    ]
    total = sum(e[0] for e in entries)
    entries.sort(key=lambda e: -e[0])
    lines = [
        f"{'ncalls':>10} {'tottime s':>9} {'own %':>6} {'µs/item':>8} {'cumtime s':>9}  function"
    ]
    for tt, ct, nc, cc, where in entries[:TOP]:
        calls = f"{nc}" if nc == cc else f"{nc}/{cc}"
        lines.append(
            f"{calls:>10} {tt:9.3f} {100 * tt / total:5.1f}% {1e6 * tt / items:8.3f} "
            f"{ct:9.3f}  {where}"
        )
    head = f"{title}: {total:.2f} s own time in all, {1e6 * total / items:.2f} µs per item"
    return head + "\n\n" + "\n".join(lines)


def profiles(cfg: Config) -> list[str]:
    p1 = cProfile.Profile()
    run_async(partial(envq_run, POOLS.plain(cfg.n), watch=p1))
    p2 = cProfile.Profile()
    window = min(cfg.window, 3.0)
    m: Metrics = run_async(partial(periodic.envq_periodic, cfg.periodic, window, False, prof=p2))
    return [
        _table(p1, f"envq plain throughput, {cfg.n:,} one-off no-ops, 4 workers", cfg.n),
        _table(
            p2,
            f"envq FIXED_RATE periodic, {cfg.periodic:,} aligned envelopes, {window:g} s "
            f"window ({m['runs']:,.0f} runs; idle epoll wait left out)",
            max(1.0, m["runs"]),
        ),
    ]
