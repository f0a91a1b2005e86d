"""Section 1: one-off no-op throughput, and the uvloop variants of section 6.

Every case runs N no-op work items with (at most) 4 running at once, and is timed from
the first submission until the last item has run. ``items/s = N / seconds``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import cProfile
import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

import envq
from benchmarks._core import (
    DEADLINE,
    POOLS,
    WORKERS,
    Case,
    Config,
    LoopFactory,
    Metrics,
    collect,
    have,
    noop,
    passthrough,
    run_async,
    sync_noop,
    uvloop_factory,
)

SECTION = "oneoff"
UV_SECTION = "uvloop"


def _rate(n: int, seconds: float) -> Metrics:
    return {"rate": n / seconds, "seconds": seconds}


# --------------------------------------------------------------------------------------
# The floor: asyncio.Queue + 4 worker tasks
# --------------------------------------------------------------------------------------


async def floor_run(items: Sequence[envq.Envelope]) -> float:
    """All ``put_nowait`` up front, then ``await q.join()``; workers already parked."""
    n = len(items)
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
    await asyncio.sleep(0)
    collect()
    t0 = time.perf_counter()
    put = q.put_nowait
    for item in items:
        put(item)
    await q.join()
    elapsed = time.perf_counter() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert done == n, (done, n)
    return elapsed


# --------------------------------------------------------------------------------------
# envq
# --------------------------------------------------------------------------------------


async def envq_run(
    envs: Sequence[envq.Envelope],
    *,
    batch: bool = True,
    stamps: Sequence[envq.Stamp] = (),
    prof: cProfile.Profile | None = None,
) -> float:
    """``q.start(); q.send(...); await q.stop()`` (DRAIN runs everything, then returns).
    With ``prof``, the profiler is on around the timed region only."""
    n = len(envs)
    q = envq.Queue("bench", workers=WORKERS, stamps=stamps)
    try:
        collect()
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
    finally:
        await q.terminate()
    return elapsed


# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------


async def aiojobs_run(items: Sequence[envq.Envelope]) -> float:
    """``aiojobs.Scheduler(limit=4, pending_limit=0)``: ``await spawn(job)`` per item;
    done when the last job has run."""
    import aiojobs  # noqa: PLC0415 - optional peer, on demand

    n = len(items)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    done = 0

    async def job(item: envq.Envelope) -> None:
        nonlocal done
        await noop(item)
        done += 1
        if done == n:
            finished.set_result(None)

    sched = aiojobs.Scheduler(limit=WORKERS, pending_limit=0, close_timeout=None)
    try:
        collect()
        t0 = time.perf_counter()
        spawn = sched.spawn
        for item in items:
            await spawn(job(item))
        await finished
        elapsed = time.perf_counter() - t0
    finally:
        await sched.close()
    return elapsed


def quiet_apscheduler() -> None:
    """APScheduler logs every job run (INFO) and every run cut short at shutdown."""
    logging.getLogger("apscheduler").setLevel(logging.CRITICAL)


async def apscheduler_run(n: int) -> float:
    """APScheduler 3 ``AsyncIOScheduler``: one ``date``-trigger job per item, all due
    now, ``misfire_grace_time=None``; done when the last job has run. (APScheduler's
    asyncio executor has no concurrency limit: every due job becomes a task.)"""
    from benchmarks._aps import AsyncIOScheduler  # noqa: PLC0415 - optional peer

    quiet_apscheduler()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    done = 0

    async def job(i: int) -> None:
        nonlocal done
        done += 1
        if done == n:
            finished.set_result(None)

    sched = AsyncIOScheduler(event_loop=loop, job_defaults={"misfire_grace_time": None})
    sched.start()
    try:
        collect()
        t0 = time.perf_counter()
        now = dt.datetime.now(dt.UTC)
        add = sched.add_job
        for i in range(n):
            add(job, "date", run_date=now, args=(i,))
        await finished
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.01)  # let the executor's wrappers finish
    finally:
        sched.shutdown(wait=False)
    return elapsed


async def taskgroup_run(items: Sequence[envq.Envelope]) -> float:
    """``asyncio.TaskGroup`` with one task per item, each under ``Semaphore(4)``."""
    sem = asyncio.Semaphore(WORKERS)

    async def job(item: envq.Envelope) -> None:
        async with sem:
            await noop(item)

    collect()
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for item in items:
            tg.create_task(job(item))
    return time.perf_counter() - t0


def threadpool_run(items: Sequence[envq.Envelope]) -> float:
    """``ThreadPoolExecutor(4)`` with a plain (sync) no-op: ``submit`` per item, then
    ``concurrent.futures.wait``; no event loop. Threads are started beforehand."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS)
    try:
        concurrent.futures.wait([pool.submit(time.sleep, 0.01) for _ in range(WORKERS)])
        collect()
        t0 = time.perf_counter()
        submit = pool.submit
        futures = [submit(sync_noop, item) for item in items]
        concurrent.futures.wait(futures)
        return time.perf_counter() - t0
    finally:
        pool.shutdown()


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


