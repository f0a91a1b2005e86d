"""envq throughput, send-cost and memory benchmark (a script, not a test).

Run from the project root::

    .venv/bin/python benchmarks/throughput.py            # N=100_000, 5 repetitions
    .venv/bin/python benchmarks/throughput.py --quick    # smoke run (small N)
    .venv/bin/python benchmarks/throughput.py --profile  # + cProfile of case 1b

Everything runs in one process. Timed cases are interleaved (every repetition runs
each case once, in a rotated order), each timed region is preceded by
``gc.collect()`` and measured with ``time.perf_counter``; every measurement gets a
fresh event loop (``asyncio.run``) and freshly built envelopes. The memory section runs
last, under ``tracemalloc``, and is not timed. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time
import tracemalloc
import types
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import envq

WORKERS = 4
DEADLINE = 10.0

#: Targets from the issue.
TARGET_RATIO = 0.6  # plain envq throughput >= 0.6 x the bare-asyncio floor
TARGET_SEND_US = 1.0  # q.send(env), one at a time, <= 1 us per envelope
TARGET_BYTES = 300  # the queue's own memory per queued envelope <= 300 B


# --------------------------------------------------------------------------------------
# Work, hooks and stamps
# --------------------------------------------------------------------------------------


async def noop(env: envq.Envelope) -> None:
    """The one-off no-op work (also the floor's per-item call)."""


async def hook(env: envq.Envelope) -> None:
    """A no-op async before/after hook."""


def passthrough(next_: envq.Invoker) -> envq.Invoker:
    """A queue-level stamp that only forwards (one extra coroutine frame per attempt)."""

    async def invoker(env: envq.Envelope) -> None:
        await next_(env)

    return invoker


def plain_envelopes(n: int) -> list[envq.Envelope]:
    return [envq.Envelope(invoke=noop) for _ in range(n)]


def deadline_envelopes(n: int) -> list[envq.Envelope]:
    return [envq.Envelope(invoke=noop, deadline=DEADLINE) for _ in range(n)]


def hooked_envelopes(n: int) -> list[envq.Envelope]:
    return [envq.Envelope(invoke=noop, before=hook, after=hook) for _ in range(n)]


# --------------------------------------------------------------------------------------
# Section 1: throughput
# --------------------------------------------------------------------------------------

#: Seconds, measured inside the coroutine around the timed region only.
Timed = Callable[[int, "cProfile.Profile | None"], Coroutine[Any, Any, float]]


async def floor_case(n: int, prof: cProfile.Profile | None = None) -> float:
    """(a) asyncio.Queue + 4 worker tasks: all puts up front, then ``await q.join()``."""
    items = plain_envelopes(n)  # the same kind of objects envq carries
    q: asyncio.Queue[envq.Envelope] = asyncio.Queue()
    done = 0

    async def worker() -> None:
        nonlocal done
        while True:
            item = await q.get()
            await noop(item)
            done += 1
            q.task_done()

    tasks = [asyncio.create_task(worker()) for _ in range(WORKERS)]
    await asyncio.sleep(0)  # the workers are parked in q.get()
    gc.collect()
    t0 = time.perf_counter()
    for item in items:
        q.put_nowait(item)
    await q.join()
    elapsed = time.perf_counter() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert done == n, (done, n)
    return elapsed


def envq_case(
    build: Callable[[int], list[envq.Envelope]],
    *,
    batch: bool,
    stamps: Sequence[envq.Stamp] = (),
) -> Timed:
    """(b)-(d): timed region = ``q.start(); q.send(...); await q.stop()`` (DRAIN)."""

    async def case(n: int, prof: cProfile.Profile | None = None) -> float:
        envs = build(n)
        q = envq.Queue("bench", workers=WORKERS, capacity=0, stamps=stamps)
        gc.collect()
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        q.start()
        if batch:
            q.send(*envs)
        else:
            send = q.send
            for env in envs:
                send(env)
        report = await q.stop()
        elapsed = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        assert report.complete, report
        assert len(report.completed) == n, (len(report.completed), n)
        stats = q.statistics()
        assert stats.outcomes[envq.Outcome.OK] == n, stats
        await q.terminate()
        return elapsed

    return case


@dataclass
class Case:
    key: str
    label: str
    run: Timed
    times: list[float] = field(default_factory=list)


def throughput_cases() -> list[Case]:
    return [
        Case("floor", "(a) asyncio.Queue floor", floor_case),
        Case("plain", "(b) envq plain, send(*envs)", envq_case(plain_envelopes, batch=True)),
        Case("plain1", "(b) envq plain, send(env) x N", envq_case(plain_envelopes, batch=False)),
        Case("deadline", "(c) envq deadline=10", envq_case(deadline_envelopes, batch=True)),
        Case(
            "hooks",
            "(d) envq before/after + stamp",
            envq_case(hooked_envelopes, batch=True, stamps=(passthrough,)),
        ),
    ]


# --------------------------------------------------------------------------------------
# Section 2: send cost
# --------------------------------------------------------------------------------------


async def _blocked_queue() -> tuple[envq.Queue, asyncio.Event]:
    """A RUNNING queue with workers=1 whose only worker is busy until the event is set."""
    started = asyncio.Event()
    release = asyncio.Event()

    async def block(env: envq.Envelope) -> None:
        started.set()
        await release.wait()

    q = envq.Queue("bench_send", workers=1)
    q.start()
    q.send(envq.Envelope(invoke=block))
    await started.wait()
    return q, release


def send_case(state: str, *, batch: bool) -> Timed:
    """Seconds to admit N envelopes with ``q.send`` into an INIT or busy RUNNING queue."""

    async def case(n: int, prof: cProfile.Profile | None = None) -> float:
        envs = plain_envelopes(n)
        if state == "init":
            q = envq.Queue("bench_send", workers=1)
        else:
            q, _release = await _blocked_queue()
        gc.collect()
        t0 = time.perf_counter()
        if batch:
            q.send(*envs)
        else:
            send = q.send
            for env in envs:
                send(env)
        elapsed = time.perf_counter() - t0
        assert q.capacity_used == n + (state != "init"), q.capacity_used
        await q.terminate()  # hands everything back; cancels the blocker
        return elapsed

    return case


async def put_nowait_case(n: int, prof: cProfile.Profile | None = None) -> float:
    """Baseline: ``asyncio.Queue.put_nowait`` one at a time (no consumer)."""
    items = plain_envelopes(n)
    q: asyncio.Queue[envq.Envelope] = asyncio.Queue()
    gc.collect()
    t0 = time.perf_counter()
    put = q.put_nowait
    for item in items:
        put(item)
    elapsed = time.perf_counter() - t0
    assert q.qsize() == n
    return elapsed


def send_cases() -> list[Case]:
    return [
        Case("put", "asyncio.Queue.put_nowait(x) x N", put_nowait_case),
        Case("init1", "send(env) x N, INIT (buffered)", send_case("init", batch=False)),
        Case("run1", "send(env) x N, RUNNING (busy)", send_case("running", batch=False)),
        Case("initN", "send(*envs), INIT (buffered)", send_case("init", batch=True)),
        Case("runN", "send(*envs), RUNNING (busy)", send_case("running", batch=True)),
    ]


# --------------------------------------------------------------------------------------
# Running interleaved
# --------------------------------------------------------------------------------------


def run_interleaved(cases: list[Case], n: int, reps: int, *, gc_off: bool = False) -> None:
    """Each repetition runs every case once, starting one case later than the last."""
    for rep in range(reps):
        order = cases[rep % len(cases) :] + cases[: rep % len(cases)]
        for case in order:
            if gc_off:  # the cases' own gc.collect() still runs before the timed region
                gc.disable()
            try:
                case.times.append(asyncio.run(case.run(n, None)))
            finally:
                gc.enable()


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _rng(xs: Sequence[float], fmt: str) -> str:
    return f"{format(min(xs), fmt)}–{format(max(xs), fmt)}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_throughput(cases: list[Case], n: int) -> None:
    floor = cases[0]
    print(f"\n## 1. Throughput: {n:,} one-off no-op envelopes, {WORKERS} workers")
    print("   items/s = N / (first put|start .. join|stop returns); ratio = envq / floor,")
    print("   paired per repetition (median, min–max)\n")
    head = (
        f"{'case':<32} {'median items/s':>15} {'min–max items/s':>23} "
        f"{'median ms':>10} {'ratio':>6} {'ratio min–max':>14}"
    )
    print(head)
    print("-" * len(head))
    for case in cases:
        rates = [n / t for t in case.times]
        ratios = [f / c for c, f in zip(case.times, floor.times, strict=True)]
        ratio = _med(ratios)
        print(
            f"{case.label:<32} {_med(rates):>15,.0f} {_rng(rates, ',.0f'):>23} "
            f"{_med(case.times) * 1e3:>10.1f} {ratio:>6.2f} {_rng(ratios, '.2f'):>14}"
        )
    print()
    for case in cases[1:3]:
        ratios = [f / c for c, f in zip(case.times, floor.times, strict=True)]
        ratio = _med(ratios)
        print(
            f"target: {case.label.strip()} >= {TARGET_RATIO}x floor: "
            f"{ratio:.2f}x  {verdict(ratio >= TARGET_RATIO)}"
        )
    per = {c.key: _med(c.times) / n * 1e6 for c in cases}
    print(
        "per envelope (median µs): "
        + ", ".join(f"{c.key} {per[c.key]:.2f}" for c in cases)
        + f"; envq plain overhead over floor {per['plain'] - per['floor']:+.2f} µs"
    )


def print_send(cases: list[Case], n: int) -> None:
    base = cases[0]
    print(f"\n## 2. Send cost: {n:,} envelopes, µs per envelope (lower is better)\n")
    head = f"{'case':<34} {'median µs':>10} {'min–max µs':>14} {'x put_nowait':>13}"
    print(head)
    print("-" * len(head))
    for case in cases:
        us = [t / n * 1e6 for t in case.times]
        print(
            f"{case.label:<34} {_med(us):>10.3f} {_rng(us, '.3f'):>14} "
            f"{_med(case.times) / _med(base.times):>13.1f}"
        )
    print()
    for key in ("init1", "run1"):
        case = next(c for c in cases if c.key == key)
        us_med = _med(case.times) / n * 1e6
        print(
            f"target: {case.label.strip()} <= {TARGET_SEND_US} µs: "
            f"{us_med:.3f} µs  {verdict(us_med <= TARGET_SEND_US)}"
        )


# --------------------------------------------------------------------------------------
# Section 3: memory
# --------------------------------------------------------------------------------------


def _function_at(filename: str, lineno: int) -> str:
    """The qualified name of the *loaded* function that owns ``filename:lineno`` (robust to
    the file on disk having changed since import, unlike ``linecache``)."""
    best: tuple[int, str] | None = None
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) != filename:
            continue
        stack: list[object] = list(vars(mod).values())
        seen: set[int] = set()
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                stack.extend(vars(obj).values())
            elif isinstance(obj, staticmethod | classmethod):
                stack.append(obj.__func__)
            elif isinstance(obj, property):
                stack.extend((obj.fget, obj.fset))
            elif isinstance(obj, types.FunctionType):
                stack.append(obj.__code__)
            elif isinstance(obj, types.CodeType) and obj.co_filename == filename:
                lines = [line for _, _, line in obj.co_lines() if line is not None]
                if lineno in lines:
                    span = max(lines) - min(lines)
                    if best is None or span < best[0]:
                        best = (span, obj.co_qualname)
                stack.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
    return best[1] if best is not None else "?"


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def _memory(n: int) -> list[tuple[str, float, str]]:
    """Rows of (what, bytes per envelope, note); tracemalloc is on."""
    rows: list[tuple[str, float, str]] = []

    probe = envq.Envelope(invoke=noop)
    rows.append(("Envelope sys.getsizeof", float(sys.getsizeof(probe)), "the object alone"))

    m0 = _traced()
    envs = plain_envelopes(n)
    m1 = _traced()
    per_env = (m1 - m0 - sys.getsizeof(envs)) / n
    rows.append(("Envelope construction (traced)", per_env, "object + what it allocates"))

    # asyncio.Queue.put_nowait of the same objects (no consumer): the floor's storage.
    aq: asyncio.Queue[envq.Envelope] = asyncio.Queue()
    m2 = _traced()
    for env in envs:
        aq.put_nowait(env)
    m3 = _traced()
    rows.append(("asyncio.Queue.put_nowait", (m3 - m2) / n, "deque slots only"))
    del aq
    m2 = _traced()

    # INIT queue: envelopes are BUFFERED (in _live only).
    q = envq.Queue("bench_mem", workers=1)
    m3 = _traced()
    for env in envs:
        q.send(env)
    m4 = _traced()
    init_bytes = (m4 - m3) / n
    rows.append(("envq send, INIT (BUFFERED)", init_bytes, "_live dict entry + _Rec"))
    await q.terminate()
    del q

    # RUNNING queue with its one worker busy: envelopes are READY (_live + _ready deque).
    q2, _release = await _blocked_queue()
    m6 = _traced()
    snap0 = tracemalloc.take_snapshot()
    send = q2.send
    for env in envs:
        send(env)
    m7 = _traced()
    snap1 = tracemalloc.take_snapshot()
    run_bytes = (m7 - m6) / n
    rows.append(("envq send, RUNNING busy (READY)", run_bytes, "_live + _Rec + _ready deque"))
    diffs = snap1.compare_to(snap0, "lineno")
    top = sorted(diffs, key=lambda d: -d.size_diff)[:4]
    for d in top:
        frame = d.traceback[0]
        where = "/".join(frame.filename.rsplit("/", 2)[-2:])
        func = _function_at(frame.filename, frame.lineno)
        block = f" of {d.size_diff / d.count_diff:.0f} B" if d.count_diff > n // 2 else " (resize)"
        rows.append(
            (
                f"  by line {where}:{frame.lineno}",
                d.size_diff / n,
                f"in {func}: {d.count_diff:+,} blocks{block}",
            )
        )
    await q2.terminate()
    del q2, envs
    return rows


