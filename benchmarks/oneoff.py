"""Section 1: one-off no-op throughput, and the uvloop variants of section 6.

Every case runs N no-op work items with (at most) 4 running at once, and is timed from
the first submission until the last item has run. ``items/s = N / seconds``.

envq runs four envelope shapes (:data:`SHAPES`): no deadline and no hooks, sent one at
a time or as one batch; ``deadline=10``; before + after hooks and a queue stamp. Besides
time, the *structure* cases count, over a run of ``n_structure`` envelopes of a shape,
the garbage collections per generation, the ``asyncio.TimerHandle``s created and the
``asyncio.Timeout``s entered (:func:`gc_counts`, :func:`timer_counts`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

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
    watch: contextlib.AbstractContextManager[object] | None = None,
    mod: Any = envq,
) -> float:
    """``q.start(); q.send(...); await q.stop()`` (DRAIN runs everything, then returns).
    ``watch`` (a profiler, a counter) is entered around the timed region only. ``mod``:
    the envq package to measure (``benchmarks.ab`` passes another revision's)."""
    n = len(envs)
    q = mod.Queue("bench", workers=WORKERS, stamps=stamps)
    try:
        collect()
        with contextlib.nullcontext() if watch is None else watch:
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
        assert report.complete, report
        assert len(report.completed) == n, (len(report.completed), n)
    finally:
        await q.terminate()
    return elapsed


@dataclass(frozen=True)
class Shape:
    """One envq one-off case: a kind of envelope and the way it is sent."""

    key: str  # the case's key (``report.TARGET_SHAPES`` names its target by it)
    label: str
    kind: str  # of ``_core.ONEOFF_FIELDS``
    batch: bool = True  # ``send(*envs)``, else ``send(env)`` once per envelope
    stamps: tuple[envq.Stamp, ...] = ()  # the queue's stamps
    note: str = ""

    def run(self, envs: Sequence[envq.Envelope], **kw: Any) -> float:
        """One timed run of ``envs`` (of this shape's kind) on a fresh loop."""
        return run_async(partial(envq_run, envs, batch=self.batch, stamps=self.stamps, **kw))


#: The envq one-off shapes, each paired with the floor.
SHAPES = (
    Shape("envq", "envq plain, send(*envs)", "plain", note="no deadline, no hooks; one batch"),
    Shape(
        "envq1",
        "envq plain, send(env) x N",
        "plain",
        batch=False,
        note="no deadline, no hooks; one send per envelope",
    ),
    Shape(
        "envq_deadline",
        f"envq deadline={DEADLINE:g}",
        "deadline",
        note=f"`deadline={DEADLINE:g}`, async no-op invoke; one batch",
    ),
    Shape(
        "envq_hooks",
        "envq before/after hooks + 1 stamp",
        "hooked",
        stamps=(passthrough,),
        note="async no-op before and after (each under the default 0.8 s hook budget), "
        "a no-op queue stamp, deadline 0; one batch",
    ),
)


# --------------------------------------------------------------------------------------
# Structure: collections, timers and timeouts of a run
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def gc_counts(out: Metrics) -> Iterator[None]:
    """The garbage collections of each generation inside the block, into
    ``out["gen0"]`` … ``out["gen2"]`` (``gc.get_stats()`` before and after: nothing
    runs inside the block)."""
    before = [g["collections"] for g in gc.get_stats()]
    try:
        yield
    finally:
        after = [g["collections"] for g in gc.get_stats()]
        for gen, (a, b) in enumerate(zip(before, after, strict=True)):
            out[f"gen{gen}"] = float(b - a)


@contextlib.contextmanager
def timer_counts(out: Metrics) -> Iterator[None]:
    """The ``asyncio.TimerHandle``s created (``out["timers"]``) and the
    ``asyncio.Timeout``s entered (``out["timeouts"]``) inside the block.

    For the block only, ``TimerHandle.__init__`` and ``Timeout.__aenter__`` are
    wrapped by counting ones (class attributes; restored on the way out). Every
    ``loop.call_at``/``call_later`` of asyncio's own loops builds its handle through
    that class, as does a handle made by hand; uvloop's are its own and not counted.
    The wrappers allocate (a coroutine per entered timeout): do not time the block,
    nor count collections in it."""
    handles = entered = 0
    handle_init = vars(asyncio.TimerHandle)["__init__"]
    timeout_enter = vars(asyncio.Timeout)["__aenter__"]

    def counted_init(self: asyncio.TimerHandle, *args: Any, **kwargs: Any) -> None:
        nonlocal handles
        handles += 1
        handle_init(self, *args, **kwargs)

    async def counted_enter(self: asyncio.Timeout) -> asyncio.Timeout:
        nonlocal entered
        entered += 1
        result: asyncio.Timeout = await timeout_enter(self)
        return result

    asyncio.TimerHandle.__init__ = counted_init  # type: ignore[method-assign]
    asyncio.Timeout.__aenter__ = counted_enter  # type: ignore[method-assign]
    try:
        yield
    finally:
        asyncio.TimerHandle.__init__ = handle_init  # type: ignore[method-assign]
        asyncio.Timeout.__aenter__ = timeout_enter  # type: ignore[method-assign]
        out["timers"], out["timeouts"] = float(handles), float(entered)


def structure(shape: Shape, n: int) -> Metrics:
    """Two runs of ``n`` envelopes of ``shape``, each as its timed case: the first
    counts collections (and is timed), the second TimerHandles and Timeouts; the
    counts are per run (``n`` is in the metrics)."""
    envs = POOLS.oneoff(shape.kind, n)
    out: Metrics = {"n": float(n)}
    out["seconds"] = shape.run(envs, watch=gc_counts(out))
    shape.run(envs, watch=timer_counts(out))
    return out


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


def _timed(shape: Shape, n: int) -> float:
    return shape.run(POOLS.oneoff(shape.kind, n))


def cases(cfg: Config) -> list[Case]:
    n = cfg.n
    out = [
        Case(
            SECTION,
            "floor",
            "asyncio.Queue + 4 workers (floor)",
            _case_fn(n, lambda: run_async(partial(floor_run, POOLS.plain(n)))),
        ),
        *(
            Case(
                SECTION,
                shape.key,
                shape.label,
                _case_fn(n, partial(_timed, shape, n)),
                note=shape.note,
            )
            for shape in SHAPES
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


STRUCTURE = "structure"


def structure_cases(cfg: Config) -> list[Case]:
    """Per shape: collections, TimerHandles and Timeouts over ``cfg.n_structure``
    envelopes (a section of its own, run after the timed one-off cases of each
    repetition)."""
    n = cfg.n_structure
    return [
        Case(
            STRUCTURE,
            f"struct_{shape.key}",
            f"structure: {shape.label}",
            partial(structure, shape, n),
            note=shape.note,
        )
        for shape in SHAPES
    ]


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
