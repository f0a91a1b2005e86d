"""Section 3: periodic precision (and its uvloop rows of section 6).

P periodic items at a 1 s interval, either *aligned* (all due at the same instant T)
or *staggered* (item i first due at T + i/P s). After a lead time for the set-up, the
run is observed for ``window`` seconds. Every run of an item records its lateness,
``actual start − scheduled start``, where the actual start is read as the work's first
statement and the scheduled start is the item's slot on its grid
``anchor + k × interval``; only slots inside the window count. CPU seconds per second is
``time.process_time()`` over the window divided by the window's wall time.

* raw ``loop.call_at``: a callback per item that records and re-arms itself at
  ``due + interval`` (the floor: no queue, no task, no coroutine).
* envq: a FIXED_RATE envelope per item, ``not_before`` = its anchor (envq turns the
  wall-clock anchor into loop time itself); lateness from ``loop.time()`` inside
  ``invoke``. The FIXED_DELAY row schedules each next run one interval after the last
  ended, so its lateness against the grid is the drift that accumulates.
* APScheduler 3: an ``interval`` job per item (``start_date`` = its anchor,
  ``misfire_grace_time=None``), lateness from ``time.time()`` against the wall grid.

Lateness is read modulo the interval (a run more than one interval late would alias);
the max column shows that never came close.
"""

from __future__ import annotations

import asyncio
import cProfile
import datetime as dt
import math
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import envq
from benchmarks._core import (
    INTERVAL,
    WORKERS,
    Case,
    Config,
    LoopFactory,
    Metrics,
    collect,
    have,
    percentile,
    run_async,
    sleep_until,
    uvloop_factory,
)
from benchmarks.oneoff import quiet_apscheduler

SECTION = "periodic"
UV_SECTION = "uvloop"
EARLY = 0.01  # a timer firing up to this early still counts as its own slot
TAIL = 0.02  # observe this long past the window's end (the last staggered runs)
#: Seconds per APScheduler add_job, for the lead time (updated by every run).
_APS_ADD_SECONDS = [300e-6]
SLACK = 1e-5  # anchors pass through datetimes (µs): slots this close to the end are out


class _Grid:
    """Lateness of the runs whose slot lies before ``end``; counts expected runs."""

    __slots__ = ("end", "lat")

    def __init__(self) -> None:
        self.end = math.inf
        self.lat: list[float] = []

    def record(self, now: float, anchor: float) -> None:
        k = math.floor((now - anchor + EARLY) / INTERVAL)
        slot = anchor + k * INTERVAL
        if slot < self.end - SLACK:
            self.lat.append(now - slot)

    def metrics(self, anchors: list[float], cpu: float, late_setup: bool) -> Metrics:
        expected = sum(max(0, math.ceil((self.end - SLACK - a) / INTERVAL)) for a in anchors)
        lat = sorted(self.lat)
        return {
            "p50": percentile(lat, 0.50) * 1e3,
            "p99": percentile(lat, 0.99) * 1e3,
            "max": (lat[-1] if lat else math.nan) * 1e3,
            "cpu": cpu,
            "runs": float(len(lat)),
            "missed": float(expected - len(lat)),
            "late_setup": float(late_setup),
        }


def _offsets(p: int, staggered: bool) -> list[float]:
    return [i * INTERVAL / p if staggered else 0.0 for i in range(p)]


async def _observe(
    loop: asyncio.AbstractEventLoop,
    start: float,
    end: float,
    prof: cProfile.Profile | None = None,
) -> float:
    """Sleep through the window; CPU seconds per wall second over it."""
    await sleep_until(loop, start - TAIL)
    if prof is not None:
        prof.enable()
    c0, w0 = time.process_time(), time.perf_counter()
    await sleep_until(loop, end + TAIL)
    c1, w1 = time.process_time(), time.perf_counter()
    if prof is not None:
        prof.disable()
    return (c1 - c0) / (w1 - w0)


# --------------------------------------------------------------------------------------
# raw loop.call_at
# --------------------------------------------------------------------------------------


async def raw_periodic(p: int, window: float, staggered: bool) -> Metrics:
    loop = asyncio.get_running_loop()
    grid = _Grid()
    record = grid.record
    call_at = loop.call_at

    def fire(due: float) -> None:
        record(loop.time(), due)
        nxt = due + INTERVAL
        if nxt < grid.end:
            call_at(nxt, fire, nxt)

    start = loop.time() + 0.25 + p * 4e-6
    grid.end = start + window
    anchors = [start + off for off in _offsets(p, staggered)]
    for a in anchors:
        call_at(a, fire, a)
    collect()
    late = loop.time() > start - TAIL
    cpu = await _observe(loop, start, grid.end)
    return grid.metrics(anchors, cpu, late)


# --------------------------------------------------------------------------------------
# envq
# --------------------------------------------------------------------------------------


