"""Bad input gets a clear error at the call site (docs/decisions.md, "Argument validation").

One table covers every public parameter of every public callable with wrong types and
wrong values: each row is an id, a zero-argument callable making the bad call, the
exception type expected, and fragments the message must contain (the parameter's name
and the repr of the value). A wrong *type* must raise a ``TypeError`` that is not a
``ValueError`` (``BadEnvelopeType``, which is both, for an envelope's fields), a wrong
*value* a ``ValueError`` that is not a ``TypeError``; never ``OverflowError``.

The tests after the table check that a rejected call changes nothing: a populated
queue keeps its capacity and its envelopes' states, a waiting producer keeps its
place, a task keeps its settings, a task queue is not shut down.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest

import envq
from envq import BadEnvelope, BadEnvelopeType, BadIntervals
from envq._checks import show
from envq.testing import VirtualTimeLoop, advance, run
from tests.support import PATIENCE, settle

# --------------------------------------------------------------------------------------
# Callables of the wrong kind
# --------------------------------------------------------------------------------------


async def work(env: envq.Envelope) -> None:
    """A good invoke."""


def gen_fn(env: envq.Envelope) -> Iterator[None]:
    """A generator function: calling it never runs the body."""
    yield None


async def agen_fn(env: envq.Envelope) -> AsyncIterator[None]:
    """An async generator function: calling it never runs the body."""
    yield None


def plain_stamp(next_: envq.Invoker) -> envq.Invoker:
    """A good stamp."""
    return next_


async def async_stamp(next_: envq.Invoker) -> envq.Invoker:
    """An async def stamp: calling it returns a coroutine, not an invoker."""
    return next_


async def async_listener(event: envq.Event) -> None:
    """An async def listener: its coroutine would never be awaited."""


def gen_listener(event: envq.Event) -> Iterator[None]:
    """A generator listener: its body would never run."""
    yield None


async def async_clock() -> float:
    """An async def clock: a bucket reads its clock synchronously."""
    return 0.0


async def async_loop_factory() -> asyncio.AbstractEventLoop:
    """An async def loop factory."""
    return asyncio.new_event_loop()


def gen_task() -> Iterator[int]:
    """A generator function as a task: it would never run."""
    yield 1


async def agen_task() -> AsyncIterator[int]:
    """An async generator function as a task: it would never run."""
    yield 1


async def task_fn() -> None:
    """A good task function."""


def divmod_fn(a: int, b: int) -> tuple[int, int]:
    """A good task function with arguments."""
    return divmod(a, b)


async def coro_fn() -> int:
    """A coroutine function for envq.testing.run."""
    return 1


class AsyncWhen:
    """A limiter whose when() is async def: the queue calls it synchronously."""

    async def when(self, env: object) -> float:
        return 0.0

    def forget(self, env: object) -> None:
        """Nothing to forget."""

    def retries(self, env: object) -> int:
        return 0


class NoForget:
    """Has when() and retries() but no forget(): not a limiter."""

    def when(self, env: object) -> float:
        return 0.0

    def retries(self, env: object) -> int:
        return 0


OBJ = object()
NAIVE = dt.datetime(2030, 1, 1)
DATE = dt.date(2030, 1, 1)
HUGE = 10**400
NEG_TD = dt.timedelta(seconds=-5)

# --------------------------------------------------------------------------------------
# Helpers that make one bad call
# --------------------------------------------------------------------------------------


def env(**fields: Any) -> Callable[[], object]:
    """``Envelope(invoke=work, **fields)``."""
    fields.setdefault("invoke", work)
    return lambda: envq.Envelope(**fields)


def evolve(**changes: Any) -> Callable[[], object]:
    """``Envelope(invoke=work).evolve(**changes)``."""
    return lambda: envq.Envelope(invoke=work).evolve(**changes)


def queue(**options: Any) -> Callable[[], object]:
    """``Queue("rows", **options)``."""
    return lambda: envq.Queue("rows", **options)


def on_queue(method: str, *args: Any, **kwargs: Any) -> Callable[[], object]:
    """Call ``method`` of a running queue on the virtual-time loop (then terminate it)."""

    async def main() -> object:
        q = envq.Queue("rows", capacity=2)
        q.start()
        try:
            result = getattr(q, method)(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result
        finally:
            await q.terminate()

    return lambda: run(main())


def task(method: str, *args: Any) -> Callable[[], object]:
    """``Task(task_fn).<method>(*args)``."""
    return lambda: getattr(envq.Task(task_fn), method)(*args)


def background(method: str, *args: Any, **kwargs: Any) -> Callable[[], object]:
    """Call ``method`` of a fresh, unstarted BackgroundQueue (shut down afterwards)."""

    def call() -> object:
        q = envq.BackgroundQueue("rows")
        try:
            return getattr(q, method)(*args, **kwargs)
        finally:
            q.shutdown()

    return call


def task_queue(method: str, *args: Any) -> Callable[[], object]:
    """Call ``method`` of a started TaskQueue on the virtual-time loop."""

    async def main() -> object:
        async with envq.TaskQueue("rows") as q:
            return getattr(q, method)(*args)

    return lambda: run(main())


def in_run(make: Callable[[], Awaitable[object]]) -> Callable[[], object]:
    """Await ``make()`` on the virtual-time loop."""

    async def main() -> object:
        return await make()

    return lambda: run(main())


def run_with(**options: Any) -> Callable[[], object]:
    """``envq.testing.run(coro_fn(), **options)`` (the coroutine is closed when refused)."""
    return lambda: run(coro_fn(), **options)


def loop(**options: Any) -> Callable[[], object]:
    """``VirtualTimeLoop(**options)``, closed if it was made."""

    def call() -> object:
        VirtualTimeLoop(**options).close()
        return None

    return call


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

T = TypeError
V = ValueError
ROWS: list[Any] = []


def row(id_: str, call: Callable[[], object], error: type[BaseException], *parts: object) -> None:
    """Add a row: ``call()`` raises ``error`` whose message contains every part
    (a str as is, anything else as its repr)."""
    fragments = tuple(p if isinstance(p, str) else show(p) for p in parts)
    ROWS.append(pytest.param(call, error, fragments, id=id_))


def seconds_rows(
    prefix: str,
    make: Callable[[object], Callable[[], object]],
    name: str,
    *,
    types: type[BaseException] = T,
    values: type[BaseException] = V,
    zero_ok: bool = True,
    none_ok: bool = False,
    timedelta: bool = False,
) -> None:
    """The usual wrong values of a finite number of seconds."""
    bad_values: list[object] = [-1, -0.5, math.nan, math.inf, -math.inf, HUGE]
    if not zero_ok:
        bad_values.append(0)
    for value in bad_values:
        row(f"{prefix}-{value!r:.12}", make(value), values, name, show(value))
    bad_types: list[object] = ["1", True, [1], Decimal("1")]
    if not none_ok:
        bad_types.append(None)
    if not timedelta:
        bad_types.append(dt.timedelta(seconds=1))
    for value in bad_types:
        row(f"{prefix}-{value!r:.12}", make(value), types, name, repr(value))
    if timedelta:
        row(f"{prefix}-negative-timedelta", make(NEG_TD), values, name, "-5")


# Envelope: a field of the wrong type → BadEnvelopeType; a wrong value → BadEnvelope.
BT, BV = BadEnvelopeType, BadEnvelope
row("Envelope-invoke-missing", envq.Envelope, BT, "invoke", "None")
for v in [None, 3, "work", OBJ]:
    row(f"Envelope-invoke-{v!r:.10}", env(invoke=v), BT, "invoke", show(v))
row("Envelope-invoke-generator", env(invoke=gen_fn), BT, "invoke", "generator", gen_fn)
row("Envelope-invoke-async-generator", env(invoke=agen_fn), BT, "invoke", "generator", agen_fn)
row("Envelope-id-list", env(id=[1]), BT, "id", [1])
row("Envelope-id-dict", env(id={}), BT, "id", {})
for v in [5, None, b"t"]:
    row(f"Envelope-type-{v!r}", env(type=v), BT, "type", show(v))
for field in ("interval", "deadline", "delay"):
    seconds_rows(
        f"Envelope-{field}",
        lambda v, f=field: env(**{f: v}),
        field,
        types=BT,
        values=BV,
        timedelta=True,
    )
for hook in ("before", "after", "on_failure", "on_success"):
    for v in [3, "hook"]:
        row(f"Envelope-{hook}-{v!r}", env(**{hook: v}), BT, hook, show(v))
    row(f"Envelope-{hook}-generator", env(**{hook: gen_fn}), BT, hook, "generator", gen_fn)
    row(f"Envelope-{hook}-async-generator", env(**{hook: agen_fn}), BT, hook, agen_fn)
row("Envelope-stamps-int", env(stamps=5), BT, "stamps", 5)
row("Envelope-stamps-str", env(stamps="ab"), BT, "stamps", "'ab'")
row("Envelope-stamps-single", env(stamps=plain_stamp), BT, "stamps", plain_stamp, "[stamp]")
row("Envelope-stamps-item-int", env(stamps=[plain_stamp, 3]), BT, "stamps[1]", 3)
row("Envelope-stamps-async", env(stamps=[async_stamp]), BT, "stamps[0]", "async", async_stamp)
row("Envelope-stamps-generator", env(stamps=[gen_fn]), BT, "stamps[0]", gen_fn)
row("Envelope-retry-int", env(retry=3), BT, "retry", 3)
row("Envelope-retry-class", env(retry=envq.Retry), BT, "retry", "instance", envq.Retry)
row("Envelope-retry-dict", env(retry={"attempts": 3}), BT, "retry", {"attempts": 3})
row("Envelope-not_before-str", env(not_before="2030"), BT, "not_before", "2030")
row("Envelope-not_before-date", env(not_before=DATE), BT, "not_before", DATE)
row("Envelope-not_before-float", env(not_before=0.0), BT, "not_before", 0.0)
row("Envelope-not_before-naive", env(not_before=NAIVE), BV, "not_before", NAIVE)
row("Envelope-schedule-str", env(schedule="fixed_rate"), BT, "schedule", "fixed_rate")
row("Envelope-schedule-None", env(schedule=None), BT, "schedule", "None")
row("Envelope-deadline>interval", env(interval=1, deadline=2), BadIntervals, "deadline", "interval")
row("evolve-unknown-field", evolve(intervall=3), BT, "evolve", "intervall")
row("evolve-interval-negative", evolve(interval=-1), BV, "interval", -1)
row("evolve-invoke-int", evolve(invoke=3), BT, "invoke", 3)
row("evolve-deadline>interval", evolve(interval=1, deadline=5), BadIntervals, "deadline")

# Queue(...)
for v in [5, None, b"q"]:
    row(f"Queue-name-{v!r}", lambda v=v: envq.Queue(v), T, "name", show(v))
for v in ["", " ", "q\n", "a\tb", " q", "q ", "\x00", "q\u2028"]:
    row(f"Queue-name-{v!r}", lambda v=v: envq.Queue(v), V, "name", show(v))
for v in [0, -1]:
    row(f"Queue-workers-{v}", queue(workers=v), V, "workers", show(v))
for v in [1.5, 2.0, "2", True, None]:
    row(f"Queue-workers-{v!r}", queue(workers=v), T, "workers", show(v))
row("Queue-capacity--1", queue(capacity=-1), V, "capacity", -1)
for v in [1.5, "10", True, None]:
    row(f"Queue-capacity-{v!r}", queue(capacity=v), T, "capacity", show(v))
for v in ["drain", None, envq.StopMode]:
    row(f"Queue-stop_mode-{v!r:.12}", queue(stop_mode=v), T, "stop_mode", show(v))
for v in [None, "no", 0, 1]:
    row(f"Queue-wait-{v!r}", queue(wait=v), T, "wait", show(v))
row("Queue-stamps-int", queue(stamps=5), T, "stamps", 5)
row("Queue-stamps-str", queue(stamps="ab"), T, "stamps", "'ab'")
row("Queue-stamps-single", queue(stamps=plain_stamp), T, "stamps", plain_stamp)
row("Queue-stamps-item-int", queue(stamps=[3]), T, "stamps[0]", 3)
row("Queue-stamps-async", queue(stamps=[async_stamp]), T, "stamps[0]", "async", async_stamp)
row("Queue-stamps-generator", queue(stamps=[gen_fn]), T, "stamps[0]", gen_fn)
row("Queue-rate-class", queue(rate=envq.TokenBucket), T, "rate", "instance", "TokenBucket(")
row("Queue-rate-int", queue(rate=5), T, "rate", 5)
row("Queue-rate-object", queue(rate=OBJ), T, "rate", OBJ)
row("Queue-rate-no-forget", queue(rate=NoForget()), T, "rate", "forget")
row("Queue-rate-async-when", queue(rate=AsyncWhen()), T, "rate", "async", "when")
row("Queue-limiter-class", queue(limiter=envq.ExponentialBackoff), T, "limiter", "instance")
row("Queue-limiter-str", queue(limiter="x"), T, "limiter", "'x'")
row("Queue-dead_letter-int", queue(dead_letter=3), T, "dead_letter", 3)
row("Queue-dead_letter-generator", queue(dead_letter=gen_fn), T, "dead_letter", gen_fn)
row("Queue-hook_timeout-None", queue(hook_timeout=None), T, "hook_timeout", "None")
row("Queue-hook_timeout-class", queue(hook_timeout=envq.HookTimeout), T, "hook_timeout", "instance")
row("Queue-hook_timeout-float", queue(hook_timeout=0.5), T, "hook_timeout", 0.5)
for v in [0, -1]:
    row(f"Queue-threads-{v}", queue(threads=v), V, "threads", show(v))
for v in [2.5, "4", True]:
    row(f"Queue-threads-{v!r}", queue(threads=v), T, "threads", show(v))

# Queue methods.
for v in [math.nan, -1, -0.001, -math.inf, HUGE]:
    row(f"send_wait-timeout-{v!r:.8}", on_queue("send_wait", timeout=v), V, "timeout", show(v))
for v in ["5", True, [1], dt.timedelta(seconds=5)]:
    row(f"send_wait-timeout-{v!r:.8}", on_queue("send_wait", timeout=v), T, "timeout", show(v))
row("send-not-an-envelope", on_queue("send", 3), BT, "not an Envelope", 3)
row("send-str", on_queue("send", "x"), BT, "not an Envelope", "'x'")
row("send_wait-not-an-envelope", on_queue("send_wait", "e"), BT, "not an Envelope", "'e'")
for v in ["stop", 1, envq.QueueState.STOPPED]:
    row(f"stop-mode-{v!r:.12}", on_queue("stop", mode=v), T, "mode", show(v))
for v in ["yes", None, 1]:
    row(f"stop-cancel-{v!r}", on_queue("stop", cancel=v), T, "cancel", show(v))
for v in ["no", 0]:
    row(f"stop-wait-{v!r}", on_queue("stop", wait=v), T, "wait", show(v))
row("stop-cancel-with-drain", on_queue("stop", envq.StopMode.DRAIN, cancel=True), V, "cancel")
for v in [3, None, "cb"]:
    row(f"subscribe-{v!r}", on_queue("subscribe", v), T, "listener", show(v))
row(
    "subscribe-async", on_queue("subscribe", async_listener), T, "listener", "async", async_listener
)
row("subscribe-generator", on_queue("subscribe", gen_listener), T, "listener", gen_listener)

# Retry(...)
for v in [0, -2, -10]:
    row(f"Retry-attempts-{v}", lambda v=v: envq.Retry(attempts=v), V, "attempts", show(v))
for v in [True, 2.0, "3", None]:
    row(f"Retry-attempts-{v!r}", lambda v=v: envq.Retry(attempts=v), T, "attempts", show(v))
seconds_rows("Retry-base", lambda v: lambda: envq.Retry(base=v), "base")
seconds_rows("Retry-cap", lambda v: lambda: envq.Retry(cap=v), "cap")
for v in ["no", None, 0, 1]:
    row(f"Retry-jitter-{v!r}", lambda v=v: envq.Retry(jitter=v), T, "jitter", show(v))
row("Retry-rng-int", lambda: envq.Retry(rng=42), T, "rng", 42)
row("Retry-rng-class", lambda: envq.Retry(rng=random.Random), T, "rng", "instance")

# HookTimeout(...)
for v in [0, -0.5, 1.5, math.nan, math.inf, HUGE]:
    row(
        f"HookTimeout-fraction-{v!r:.8}", lambda v=v: envq.HookTimeout(fraction=v), V, "fraction", v
    )
for v in ["0.5", True, None]:
    row(
        f"HookTimeout-fraction-{v!r}",
        lambda v=v: envq.HookTimeout(fraction=v),
        T,
        "fraction",
        show(v),
    )
seconds_rows(
    "HookTimeout-floor",
    lambda v: lambda: envq.HookTimeout(floor=v),
    "floor",
    none_ok=True,
)

# retry_after(...)
for v in [math.nan, math.inf, -math.inf, HUGE]:
    row(f"retry_after-{v!r:.8}", lambda v=v: envq.retry_after(v), V, "seconds", show(v))
for v in ["1", None, True, [1]]:
    row(f"retry_after-{v!r}", lambda v=v: envq.retry_after(v), T, "seconds", show(v))

# Limiters.
for v in [0, -1, math.nan, math.inf, HUGE]:
    row(f"TokenBucket-rate-{v!r:.8}", lambda v=v: envq.TokenBucket(v), V, "rate", show(v))
for v in ["5", True, None]:
    row(f"TokenBucket-rate-{v!r}", lambda v=v: envq.TokenBucket(v), T, "rate", show(v))
for v in [0, -1, HUGE]:
    row(f"TokenBucket-burst-{v!r:.8}", lambda v=v: envq.TokenBucket(5, v), V, "burst", show(v))
for v in [1.5, True, "10", None]:
    row(f"TokenBucket-burst-{v!r}", lambda v=v: envq.TokenBucket(5, v), T, "burst", show(v))
row("TokenBucket-clock-int", lambda: envq.TokenBucket(5, clock=3), T, "clock", 3)
row("TokenBucket-clock-async", lambda: envq.TokenBucket(5, clock=async_clock), T, "clock", "async")
seconds_rows(
    "ExponentialBackoff-base",
    lambda v: lambda: envq.ExponentialBackoff(base=v),
    "base",
    zero_ok=False,
)
for v in [0, math.inf]:
    row(
        f"ExponentialBackoff-cap-{v!r}",
        lambda v=v: envq.ExponentialBackoff(cap=v),
        V,
        "cap",
        show(v),
    )
row("ExponentialBackoff-cap-None", lambda: envq.ExponentialBackoff(cap=None), T, "cap", "None")
for v in [-1, math.nan, HUGE]:
    row(f"FastSlow-fast-{v!r:.8}", lambda v=v: envq.FastSlow(v, 1, 1), V, "fast", show(v))
row("FastSlow-fast-str", lambda: envq.FastSlow("1", 1, 1), T, "fast", "'1'")
row("FastSlow-slow-inf", lambda: envq.FastSlow(1, math.inf, 1), V, "slow", "inf")
row("FastSlow-slow-None", lambda: envq.FastSlow(1, None, 1), T, "slow", "None")
row("FastSlow-fast_attempts--1", lambda: envq.FastSlow(1, 2, -1), V, "fast_attempts", "-1")
for v in [1.0, True, "2"]:
    row(
        f"FastSlow-fast_attempts-{v!r}",
        lambda v=v: envq.FastSlow(1, 2, v),
        T,
        "fast_attempts",
        show(v),
    )
row("MaxOf-none", envq.MaxOf, V, "MaxOf", "at least one")
row("MaxOf-class", lambda: envq.MaxOf(envq.TokenBucket), T, "limiters[0]", "instance")
row("MaxOf-int", lambda: envq.MaxOf(envq.TokenBucket(1), 3), T, "limiters[1]", 3)
row("MaxOf-object", lambda: envq.MaxOf(OBJ), T, "limiters[0]", OBJ)
row("MaxOf-async-when", lambda: envq.MaxOf(AsyncWhen()), T, "limiters[0]", "async")

# Task(...) and its builder.
for v in [3, None, "fn"]:
    row(f"Task-fn-{v!r}", lambda v=v: envq.Task(v), T, "fn", show(v))
row("Task-fn-generator", lambda: envq.Task(gen_task), T, "fn", "generator", gen_task)
row("Task-fn-async-generator", lambda: envq.Task(agen_task), T, "fn", agen_task)
row("Task.rng-int", lambda: envq.Task(task_fn).rng(42), T, "rng", 42)
row("Task.rng-class", lambda: envq.Task(task_fn).rng(random.Random), T, "rng", "instance")
row("Task-args-extra", lambda: envq.Task(task_fn, 1), T, "task_fn", "arguments")
row("Task-kwargs-unknown", lambda: envq.Task(task_fn, rng=3), T, "task_fn", "rng")
row("submit-args-missing", lambda: envq.submit(divmod_fn, 1), T, "divmod_fn", "'b'")
for v in [0, -2]:
    row(f"Task.retries-{v}", task("retries", v), V, "retries", show(v))
for v in [2.0, True, "3", None]:
    row(f"Task.retries-{v!r}", task("retries", v), T, "retries", show(v))
seconds_rows(
    "Task.max_timeout",
    lambda v: task("max_timeout", v),
    "max_timeout",
    none_ok=True,
    timedelta=True,
)
seconds_rows("Task.backoff", lambda v: task("backoff", v), "backoff", timedelta=True)
seconds_rows("Task.within", lambda v: task("within", v), "within", timedelta=True)
for v in [3, None, "cb"]:
    row(f"Task.after-{v!r}", task("after", v), T, "after", show(v))
row("Task.after-generator", task("after", gen_fn), T, "after", "generator")
row("Task.not_before-naive", task("not_before", NAIVE), V, "not_before", NAIVE)
for v in ["tomorrow", None, DATE, 0]:
    row(f"Task.not_before-{v!r}", task("not_before", v), T, "not_before", show(v))

# TaskQueue(...), BackgroundQueue(...) and the task API's functions.
row("TaskQueue-name-int", lambda: envq.TaskQueue(5), T, "TaskQueue", "name", 5)
row("TaskQueue-name-space", lambda: envq.TaskQueue("a "), V, "TaskQueue", "name", "'a '")
row("TaskQueue-workers-0", lambda: envq.TaskQueue(workers=0), V, "TaskQueue", "workers", 0)
row("TaskQueue-workers-str", lambda: envq.TaskQueue(workers="1"), T, "workers", "'1'")
row("TaskQueue-capacity--1", lambda: envq.TaskQueue(capacity=-1), V, "capacity", -1)
row("TaskQueue-capacity-None", lambda: envq.TaskQueue(capacity=None), T, "capacity", "None")
row("TaskQueue-rate-class", lambda: envq.TaskQueue(rate=envq.TokenBucket), T, "rate", "instance")
row("TaskQueue-limiter-int", lambda: envq.TaskQueue(limiter=3), T, "limiter", 3)
row("TaskQueue-threads-0", lambda: envq.TaskQueue(threads=0), V, "threads", 0)
row("TaskQueue-threads-float", lambda: envq.TaskQueue(threads=1.5), T, "threads", 1.5)
row("TaskQueue.submit-int", task_queue("submit", 3), T, "fn", 3)
row("TaskQueue.submit-generator", task_queue("submit", gen_task), T, "fn", "generator")
row("TaskQueue.enqueue-int", task_queue("enqueue", 3), BT, "task must be a Task", 3)
row("TaskQueue.enqueue-fn", task_queue("enqueue", print), BT, "task", "submit(fn")
row("BackgroundQueue-name-None", lambda: envq.BackgroundQueue(None), T, "name", "None")
row("BackgroundQueue-name-tab", lambda: envq.BackgroundQueue("a\tb"), V, "name", "'a\\tb'")
row("BackgroundQueue-workers-0", lambda: envq.BackgroundQueue(workers=0), V, "workers", 0)
row("BackgroundQueue-workers-bool", lambda: envq.BackgroundQueue(workers=True), T, "workers", True)
row(
    "BackgroundQueue-rate-class",
    lambda: envq.BackgroundQueue(rate=envq.FastSlow),
    T,
    "rate",
    "instance",
)
row("BackgroundQueue-limiter-str", lambda: envq.BackgroundQueue(limiter="x"), T, "limiter", "'x'")
row("BackgroundQueue-threads--1", lambda: envq.BackgroundQueue(threads=-1), V, "threads", -1)
row(
    "BackgroundQueue-loop_factory-int",
    lambda: envq.BackgroundQueue(loop_factory=3),
    T,
    "loop_factory",
    3,
)
row(
    "BackgroundQueue-loop_factory-async",
    lambda: envq.BackgroundQueue(loop_factory=async_loop_factory),
    T,
    "loop_factory",
    "async",
)
row("BackgroundQueue.submit-int", background("submit", 3), T, "fn", 3)
row("BackgroundQueue.enqueue-int", background("enqueue", 3), BT, "task must be a Task", 3)
row("enqueue-fn", lambda: envq.enqueue(print), BT, "task must be a Task", "print")
for v in [-1, math.nan, -math.inf, HUGE]:
    row(f"BackgroundQueue.shutdown-{v!r:.8}", background("shutdown", v), V, "timeout", show(v))
for v in ["1", True]:
    row(f"BackgroundQueue.shutdown-{v!r}", background("shutdown", v), T, "timeout", show(v))
row("submit-int", lambda: envq.submit(3), T, "fn", 3)
row("submit-generator", lambda: envq.submit(gen_task), T, "fn", "generator")
for v in [-1, math.nan, HUGE]:
    row(f"shutdown-timeout-{v!r:.8}", lambda v=v: envq.shutdown(timeout=v), V, "timeout", show(v))
for v in ["1", False]:
    row(f"shutdown-timeout-{v!r}", lambda v=v: envq.shutdown(timeout=v), T, "timeout", show(v))
row("shutdown-queue-int", lambda: envq.shutdown(3), T, "queues[0]", 3)
row("shutdown-queue-None", lambda: envq.shutdown(None), T, "queues[0]", "None")
row(
    "shutdown-queue-Queue",
    lambda: envq.shutdown(envq.Queue("rows")),
    T,
    "queues[0]",
    "Queue",
)

# Observability.
row("logging_stamp-logger-str", lambda: envq.logging_stamp("envq"), T, "logger", "'envq'")
row("logging_stamp-logger-int", lambda: envq.logging_stamp(3), T, "logger", 3)
row("logging_stamp-level--1", lambda: envq.logging_stamp(level=-1), V, "level", -1)
for v in ["INFO", 1.5, True, None]:
    row(f"logging_stamp-level-{v!r}", lambda v=v: envq.logging_stamp(level=v), T, "level", show(v))
row("otel_stamp-tracer-int", lambda: envq.otel_stamp(3), T, "tracer", 3)
row("otel_stamp-tracer-str", lambda: envq.otel_stamp("t"), T, "tracer", "'t'")
for v in [3, None, "q"]:
    row(
        f"prometheus_metrics-queue-{v!r}",
        lambda v=v: envq.prometheus_metrics(v),
        T,
        "queue",
        show(v),
    )
for v in [3, {}]:
    row(
        f"prometheus_metrics-registry-{v!r}",
        lambda v=v: envq.prometheus_metrics(envq.Queue("rows"), v),
        T,
        "registry",
        v,
    )
row(
    "PrometheusMetrics-queue-int",
    lambda: envq.PrometheusMetrics(3, None),
    T,
    "queue",
    3,
)
for v in [-1, 65536, HUGE]:
    row(f"serve_metrics-port-{v!r:.8}", lambda v=v: envq.serve_metrics(v), V, "port", show(v))
for v in [80.0, "80", True, None]:
    row(f"serve_metrics-port-{v!r}", lambda v=v: envq.serve_metrics(v), T, "port", show(v))
for v in [3, None]:
    row(f"serve_metrics-host-{v!r}", lambda v=v: envq.serve_metrics(host=v), T, "host", show(v))
row("serve_metrics-registry-int", lambda: envq.serve_metrics(registry=3), T, "registry", 3)

# envq.testing.
row("run-coro-function", lambda: run(coro_fn), T, "coro", coro_fn)
row("run-coro-int", lambda: run(3), T, "coro", 3)
for v in [math.nan, math.inf, HUGE]:
    row(f"run-wall_start-{v!r:.8}", run_with(wall_start=v), V, "wall_start", show(v))
row("run-wall_start-str", run_with(wall_start="now"), T, "wall_start", "'now'")
for v in [-1, math.inf]:
    row(f"run-thread_grace-{v!r}", run_with(thread_grace=v), V, "thread_grace", show(v))
row("run-thread_grace-None", run_with(thread_grace=None), T, "thread_grace", "None")
for v in [0, -1, math.nan]:
    row(f"run-idle_timeout-{v!r}", run_with(idle_timeout=v), V, "idle_timeout", show(v))
row("run-idle_timeout-str", run_with(idle_timeout="30"), T, "idle_timeout", "'30'")
row("VirtualTimeLoop-wall_start-inf", loop(wall_start=math.inf), V, "wall_start", "inf")
row("VirtualTimeLoop-thread_grace-nan", loop(thread_grace=math.nan), V, "thread_grace", "nan")
row("VirtualTimeLoop-idle_timeout-None", loop(idle_timeout=None), T, "idle_timeout", "None")
for v in [-1, math.nan, math.inf]:
    row(f"advance-{v!r}", in_run(lambda v=v: advance(v)), V, "seconds", show(v))
row("advance-str", in_run(lambda: advance("1")), T, "seconds", "'1'")


@pytest.mark.parametrize(("call", "error", "fragments"), ROWS)
def test_bad_input(
    call: Callable[[], object], error: type[BaseException], fragments: tuple[str, ...]
) -> None:
    """The bad call raises ``error`` (a TypeError for a wrong type, a ValueError for a
    wrong value — never both unless expected, never OverflowError) with a message
    naming the parameter and the value."""
    with pytest.raises(error) as info:
        call()
    exc = info.value
    assert not isinstance(exc, OverflowError), exc
    for other in (TypeError, ValueError):
        if not issubclass(error, other):
            assert not isinstance(exc, other), f"{exc!r} is also a {other.__name__}"
    message = str(exc)
    for part in fragments:
        assert part in message, f"{part!r} not in {message!r}"


def test_table_is_large() -> None:
    """The table covers well over a hundred bad calls, with distinct ids."""
    ids = [p.id for p in ROWS]
    assert len(ids) > 250, len(ids)
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)


# --------------------------------------------------------------------------------------
# Good values near the bad ones are accepted
# --------------------------------------------------------------------------------------


class TestAccepted:
    @pytest.mark.parametrize("name", ["my-queue", "emails.eu", "a b", "émails", "x/y"])
    def test_names_users_write(self, name: str) -> None:
        """Queue names with dashes, dots, spaces inside, slashes or non-ASCII letters
        are accepted by Queue, TaskQueue and BackgroundQueue alike."""
        assert envq.Queue(name).name == name
        assert envq.TaskQueue(name).name == name
        assert envq.BackgroundQueue(name).name == name

    def test_a_name_users_write_labels_the_metrics(self) -> None:
        """Such a name is the value of the ``name`` label in the Prometheus text format
        (label values take any string; no metric name is built from it)."""
        import prometheus_client  # noqa: PLC0415 - the optional extra, installed for tests

        registry = prometheus_client.CollectorRegistry()
        export = envq.prometheus_metrics(envq.Queue('my-queue "eu"'), registry)
        try:
            text = prometheus_client.generate_latest(registry).decode()
        finally:
            export.close()
        assert 'workqueue_depth{name="my-queue \\"eu\\""} 0.0' in text

    def test_stamps_none_means_none(self) -> None:
        """stamps=None is accepted as no stamps, by Envelope and Queue alike."""
        assert envq.Envelope(invoke=work, stamps=None).stamps == ()
        assert envq.Queue("q", stamps=None).stamps == ()

    def test_numbers_other_than_int_and_float(self) -> None:
        """Any real number (a Fraction, an int subclass) is a number; a timedelta is
        accepted where the docs say so."""
        from fractions import Fraction  # noqa: PLC0415 - only here

        e = envq.Envelope(invoke=work, interval=Fraction(1, 2), delay=dt.timedelta(seconds=3))
        assert (e.interval, e.delay) == (0.5, 3.0)
        assert envq.Retry(base=Fraction(1, 4)).base == 0.25
        assert envq.Task(task_fn).within(dt.timedelta(minutes=1))

    def test_class_with_async_call_is_a_plain_stamp(self) -> None:
        """A stamp class whose instances are async invokers is a plain callable: calling
        the class makes the invoker."""

        class Wrap:
            def __init__(self, next_: envq.Invoker) -> None:
                self.next_ = next_

            async def __call__(self, env: envq.Envelope) -> None:
                await self.next_(env)

        assert envq.Envelope(invoke=work, stamps=[Wrap]).stamps == (Wrap,)

    async def test_infinite_timeout_means_none(self) -> None:
        """send_wait(timeout=inf) waits like timeout=None."""
        q = envq.Queue("q", capacity=1)
        q.start()
        gate = asyncio.Event()

        async def hold(env: envq.Envelope) -> None:
            await gate.wait()

        q.send(envq.Envelope(invoke=hold))
        waiting = asyncio.create_task(q.send_wait(envq.Envelope(invoke=work), timeout=math.inf))
        await advance(10 * PATIENCE)
        assert not waiting.done()
        gate.set()
        await waiting
        await q.terminate()

    def test_background_shutdown_infinite_timeout(self) -> None:
        """BackgroundQueue.shutdown(timeout=inf) means no timeout (not OverflowError)."""
        q = envq.BackgroundQueue("inf")
        assert q.submit(task_fn).future.result(timeout=30) is None
        q.shutdown(timeout=math.inf)
        assert q.closed


# --------------------------------------------------------------------------------------
# A rejected call changes nothing
# --------------------------------------------------------------------------------------


def hold_until(gate: asyncio.Event) -> Callable[[envq.Envelope], Awaitable[None]]:
    """An invoke that lasts until ``gate`` is set."""

    async def invoke(env: envq.Envelope) -> None:
        await gate.wait()

    return invoke


class TestRejectedCallsChangeNothing:
    @staticmethod
    async def populated() -> tuple[envq.Queue, list[envq.Envelope], asyncio.Event]:
        """A running queue (capacity 5) with a RUNNING, a READY and a DELAYED envelope."""
        gate = asyncio.Event()
        invoke = hold_until(gate)
        q = envq.Queue("held", workers=1, capacity=5)
        envs = [
            envq.Envelope(invoke=invoke, id="running"),
            envq.Envelope(invoke=invoke, id="ready"),
            envq.Envelope(invoke=invoke, id="delayed", delay=100),
        ]
        q.start()
        q.send(*envs)
        await settle()
        return q, envs, gate

    @staticmethod
    def snapshot(q: envq.Queue, envs: list[envq.Envelope]) -> tuple[object, ...]:
        stats = q.statistics()
        return (
            q.state,
            q.capacity_used,
            [q.state_of(e) for e in envs],
            [q.due(e) for e in envs],
            stats.rejections,
            stats.dedups,
        )

    async def test_populated_queue_untouched(self) -> None:
        """Rejected send_wait, stop and subscribe calls leave the queue, its capacity
        and its envelopes' states as they were; the queue then works normally."""
        q, envs, gate = await self.populated()
        before = self.snapshot(q, envs)
        assert before[2] == [envq.EnvState.RUNNING, envq.EnvState.READY, envq.EnvState.DELAYED]
        newcomer = envq.Envelope(invoke=work, id="new")
        bad_calls: list[Callable[[], Awaitable[object]]] = [
            lambda: q.send_wait(newcomer, timeout=math.nan),
            lambda: q.send_wait(newcomer, timeout=-1),
            lambda: q.send_wait(newcomer, timeout="5"),
            lambda: q.stop(mode="stop"),
            lambda: q.stop(envq.StopMode.STOP, cancel="yes"),
            lambda: q.stop(envq.StopMode.STOP, cancel=True, wait="no"),
            lambda: q.stop(cancel=True),  # DRAIN is the default mode
        ]
        for bad in bad_calls:
            with pytest.raises((TypeError, ValueError)):
                await bad()
            assert self.snapshot(q, envs) == before
            assert q.state_of(newcomer) is None
        with pytest.raises(TypeError):
            q.subscribe(async_listener)
        seen: list[envq.Event] = []
        q.subscribe(seen.append)
        await q.send_wait(newcomer, timeout=5)
        assert q.capacity_used == before[1] + 1
        gate.set()
        report = await q.stop()
        assert set(report.parked) == {envs[2]}  # the delayed one
        assert seen
        assert all(isinstance(ev, envq.Event) for ev in seen)
        await q.terminate()

    async def test_waiting_producer_keeps_its_place(self) -> None:
        """A send_wait refused for its timeout never joins the line: the producer
        already waiting is admitted when room frees, the refused batch is not."""
        q, _envs, gate = await self.populated()
        seen: list[envq.Event] = []
        q.subscribe(seen.append)
        filler = [envq.Envelope(invoke=work, id=f"fill{i}", delay=50) for i in range(2)]
        q.send(*filler)  # 5 of 5 used
        first = envq.Envelope(invoke=work, id="first")
        refused = envq.Envelope(invoke=work, id="refused")
        waiting = asyncio.create_task(q.send_wait(first))
        await settle()
        assert not waiting.done()
        with pytest.raises(ValueError, match="timeout"):
            await q.send_wait(refused, timeout=-math.inf)
        assert not waiting.done()
        gate.set()  # the running and the ready envelope end: room for the waiter
        await asyncio.wait_for(waiting, PATIENCE)
        entered = {ev.envelope for ev in seen if ev.from_state is envq.EnvState.NEW}
        assert first in entered
        assert refused not in entered
        assert q.state_of(refused) is None
        assert q.statistics().rejections["capacity"] == 0
        await q.terminate()

    def test_rejected_builder_call_keeps_the_task(self) -> None:
        """A task whose builder call was refused keeps its earlier settings."""
        t = envq.Task(task_fn).retries(4).within(10).backoff(2)
        retry_before, within_before = t.retry, t._within
        for method, value in [
            ("retries", "3"),
            ("retries", 0),
            ("within", math.nan),
            ("backoff", True),
            ("max_timeout", -1),
            ("after", gen_fn),
            ("not_before", NAIVE),
        ]:
            with pytest.raises((TypeError, ValueError)):
                getattr(t, method)(value)
        assert t.retry == retry_before
        assert t._within == within_before
        assert t._after == []
        assert t._not_before is None

    def test_background_queue_not_shut_down(self) -> None:
        """A shutdown refused for its timeout or its arguments shuts nothing down."""
        q = envq.BackgroundQueue("kept")
        try:
            assert q.submit(task_fn).future.result(timeout=30) is None
            for bad in (
                lambda: q.shutdown(timeout=-1),
                lambda: q.shutdown(timeout="1"),
                lambda: envq.shutdown(q, timeout=math.nan),
                lambda: envq.shutdown(q, 3),
            ):
                with pytest.raises((TypeError, ValueError)):
                    bad()
                assert not q.shutting_down
            assert q.submit(task_fn).future.result(timeout=30) is None
        finally:
            q.shutdown()
        assert q.closed

    def test_bad_envelope_in_batch_admits_nothing(self) -> None:
        """send() with one bad item in a batch admits none of it (send's own check)."""

        async def main() -> None:
            q, envs, gate = await self.populated()
            before = self.snapshot(q, envs)
            fresh = envq.Envelope(invoke=work)
            with pytest.raises(envq.BadEnvelope):
                q.send(fresh, "not an envelope")
            assert q.state_of(fresh) is None
            assert self.snapshot(q, envs)[:4] == before[:4]
            gate.set()
            await q.terminate()

        run(main())


def test_logging_stamp_accepts_adapter() -> None:
    """logging_stamp takes a Logger or a LoggerAdapter."""
    adapter = logging.LoggerAdapter(logging.getLogger("envq.test"), {})
    assert callable(envq.logging_stamp(adapter))
