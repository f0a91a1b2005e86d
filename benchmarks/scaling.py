"""Section 5: scaling with the number of queued envelopes.

For each size N (1k … 1M in the full run):

* throughput: N one-off no-ops through the floor and through envq (as section 1, the
  whole batch queued up front);
* send cost: ``send(env)`` one at a time into a RUNNING queue whose one worker is busy,
  so all N stay READY (µs per envelope);
* timers: N envelopes sent with delays spread over [100, 200) s, so each one is an
  entry in the queue's timer heap (µs per send), then ``await q.terminate()``, which
  parks them, clears the heap and hands the envelopes back (total ms); against raw
  ``loop.call_at`` + ``handle.cancel()`` for the same delays.

A size whose smaller neighbour predicts more than the budget (60 s) for one repetition
is skipped with a note.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from functools import partial

import envq
from benchmarks._core import (
    POOLS,
    Case,
    Config,
    Metrics,
    busy_queue,
    collect,
    run_async,
    sync_noop,
)
from benchmarks.oneoff import envq_run, floor_run

SECTION = "scaling"


async def send_run(envs: Sequence[envq.Envelope]) -> Metrics:
    n = len(envs)
    q, _release = await busy_queue()
    try:
        collect()
        t0 = time.perf_counter()
        send = q.send
        for env in envs:
            send(env)
        elapsed = time.perf_counter() - t0
        assert q.capacity_used == n + 1, q.capacity_used
    finally:
        await q.terminate()
    return {"us": elapsed / n * 1e6}


async def timers_run(envs: Sequence[envq.Envelope]) -> Metrics:
    n = len(envs)
    q = envq.Queue("bench_timers", workers=4)
    q.start()
    try:
        collect()
        t0 = time.perf_counter()
        send = q.send
        for env in envs:
            send(env)
        sent = time.perf_counter() - t0
        collect()
        t1 = time.perf_counter()
        handed = await q.terminate()
        cancel = time.perf_counter() - t1
        assert len(handed) == n, (len(handed), n)
    finally:
        await q.terminate()
    return {"send_us": sent / n * 1e6, "cancel_ms": cancel * 1e3, "cancel_us": cancel / n * 1e6}


async def raw_timers_run(delays: Sequence[float]) -> Metrics:
    n = len(delays)
    loop = asyncio.get_running_loop()
    collect()
    t0 = time.perf_counter()
    call_at = loop.call_at
    base = loop.time()
    handles = [call_at(base + d, sync_noop, None) for d in delays]
    armed = time.perf_counter() - t0
    collect()
    t1 = time.perf_counter()
    for h in handles:
        h.cancel()
    cancel = time.perf_counter() - t1
    return {"send_us": armed / n * 1e6, "cancel_ms": cancel * 1e3, "cancel_us": cancel / n * 1e6}


def _floor(n: int) -> Metrics:
    seconds = run_async(partial(floor_run, POOLS.plain(n)))
    return {"rate": n / seconds, "seconds": seconds}


def _envq(n: int) -> Metrics:
    seconds = run_async(partial(envq_run, POOLS.plain(n)))
    return {"rate": n / seconds, "seconds": seconds}


def _send(n: int) -> Metrics:
    return run_async(partial(send_run, POOLS.plain(n)))


def _timers(n: int) -> Metrics:
    return run_async(partial(timers_run, POOLS.delayed(n)))


def _raw_timers(n: int) -> Metrics:
    delays = [e.delay for e in POOLS.delayed(n)]
    return run_async(partial(raw_timers_run, delays))


KINDS: tuple[tuple[str, str, Callable[[int], Metrics]], ...] = (
    ("floor", "floor throughput", _floor),
    ("envq", "envq throughput", _envq),
    ("send", "envq send(env) into busy queue", _send),
    ("timers", "envq delayed send + terminate", _timers),
    ("rawtimers", "raw call_at + cancel", _raw_timers),
)


def cases(cfg: Config) -> list[Case]:
    out: list[Case] = []
    prev: int | None = None
    for n in cfg.sizes:
        for kind, label, fn in KINDS:
            predict = None if prev is None else (f"sc_{kind}_{prev}", 1.2 * n / prev)
            out.append(
                Case(
                    SECTION, f"sc_{kind}_{n}", f"{label}, N={n:,}", partial(fn, n), predict=predict
                )
            )
        prev = n
    return out