async def envq_periodic(
    p: int,
    window: float,
    staggered: bool,
    schedule: envq.Schedule = envq.FIXED_RATE,
    prof: cProfile.Profile | None = None,
    mod: Any = envq,
) -> Metrics:
    """``mod``: the envq package to measure (``benchmarks.ab`` passes another
    revision's; ``schedule`` must then be one of its members)."""
    loop = asyncio.get_running_loop()
    grid = _Grid()
    record = grid.record

    async def tick(env: envq.Envelope) -> None:
        record(loop.time(), env.payload)

    wall0 = time.time() + 0.25 + p * 80e-6  # construction + send, with room to spare
    # loop time = wall time - skew (read back to back; envq converts the same way)
    skew = time.time() - loop.time()
    envs: list[envq.Envelope] = []
    anchors: list[float] = []
    for off in _offsets(p, staggered):
        nb = dt.datetime.fromtimestamp(wall0 + off, dt.UTC)
        anchor = nb.timestamp() - skew
        anchors.append(anchor)
        envs.append(
            mod.Envelope(
                invoke=tick, interval=INTERVAL, schedule=schedule, not_before=nb, payload=anchor
            )
        )
    start = anchors[0]
    grid.end = start + window
    q = mod.Queue("periodic", workers=WORKERS)
    q.start()
    try:
        q.send(*envs)
        collect()
        late = loop.time() > start - TAIL
        cpu = await _observe(loop, start, grid.end, prof)
    finally:
        await q.terminate()
    return grid.metrics(anchors, cpu, late)


# --------------------------------------------------------------------------------------
# APScheduler 3
# --------------------------------------------------------------------------------------


async def apscheduler_periodic(p: int, window: float, staggered: bool) -> Metrics:
    from benchmarks._aps import (  # noqa: PLC0415 - optional peer
        AsyncIOScheduler,
        IntervalTrigger,
    )

    quiet_apscheduler()
    loop = asyncio.get_running_loop()
    grid = _Grid()
    record = grid.record

    async def tick(anchor: float) -> None:
        record(time.time(), anchor)

    sched = AsyncIOScheduler(event_loop=loop, job_defaults={"misfire_grace_time": None})
    sched.start(paused=True)
    try:
        # add_job is slow: leave room for it (learnt from the previous repetition).
        t_add = time.perf_counter()
        wall0 = time.time() + 0.25 + p * _APS_ADD_SECONDS[0]
        anchors: list[float] = []
        for off in _offsets(p, staggered):
            start_date = dt.datetime.fromtimestamp(wall0 + off, dt.UTC)
            anchor = start_date.timestamp()
            anchors.append(anchor)
            trigger = IntervalTrigger(seconds=INTERVAL, start_date=start_date)
            sched.add_job(tick, trigger, args=(anchor,))
        _APS_ADD_SECONDS[0] = max(20e-6, 1.5 * (time.perf_counter() - t_add) / p)
        sched.resume()
        grid.end = anchors[0] + window
        skew = time.time() - loop.time()
        start = wall0 - skew
        collect()
        late = loop.time() > start - TAIL
        cpu = await _observe(loop, start, grid.end - skew)
    finally:
        sched.shutdown(wait=False)
        await asyncio.sleep(0)
    return grid.metrics(anchors, cpu, late)


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


def _run(
    fn: Callable[..., Coroutine[Any, Any, Metrics]],
    *args: object,
    loop: LoopFactory | None = None,
) -> Callable[[], Metrics]:
    """One repetition: ``fn(*args)`` on a fresh loop."""
    return partial(run_async, partial(fn, *args), loop)


def cases(cfg: Config) -> list[Case]:
    p, w = cfg.periodic, cfg.window
    out: list[Case] = []
    for layout, stag in (("aligned", False), ("staggered", True)):
        out += [
            Case(
                SECTION,
                f"raw_{layout}",
                f"raw loop.call_at, {layout}",
                _run(raw_periodic, p, w, stag),
            ),
            Case(
                SECTION,
                f"envq_{layout}",
                f"envq FIXED_RATE, {layout}",
                _run(envq_periodic, p, w, stag),
            ),
        ]
        if have("apscheduler"):
            pa = cfg.periodic_aps
            out.append(
                Case(
                    SECTION,
                    f"aps_{layout}",
                    f"APScheduler 3 interval jobs, {layout}",
                    _run(apscheduler_periodic, pa, w, stag),
                    note=f"{pa:,} jobs" if pa != p else "",
                )
            )
    out.append(
        Case(
            SECTION,
            "envq_delay_aligned",
            "envq FIXED_DELAY, aligned (drift)",
            _run(envq_periodic, p, w, False, envq.FIXED_DELAY),
            note="lateness against the fixed grid = accumulated drift",
        )
    )
    return out


def uvloop_cases(cfg: Config) -> list[Case]:
    uv = uvloop_factory()
    if uv is None:
        return []
    p, w = cfg.periodic, cfg.window
    return [
        Case(
            UV_SECTION,
            "uv_raw_aligned",
            "uvloop: raw loop.call_at, aligned",
            _run(raw_periodic, p, w, False, loop=uv),
        ),
        Case(
            UV_SECTION,
            "uv_envq_aligned",
            "uvloop: envq FIXED_RATE, aligned",
            _run(envq_periodic, p, w, False, loop=uv),
        ),
    ]