def _case_fn(n: int, run: Callable[[], float]) -> Callable[[], Metrics]:
    return lambda: _rate(n, run())


def cases(cfg: Config) -> list[Case]:
    n = cfg.n
    out = [
        Case(
            SECTION,
            "floor",
            "asyncio.Queue + 4 workers (floor)",
            _case_fn(n, lambda: run_async(partial(floor_run, POOLS.plain(n)))),
        ),
        Case(
            SECTION,
            "envq",
            "envq plain, send(*envs)",
            _case_fn(n, lambda: run_async(partial(envq_run, POOLS.plain(n)))),
        ),
        Case(
            SECTION,
            "envq1",
            "envq plain, send(env) x N",
            _case_fn(n, lambda: run_async(partial(envq_run, POOLS.plain(n), batch=False))),
        ),
        Case(
            SECTION,
            "envq_deadline",
            f"envq deadline={DEADLINE:g}",
            _case_fn(n, lambda: run_async(partial(envq_run, POOLS.deadline(n)))),
        ),
        Case(
            SECTION,
            "envq_hooks",
            "envq before/after hooks + 1 stamp",
            _case_fn(
                n, lambda: run_async(partial(envq_run, POOLS.hooked(n), stamps=(passthrough,)))
            ),
        ),
        Case(
            SECTION,
            "taskgroup",
            "TaskGroup + Semaphore(4)",
            _case_fn(n, lambda: run_async(partial(taskgroup_run, POOLS.plain(n)))),
        ),
        Case(
            SECTION,
            "threads",
            "ThreadPoolExecutor(4), sync no-op",
            _case_fn(n, lambda: threadpool_run(POOLS.plain(n))),
            note="no event loop: submit + concurrent.futures.wait",
        ),
    ]
    if have("aiojobs"):
        out.append(
            Case(
                SECTION,
                "aiojobs",
                "aiojobs Scheduler(limit=4)",
                _case_fn(n, lambda: run_async(partial(aiojobs_run, POOLS.plain(n)))),
                note="pending_limit=0 (unbounded pending queue)",
            )
        )
    if have("apscheduler"):
        n_aps = min(n, cfg.n_aps)
        out.append(
            Case(
                SECTION,
                "apscheduler",
                "APScheduler 3 AsyncIOScheduler, date jobs",
                _case_fn(n_aps, lambda: run_async(partial(apscheduler_run, n_aps))),
                note=(
                    f"N = {n_aps:,}"
                    + (f", not {n:,}: add_job is O(jobs)" if n_aps < n else "")
                    + "; no concurrency limit (a task per due job)"
                ),
            )
        )
    return out


def uvloop_cases(cfg: Config) -> list[Case]:
    """Section 6 (throughput half): the floor and plain envq on uvloop."""
    factory = uvloop_factory()
    if factory is None:
        return []
    n = cfg.n
    uv: LoopFactory = factory
    return [
        Case(
            UV_SECTION,
            "uv_floor",
            "uvloop: asyncio.Queue + 4 workers (floor)",
            _case_fn(n, lambda: run_async(partial(floor_run, POOLS.plain(n)), uv)),
        ),
        Case(
            UV_SECTION,
            "uv_envq",
            "uvloop: envq plain, send(*envs)",
            _case_fn(n, lambda: run_async(partial(envq_run, POOLS.plain(n)), uv)),
        ),
    ]
