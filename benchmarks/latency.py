"""Section 2: idle latency, send → start of the work.

One item at a time into an idle system (4 workers parked): the main task reads
``perf_counter()``, submits, and the work reads it again as its first statement; the
next item is submitted once the work has run and the loop has gone idle again. A
repetition reports the p50 and p99 of its samples, in microseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial

import envq
from benchmarks._core import (
    WORKERS,
    Case,
    Config,
    Metrics,
    collect,
    have,
    percentile,
    run_async,
)

SECTION = "latency"
WARMUP = 20


class _Probe:
    """The shared clock reading and the future the work resolves."""

    __slots__ = ("fut", "lat", "t0")

    def __init__(self) -> None:
        self.t0 = 0.0
        self.lat: list[float] = []
        self.fut: asyncio.Future[None] | None = None

    def hit(self) -> None:
        self.lat.append(time.perf_counter() - self.t0)
        fut = self.fut
        assert fut is not None
        fut.set_result(None)

    def metrics(self) -> Metrics:
        lat = sorted(self.lat[WARMUP:])
        return {
            "p50": percentile(lat, 0.50) * 1e6,
            "p99": percentile(lat, 0.99) * 1e6,
            "max": lat[-1] * 1e6,
        }


async def _sample_loop(
    samples: int, probe: _Probe, submit: Callable[[int], Awaitable[None] | None]
) -> Metrics:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0)
    collect()
    for i in range(samples + WARMUP):
        probe.fut = loop.create_future()
        probe.t0 = time.perf_counter()
        pending = submit(i)
        if pending is not None:
            await pending
        await probe.fut
        await asyncio.sleep(0)  # the worker has parked again
    return probe.metrics()


async def floor_latency(samples: int) -> Metrics:
    probe = _Probe()
    q: asyncio.Queue[int] = asyncio.Queue()

    async def worker() -> None:
        while True:
            await q.get()
            probe.hit()
            q.task_done()

    tasks = [asyncio.create_task(worker()) for _ in range(WORKERS)]
    try:
        return await _sample_loop(samples, probe, q.put_nowait)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def envq_latency(samples: int) -> Metrics:
    probe = _Probe()

    async def work(env: envq.Envelope) -> None:
        probe.hit()

    envs = [envq.Envelope(invoke=work) for _ in range(samples + WARMUP)]
    q = envq.Queue("latency", workers=WORKERS)
    q.start()
    try:
        return await _sample_loop(samples, probe, lambda i: q.send(envs[i]))
    finally:
        await q.terminate()


async def aiojobs_latency(samples: int) -> Metrics:
    import aiojobs  # noqa: PLC0415 - optional peer, on demand

    probe = _Probe()

    async def work() -> None:
        probe.hit()

    sched = aiojobs.Scheduler(limit=WORKERS, pending_limit=0)

    async def submit(i: int) -> None:
        await sched.spawn(work())

    try:
        return await _sample_loop(samples, probe, submit)
    finally:
        await sched.close()


async def create_task_latency(samples: int) -> Metrics:
    """Reference: a bare ``loop.create_task`` per item (no queue, no limit)."""
    probe = _Probe()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def work() -> None:
        probe.hit()

    def submit(i: int) -> None:
        task = loop.create_task(work())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await _sample_loop(samples, probe, submit)


def cases(cfg: Config) -> list[Case]:
    s = cfg.latency_samples
    out = [
        Case(
            SECTION,
            "lat_floor",
            "asyncio.Queue + 4 workers (floor)",
            lambda: run_async(partial(floor_latency, s)),
        ),
        Case(SECTION, "lat_envq", "envq, send(env)", lambda: run_async(partial(envq_latency, s))),
        Case(
            SECTION,
            "lat_task",
            "loop.create_task (reference)",
            lambda: run_async(partial(create_task_latency, s)),
        ),
    ]
    if have("aiojobs"):
        out.append(
            Case(
                SECTION,
                "lat_aiojobs",
                "aiojobs Scheduler(limit=4), await spawn",
                lambda: run_async(partial(aiojobs_latency, s)),
            )
        )
    return out
