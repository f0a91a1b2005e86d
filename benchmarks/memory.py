"""Section 4: memory per queued item (``tracemalloc``, after ``gc.collect()``).

For each system: traced memory before and after queueing M items that are not yet
running, divided by M. *Held per item* excludes the work item the user made (the
envelope, the coroutine object): it is what the queue or scheduler itself keeps. The
item's own size is given separately, so ``held + item`` is the whole cost of one queued
unit of work. Not timed and not repeated: these numbers do not vary between runs
(dicts, deques and heaps grow in steps, so they move a little with M).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import sys
import tracemalloc
import types
from collections import deque
from dataclasses import dataclass

import envq
from benchmarks._core import Config, busy_queue, have, noop, sync_noop
from benchmarks.oneoff import quiet_apscheduler


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


@dataclass
class MemRow:
    key: str
    label: str
    held: float  # bytes per item kept by the queue/scheduler
    item: float  # bytes per work item the user made (0: none)
    count: int
    note: str = ""


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def _top_lines(
    before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, m: int
) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    diffs = [
        d
        for d in after.compare_to(before, "lineno")
        if not d.traceback[0].filename.endswith("tracemalloc.py")
    ]
    for d in sorted(diffs, key=lambda d: -d.size_diff)[:4]:
        frame = d.traceback[0]
        where = "/".join(frame.filename.rsplit("/", 2)[-2:])
        func = _function_at(frame.filename, frame.lineno)
        out.append((f"{where}:{frame.lineno} ({func})", d.size_diff / m))
    return out


async def _measure(cfg: Config) -> tuple[list[MemRow], list[tuple[str, float]]]:
    m = cfg.memory_n
    rows: list[MemRow] = []

    m0 = _traced()
    envs = [envq.Envelope(invoke=noop) for _ in range(m)]
    env_bytes = (_traced() - m0 - sys.getsizeof(envs)) / m
    rows.append(
        MemRow(
            "envelope",
            "envq.Envelope itself (with its _Rec)",
            0.0,
            env_bytes,
            m,
            f"sys.getsizeof = {sys.getsizeof(envs[0])} B",
        )
    )

    dq: deque[envq.Envelope] = deque()
    m0 = _traced()
    for env in envs:
        dq.append(env)
    rows.append(
        MemRow(
            "deque",
            "collections.deque.append",
            (_traced() - m0) / m,
            env_bytes,
            m,
            "item = an envelope",
        )
    )
    del dq

    aq: asyncio.Queue[envq.Envelope] = asyncio.Queue()
    m0 = _traced()
    for env in envs:
        aq.put_nowait(env)
    rows.append(
        MemRow(
            "aqueue",
            "asyncio.Queue.put_nowait",
            (_traced() - m0) / m,
            env_bytes,
            m,
            "item = an envelope",
        )
    )
    del aq

    q = envq.Queue("bench_mem", workers=1)
    m0 = _traced()
    for env in envs:
        q.send(env)
    rows.append(
        MemRow(
            "envq_buffered",
            "envq send, INIT queue (BUFFERED)",
            (_traced() - m0) / m,
            env_bytes,
            m,
            "_live entry",
        )
    )
    await q.terminate()
    del q

    q2, _release = await busy_queue()
    m0 = _traced()
    snap0 = tracemalloc.take_snapshot()
    for env in envs:
        q2.send(env)
    m1 = _traced()
    snap1 = tracemalloc.take_snapshot()
    rows.append(
        MemRow(
            "envq_ready",
            "envq send, RUNNING busy queue (READY)",
            (m1 - m0) / m,
            env_bytes,
            m,
            "_live entry + _ready slot",
        )
    )
    lines = _top_lines(snap0, snap1, m)
    del snap0, snap1
    await q2.terminate()
    del q2

    delayed = [envq.Envelope(invoke=noop, delay=3600.0) for _ in range(m)]
    q3 = envq.Queue("bench_mem", workers=1)
    q3.start()
    m0 = _traced()
    for env in delayed:
        q3.send(env)
    rows.append(
        MemRow(
            "envq_delayed",
            "envq send delay=3600 (DELAYED)",
            (_traced() - m0) / m,
            env_bytes,
            m,
            "_live entry + (due, tick, envelope) tuple + heap slot",
        )
    )
    await q3.terminate()
    del q3, delayed

    loop = asyncio.get_running_loop()
    m0 = _traced()
    handles = [loop.call_later(3600.0, sync_noop, None) for _ in range(m)]
    rows.append(
        MemRow(
            "call_at",
            "raw loop.call_at (TimerHandle)",
            (_traced() - m0 - sys.getsizeof(handles)) / m,
            0.0,
            m,
            "TimerHandle + heap slot",
        )
    )
    for h in handles:
        h.cancel()
    del handles

    if have("aiojobs"):
        rows.append(await _aiojobs(envs))
    if have("apscheduler"):
        rows.append(await _apscheduler(cfg.memory_aps))
    del envs
    return rows, lines


async def _aiojobs(envs: list[envq.Envelope]) -> MemRow:
    import aiojobs  # noqa: PLC0415 - optional peer, on demand

    m = len(envs)
    release = asyncio.Event()

    async def block() -> None:
        await release.wait()

    sched = aiojobs.Scheduler(limit=1, pending_limit=0)
    await sched.spawn(block())
    m0 = _traced()
    coros = [noop(env) for env in envs]
    coro_bytes = (_traced() - m0 - sys.getsizeof(coros)) / m
    m1 = _traced()
    for coro in coros:
        await sched.spawn(coro)
    held = (_traced() - m1) / m
    del coros
    release.set()
    await sched.wait_and_close()
    return MemRow(
        "aiojobs",
        "aiojobs pending jobs (limit reached)",
        held,
        coro_bytes,
        m,
        "item = the coroutine object; Job + future + set + queue slot",
    )


async def _apscheduler(m: int) -> MemRow:
    from benchmarks._aps import AsyncIOScheduler  # noqa: PLC0415 - optional peer

    quiet_apscheduler()
    sched = AsyncIOScheduler(event_loop=asyncio.get_running_loop())
    sched.start(paused=True)
    when = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    m0 = _traced()
    for i in range(m):
        sched.add_job(noop, "date", run_date=when, args=(i,))
    held = (_traced() - m0) / m
    sched.shutdown(wait=False)
    return MemRow(
        "apscheduler",
        "APScheduler 3 date jobs (memory job store)",
        held,
        0.0,
        m,
        "Job + trigger + job store entries; the function is shared",
    )


def measure(cfg: Config) -> tuple[list[MemRow], list[tuple[str, float]]]:
    """Rows, and the four allocation sites that grew most during the READY sends."""
    tracemalloc.start(1)
    try:
        return asyncio.run(_measure(cfg))
    finally:
        tracemalloc.stop()