def print_memory(n: int) -> None:
    tracemalloc.start(1)
    try:
        rows = asyncio.run(_memory(n))
    finally:
        tracemalloc.stop()
    print(f"\n## 3. Memory: {n:,} envelopes, bytes per envelope (tracemalloc, after gc)\n")
    head = f"{'what':<44} {'bytes/env':>10}  note"
    print(head)
    print("-" * (len(head) + 24))
    for what, per, note in rows:
        print(f"{what:<44} {per:>10.1f}  {note}")
    print()
    for what, per, _ in rows:
        if what.startswith("envq send"):
            print(
                f"target: {what} <= {TARGET_BYTES} B: {per:.1f} B  {verdict(per <= TARGET_BYTES)}"
            )
    print("(dict/deque memory grows in steps, so bytes/env depends a little on N)")


# --------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------


def print_profile(n: int) -> None:
    prof = cProfile.Profile()
    case = envq_case(plain_envelopes, batch=True)
    asyncio.run(case(n, prof))
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(15)
    print(f"\n## Profile of case 1b (timed region only, {n:,} envelopes), top 15 by tottime\n")
    text = out.getvalue()
    start = text.find("   ncalls")
    print(text[start:].rstrip() if start >= 0 else text)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--n", type=int, default=None, help="envelopes per run (default 100000)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per case (default 5)")
    ap.add_argument("--quick", action="store_true", help="smoke run: N=10000 unless --n")
    ap.add_argument("--profile", action="store_true", help="also cProfile case 1b")
    ap.add_argument("--skip-memory", action="store_true", help="skip the tracemalloc section")
    ap.add_argument("--gc-off", action="store_true", help="disable the cyclic GC during timed runs")
    args = ap.parse_args(argv)
    n: int = args.n if args.n is not None else (10_000 if args.quick else 100_000)
    reps: int = args.reps
    if n < 1 or reps < 1:
        ap.error("--n and --reps must be >= 1")

    print("envq throughput benchmark")
    print(f"python   {sys.version.split()[0]} ({platform.python_implementation()})")
    print(f"machine  {platform.platform()} {platform.machine()} ({platform.processor() or '?'})")
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"cpus     {os.cpu_count()}; load average {load} (other work skews timings)")
    gc_state = "cyclic gc DISABLED in timed runs" if args.gc_off else "cyclic gc enabled"
    print(f"envq     {envq.__version__}; N={n:,} reps={reps} workers={WORKERS}; {gc_state}")
    t_all = time.perf_counter()

    cases = throughput_cases()
    run_interleaved(cases, n, reps, gc_off=args.gc_off)
    print_throughput(cases, n)

    sends = send_cases()
    run_interleaved(sends, n, reps, gc_off=args.gc_off)
    print_send(sends, n)

    if not args.skip_memory:
        print_memory(n)
    if args.profile:
        print_profile(n)
    print(f"\ntotal wall time {time.perf_counter() - t_all:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
