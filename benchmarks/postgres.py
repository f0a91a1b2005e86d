"""Job queues on PostgreSQL side by side: envq.postgres, the floor, pgqueuer and
procrastinate.

One throwaway PostgreSQL server with the default durability (``fsync`` and
``synchronous_commit`` on), a fresh database per system and worker-process count, and
the same no-op job everywhere. The floor is a minimal durable queue written for the
benchmark (one table, ``FOR UPDATE SKIP LOCKED``, batched claims and ends, nothing
else): every row's figures are also given divided by the floor's. For each system and
1, 2 and 4 worker processes (each process one event loop, started with
``multiprocessing``'s *spawn*):

* **enqueue**: N jobs sent in one batch call before any worker runs (jobs/s);
* **throughput**: the worker processes are started, imported and connected, then
  released together; the time from the release until the system's own tables say all
  N jobs are done (jobs/s);
* **send → start latency**: with the workers idle and running, jobs are sent one at a
  time at a steady rate; each job's body records ``time.time()`` on entry, and the
  latency is that minus ``time.time()`` read just before the send call (p50/p95/p99);
* **where the time goes**: the CPU time of the worker processes and of the whole
  server during the drain, per job (from ``/proc``).

Then a **backlog** row per system: one worker process draining ``--backlog`` jobs
(100,000) enqueued before it starts (procrastinate capped at 10,000: it drains a few
hundred jobs a second).

Run it from the project root::

    python -m benchmarks.postgres                 # N=5000, 1/2/4 processes, backlog (~6 min)
    python -m benchmarks.postgres --n 1000 --procs 1,2 --systems pgqueuer
    python -m benchmarks.postgres --json /tmp/pg.json --docs docs/benchmarks.md

It is a program, not a test: it reports numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

if __package__ in (None, ""):  # ``python benchmarks/postgres.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._core import cpu_model

#: The systems, in the order they run and are reported. ``floor`` is the minimal
#: durable queue written for this benchmark (see *the floor* below), the yardstick
#: every other system's figures are divided by.
SYSTEMS = ("envq", "floor", "pgqueuer", "procrastinate")
#: The system the ratios are taken to.
FLOOR = "floor"
#: Jobs one worker process may run at once (envq ``workers``, procrastinate
#: ``concurrency``) or fetch in one go (pgqueuer ``batch_size``).
CONCURRENCY = 10
DEFAULT_N = 5000
DEFAULT_PROCS = (1, 2, 4)
DEFAULT_LATENCY_JOBS = 200
DEFAULT_RATE = 100.0
#: How often the parent asks the database how many jobs are done (with a backlog of
#: more than :data:`FINE_POLL_UP_TO` jobs, every :data:`COARSE_POLL` seconds: counting
#: 100,000 rows every 10 ms would load the server the workers share).
POLL = 0.01
FINE_POLL_UP_TO = 10_000
COARSE_POLL = 0.2
#: The backlog row's size, and the systems too slow to drain it in reasonable time
#: (capped, and the row says so).
DEFAULT_BACKLOG = 100_000
BACKLOG_CAPS = {"procrastinate": 10_000}
#: Longest wait for any one phase before the run is given up as failed.
PHASE_TIMEOUT = 120.0
#: The one line of settings every report states.
SETTINGS = (
    f"envq: PgQueue(workers={CONCURRENCY}); floor: {CONCURRENCY} in flight, claims "
    f"of up to {CONCURRENCY} once half are free, ends batched; "
    f"pgqueuer: PgQueuer.run(batch_size={CONCURRENCY}), other defaults (no cap on jobs "
    f"in flight); procrastinate: run_worker_async(concurrency={CONCURRENCY}, "
    "listen_notify=True), other defaults"
)


# -- the job body (runs in the worker processes) ------------------------------------

#: Where a worker process sends (job index, time.time() at the start of its body);
#: set by the process's entry routine, None in the parent.
_STAMPS: Any = None


def _stamp(index: int, now: float) -> None:
    if index >= 0 and _STAMPS is not None:
        _STAMPS.put((index, now))


async def noop(env: Any) -> None:
    """envq's job: nothing, except recording its start time when it carries an index."""
    now = time.time()
    payload = env.payload
    if isinstance(payload, int):
        _stamp(payload, now)


# -- the figures -------------------------------------------------------------------


@dataclass
class Row:
    """The figures of one system with one number of worker processes."""

    system: str
    procs: int
    n: int
    #: The backlog row (one worker process, a large N, no latency phase).
    backlog: bool = False
    enqueue_s: float = 0.0
    run_s: float = 0.0
    done: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    #: CPU seconds during the drain: the worker processes', the server's (every
    #: PostgreSQL process, the parent's polling included); None where /proc is missing.
    worker_cpu_s: float | None = None
    server_cpu_s: float | None = None
    note: str = ""
    error: str = ""

    @property
    def jobs_per_s(self) -> float:
        """Throughput: jobs done per second from the workers' release."""
        return self.n / self.run_s if self.run_s > 0 else 0.0

    @property
    def enqueue_per_s(self) -> float:
        """Jobs per second of the one batch enqueue call."""
        return self.n / self.enqueue_s if self.enqueue_s > 0 else 0.0

    def percentile(self, p: int) -> float:
        """The ``p``-th percentile of the send → start latencies (ms)."""
        if len(self.latencies_ms) < 2:
            return self.latencies_ms[0] if self.latencies_ms else 0.0
        return statistics.quantiles(self.latencies_ms, n=100, method="inclusive")[p - 1]

    def per_job_us(self, seconds: float | None) -> float | None:
        """``seconds`` of the drain per job, in µs."""
        return None if seconds is None or not self.n else round(seconds / self.n * 1e6, 1)

    def summary(self) -> dict[str, Any]:
        """The derived figures (what the table and the JSON file show)."""
        return {
            "system": self.system,
            "procs": self.procs,
            "n": self.n,
            "backlog": self.backlog,
            "jobs_per_s": round(self.jobs_per_s, 1),
            "enqueue_per_s": round(self.enqueue_per_s, 1),
            "latency_ms": {f"p{p}": round(self.percentile(p), 2) for p in (50, 95, 99)},
            "latency_jobs": len(self.latencies_ms),
            "worker_cpu_us_per_job": self.per_job_us(self.worker_cpu_s),
            "server_cpu_us_per_job": self.per_job_us(self.server_cpu_s),
            "note": self.note,
            "error": self.error,
        }


class Producer(Protocol):
    """The parent's side of one system: install, send, count what is done."""

    async def install(self) -> None: ...
    async def send_batch(self, n: int) -> None: ...
    async def send_one(self, index: int) -> None: ...
    async def done(self) -> int: ...
    async def finish(self) -> None: ...


Serve = Callable[[str, int, Any, Any, Any], Coroutine[Any, Any, None]]


# -- envq.postgres -----------------------------------------------------------------


def _envq_available() -> str | None:
    try:
        importlib.import_module("envq.postgres").PgQueue  # noqa: B018 - the probe
    except (ImportError, AttributeError):
        return "not available on this checkout"
    return None


def _pg_queue_class() -> Any:
    # By name: the class is not on every checkout (see _envq_available).
    return importlib.import_module("envq.postgres").PgQueue


class _EnvqProducer:
    def __init__(self, queue: Any) -> None:
        import envq  # noqa: PLC0415

        self.q = queue
        self.envelope = envq.Envelope

    async def install(self) -> None:
        await self.q.install()

    async def send_batch(self, n: int) -> None:
        await self.q.send(*(self.envelope(invoke=noop, payload=-1) for _ in range(n)))

    async def send_one(self, index: int) -> None:
        await self.q.send(self.envelope(invoke=noop, payload=index))

    async def done(self) -> int:
        counts = await self.q.counts()
        return int(counts.get("succeeded", 0))

    async def finish(self) -> None:
        # One stop for the shared queue (it stops it in every process, draining).
        await self.q.stop()


@contextlib.asynccontextmanager
async def _envq_producer(dsn: str) -> AsyncIterator[Producer]:
    shared = _pg_queue_class()(dsn, "bench", workers=0, node="producer")
    producer = _EnvqProducer(shared)
    await producer.install()
    async with shared:
        yield producer


async def _envq_serve(dsn: str, index: int, ready: Any, go: Any, stop: Any) -> None:
    shared = _pg_queue_class()(dsn, "bench", workers=CONCURRENCY, node=f"w{index}")
    async with shared:
        ready.put((index, ""))
        await asyncio.to_thread(go.wait)
        await shared.start()
        # The producer stops the shared queue; this process then just closes.
        await asyncio.to_thread(stop.wait)


# -- the floor: a minimal durable queue (asyncpg) --------------------------------
#
# What any durable queue on PostgreSQL has to do, and nothing else: one table; an
# enqueue is one INSERT of the client's payloads (and one NOTIFY); a worker process
# claims READY rows with ``FOR UPDATE SKIP LOCKED`` in batches (ten in flight, a claim
# when half are free, as envq's pump) and ends them in batches (one UPDATE for all
# the jobs that ended meanwhile). No trigger, no lease or fencing token, no journal or
# events, no lifecycle, no retry. Claims commit without waiting for the WAL flush, as
# envq's do (a claim a crash forgets is claimed again); ends and enqueues wait.

_FLOOR_SCHEMA = """
CREATE TABLE floor_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state smallint NOT NULL DEFAULT 0,  -- 0 ready, 1 running, 2 done
    payload text NOT NULL
);
CREATE INDEX floor_jobs_ready ON floor_jobs (id) WHERE state = 0;
"""
_FLOOR_SEND = """
WITH sent AS (INSERT INTO floor_jobs (payload) SELECT unnest($1::text[]))
SELECT pg_notify('floor', '')
"""
_FLOOR_CLAIM = """
UPDATE floor_jobs AS j SET state = 1
  FROM (SELECT id FROM floor_jobs WHERE state = 0 ORDER BY id LIMIT $1
           FOR UPDATE SKIP LOCKED) AS c
 WHERE j.id = c.id
RETURNING j.id, j.payload
"""
_FLOOR_END = "UPDATE floor_jobs SET state = 2 WHERE id = ANY($1::bigint[])"


class _FloorProducer:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def install(self) -> None:
        if await self.conn.fetchval("SELECT to_regclass('floor_jobs')") is None:
            await self.conn.execute(_FLOOR_SCHEMA)

    async def send_batch(self, n: int) -> None:
        await self.conn.execute(_FLOOR_SEND, ["-1"] * n)

    async def send_one(self, index: int) -> None:
        await self.conn.execute(_FLOOR_SEND, [str(index)])

    async def done(self) -> int:
        return int(await self.conn.fetchval("SELECT count(*) FROM floor_jobs WHERE state = 2"))

    async def finish(self) -> None:
        pass


@contextlib.asynccontextmanager
async def _floor_producer(dsn: str) -> AsyncIterator[Producer]:
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        yield _FloorProducer(conn)
    finally:
        await conn.close()


class _FloorWorker:
    """One process's worker of the floor: a claimer, the jobs, an ender."""

    def __init__(self, claimer: Any, ender: Any, wake: asyncio.Event) -> None:
        self.claimer = claimer
        self.ender = ender
        self.wake = wake
        self.busy = 0
        self.room = asyncio.Event()
        self.ended: list[int] = []
        self.ending = asyncio.Event()
        self.jobs: set[asyncio.Task[None]] = set()

    async def claim(self) -> None:
        while True:
            free = CONCURRENCY - self.busy
            if free <= 0 or (self.busy and free < CONCURRENCY // 2):
                self.room.clear()
                await self.room.wait()
                continue
            self.wake.clear()
            rows = await self.claimer.fetch(_FLOOR_CLAIM, free)
            for row in rows:
                self.busy += 1
                job = asyncio.create_task(self.run(row["id"], row["payload"]))
                self.jobs.add(job)
                job.add_done_callback(self.jobs.discard)
            if not rows:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.wake.wait()

    async def run(self, job: int, payload: str) -> None:
        now = time.time()
        _stamp(int(payload), now)
        self.ended.append(job)
        self.ending.set()

    async def end(self) -> None:
        while True:
            await self.ending.wait()
            self.ending.clear()
            batch, self.ended = self.ended, []
            await self.ender.execute(_FLOOR_END, batch)
            self.busy -= len(batch)
            self.room.set()


async def _floor_serve(dsn: str, index: int, ready: Any, go: Any, stop: Any) -> None:
    import asyncpg  # noqa: PLC0415

    claimer = await asyncpg.connect(dsn, server_settings={"synchronous_commit": "off"})
    ender = await asyncpg.connect(dsn)
    listener = await asyncpg.connect(dsn)
    wake = asyncio.Event()
    await listener.add_listener("floor", lambda *_: wake.set())
    worker = _FloorWorker(claimer, ender, wake)
    ready.put((index, ""))
    await asyncio.to_thread(go.wait)
    tasks = [asyncio.create_task(worker.claim()), asyncio.create_task(worker.end())]
    await asyncio.to_thread(stop.wait)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, *worker.jobs, return_exceptions=True)
    for conn in (claimer, ender, listener):
        await conn.close()


# -- pgqueuer (asyncpg) ------------------------------------------------------------


class _PgqProducer:
    def __init__(self, conn: Any) -> None:
        from pgqueuer import Queries  # noqa: PLC0415

        self.conn = conn
        self.queries = Queries.from_asyncpg_connection(conn)
        self.sent = 0

    async def install(self) -> None:
        # What `pgqueuer install` does (its default durability: every table logged).
        if not await self.queries.schema_is_installed():
            await self.queries.install()

    async def send_batch(self, n: int) -> None:
        await self.queries.enqueue(["noop"] * n, [b"-1"] * n, [0] * n)
        self.sent += n

    async def send_one(self, index: int) -> None:
        await self.queries.enqueue("noop", str(index).encode())
        self.sent += 1

    async def done(self) -> int:
        # A job that ends is deleted from the queue table (and logged) in one statement.
        left = await self.conn.fetchval("SELECT count(*) FROM pgqueuer")
        return self.sent - int(left)

    async def finish(self) -> None:
        pass


@contextlib.asynccontextmanager
async def _pgq_producer(dsn: str) -> AsyncIterator[Producer]:
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        yield _PgqProducer(conn)
    finally:
        await conn.close()


async def _pgq_serve(dsn: str, index: int, ready: Any, go: Any, stop: Any) -> None:
    import asyncpg  # noqa: PLC0415
    from pgqueuer import PgQueuer  # noqa: PLC0415
    from pgqueuer.models import Job  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    pgq = PgQueuer.from_asyncpg_connection(conn)

    @pgq.entrypoint("noop")
    async def _noop(job: Job) -> None:
        now = time.time()
        _stamp(int(job.payload or b"-1"), now)

    ready.put((index, ""))
    await asyncio.to_thread(go.wait)
    task = asyncio.create_task(pgq.run(batch_size=CONCURRENCY))
    await asyncio.to_thread(stop.wait)
    pgq.shutdown.set()
    await task
    await conn.close()


# -- procrastinate (psycopg 3) -----------------------------------------------------


def _procrastinate_app(dsn: str) -> Any:
    import procrastinate  # noqa: PLC0415

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")
    async def _noop(i: int = -1) -> None:
        now = time.time()
        _stamp(i, now)

    return app


class _ProcrastinateProducer:
    def __init__(self, app: Any) -> None:
        self.app = app
        self.task = app.tasks["noop"]

    async def install(self) -> None:
        await self.app.schema_manager.apply_schema_async()

    async def send_batch(self, n: int) -> None:
        await self.task.batch_defer_async(*({"i": -1} for _ in range(n)))

    async def send_one(self, index: int) -> None:
        await self.task.defer_async(i=index)

    async def done(self) -> int:
        async with self.app.connector.pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            )
            row = await cur.fetchone()
        return int(row[0])

    async def finish(self) -> None:
        pass


@contextlib.asynccontextmanager
async def _procrastinate_producer(dsn: str) -> AsyncIterator[Producer]:
    app = _procrastinate_app(dsn)
    async with app.open_async():
        yield _ProcrastinateProducer(app)


async def _procrastinate_serve(dsn: str, index: int, ready: Any, go: Any, stop: Any) -> None:
    app = _procrastinate_app(dsn)
    async with app.open_async():
        ready.put((index, ""))
        await asyncio.to_thread(go.wait)
        task = asyncio.create_task(
            app.run_worker_async(
                concurrency=CONCURRENCY,
                wait=True,
                listen_notify=True,
                install_signal_handlers=False,
                name=f"w{index}",
            )
        )
        await asyncio.to_thread(stop.wait)
        task.cancel()  # procrastinate's graceful stop: in-flight jobs finish
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _available(system: str) -> str | None:
    if system == "envq":
        return _envq_available()
    try:
        importlib.import_module("asyncpg" if system == FLOOR else system)
    except ImportError as error:
        return f"not installed ({error}; pip install -e '.[bench]')"
    return None


PRODUCERS: dict[str, Callable[[str], contextlib.AbstractAsyncContextManager[Producer]]] = {
    "envq": _envq_producer,
    FLOOR: _floor_producer,
    "pgqueuer": _pgq_producer,
    "procrastinate": _procrastinate_producer,
}
SERVERS: dict[str, Serve] = {
    "envq": _envq_serve,
    FLOOR: _floor_serve,
    "pgqueuer": _pgq_serve,
    "procrastinate": _procrastinate_serve,
}


def _child(system: str, dsn: str, index: int, ready: Any, go: Any, stop: Any, stamps: Any) -> None:
    """A worker process: one event loop running ``system``'s worker until ``stop``."""
    global _STAMPS  # noqa: PLW0603 - the job bodies of this process read it
    _STAMPS = stamps
    try:
        asyncio.run(SERVERS[system](dsn, index, ready, go, stop))
    except BaseException as error:
        ready.put((index, f"{type(error).__name__}: {error}"))
        raise


# -- the measurement ---------------------------------------------------------------


async def create_database(admin_dsn: str, name: str) -> None:
    """``CREATE DATABASE name`` (dropping one of that name first)."""
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def _until(
    what: str, check: Callable[[], Awaitable[bool]], within: float, poll: float = POLL
) -> None:
    limit = time.perf_counter() + within
    while not await check():
        if time.perf_counter() > limit:
            raise TimeoutError(f"{what}: not done after {within:.0f} s")
        await asyncio.sleep(poll)


def _cpu_s(pid: int, *, children: bool = False) -> float | None:
    """CPU seconds (user and system, every thread) of process ``pid`` from ``/proc``;
    with ``children``, those of its ended children as well. None without ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # from field 3 on: the name may hold spaces
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def _worker_cpu(workers: Sequence[Any]) -> float | None:
    found = [_cpu_s(w.pid) for w in workers if w.pid is not None]
    return None if not found or None in found else sum(x for x in found if x is not None)


def _server_cpu(server: Any) -> float | None:
    """CPU seconds of the whole server: the postmaster with its ended children (the
    backends that exited), and every child still running."""
    try:
        data = Path(server.socket_dir) / "data" / "postmaster.pid"
        postmaster = int(data.read_text().split()[0])
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except (OSError, ValueError, AttributeError, IndexError):
        return None
    total = _cpu_s(postmaster, children=True)
    if total is None:
        return None
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
            parent = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == postmaster:
            total += _cpu_s(pid) or 0.0
    return total


def _spent(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else max(0.0, after - before)


async def _get(what: str, source: Any, within: float) -> Any:
    try:
        return await asyncio.to_thread(source.get, True, within)
    except queue.Empty:
        raise TimeoutError(f"{what}: nothing after {within:.0f} s") from None


async def measure(
    server: Any,
    system: str,
    procs: int,
    *,
    n: int = DEFAULT_N,
    latency_jobs: int = DEFAULT_LATENCY_JOBS,
    rate: float = DEFAULT_RATE,
    database: str | None = None,
    within: float = PHASE_TIMEOUT,
    backlog: bool = False,
    note: str = "",
) -> Row:
    """Measure ``system`` with ``procs`` worker processes on ``server`` (an
    ``envq.postgres._server.ThrowawayServer``) in a fresh database; a phase that takes
    longer than ``within`` seconds, and any other error, ends up in :attr:`Row.error`,
    never raised. ``backlog``: the row of a large backlog (``latency_jobs`` 0 skips
    the latency phase)."""
    row = Row(system=system, procs=procs, n=n, backlog=backlog, note=note)
    why = _available(system)
    if why is not None:
        row.error = why
        return row
    name = database or f"bench_{system}_{procs}" + ("_backlog" if backlog else "")
    poll = POLL if n <= FINE_POLL_UP_TO else COARSE_POLL
    ctx = multiprocessing.get_context("spawn")
    ready, stamps = ctx.Queue(), ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    workers: list[Any] = []
    try:
        await create_database(server.dsn(), name)
        dsn = server.dsn(name)
        async with PRODUCERS[system](dsn) as producer:
            await producer.install()
            started = time.perf_counter()
            await producer.send_batch(n)
            row.enqueue_s = time.perf_counter() - started

            for index in range(procs):
                args = (system, dsn, index, ready, go, stop, stamps)
                worker = ctx.Process(target=_child, args=args, daemon=True)
                worker.start()
                workers.append(worker)
            for _ in range(procs):
                index, problem = await _get("worker processes ready", ready, within)
                if problem:
                    raise RuntimeError(f"worker process {index}: {problem}")

            cpu = _worker_cpu(workers), _server_cpu(server)
            go.set()
            started = time.perf_counter()

            def check_workers() -> None:
                # A worker process that died would otherwise show as a timeout.
                for index, worker in enumerate(workers):
                    if not worker.is_alive():
                        told = ""
                        with contextlib.suppress(queue.Empty):
                            told = ready.get(timeout=1.0)[1]
                        raise RuntimeError(
                            f"worker process {index} exited ({worker.exitcode}) {told}".strip()
                        )

            async def all_done() -> bool:
                check_workers()
                return await producer.done() >= n

            await _until("throughput", all_done, within, poll)
            row.run_s = time.perf_counter() - started
            row.worker_cpu_s = _spent(cpu[0], _worker_cpu(workers))
            row.server_cpu_s = _spent(cpu[1], _server_cpu(server))

            sent: dict[int, float] = {}
            t0 = time.perf_counter()
            for index in range(latency_jobs):
                delay = t0 + index / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent[index] = time.time()
                await producer.send_one(index)
            for _ in range(latency_jobs):
                index, began = await _get("latency job start", stamps, within)
                row.latencies_ms.append((began - sent[index]) * 1000.0)

            async def rest_done() -> bool:
                check_workers()
                return await producer.done() >= n + latency_jobs

            await _until("latency jobs", rest_done, within, poll)
            row.done = await producer.done()
            await producer.finish()
    except Exception as error:  # report and go on with the other systems
        row.error = f"{type(error).__name__}: {error}"
    finally:
        stop.set()
        for worker in workers:
            await asyncio.to_thread(worker.join, 30)
            if worker.is_alive():
                worker.terminate()
                await asyncio.to_thread(worker.join, 5)
        for channel in (ready, stamps):
            channel.close()
            channel.join_thread()
    return row


async def run_all(
    systems: Sequence[str],
    procs: Sequence[int],
    *,
    n: int,
    latency_jobs: int,
    rate: float,
    log: Callable[[str], None],
    backlog: int = 0,
) -> dict[str, Any]:
    """Start one server (default durability), measure every system with every number
    of worker processes, then (``backlog`` > 0) every system with one worker process
    and ``backlog`` jobs enqueued first (capped for the systems of
    :data:`BACKLOG_CAPS`), stop the server; returns the raw figures."""
    from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

    rows: list[Row] = []
    load_at_start = _load()
    server = ThrowawayServer(fast=False)
    server.start()
    try:
        pg_version, durability = await _server_facts(server.dsn())
        log(f"PostgreSQL {pg_version}, {durability}; {SETTINGS}")
        present = []
        for system in systems:
            why = _available(system)
            if why is not None:
                log(f"{'envq.postgres' if system == 'envq' else system}: {why}")
                rows.append(Row(system=system, procs=0, n=n, error=why))
            else:
                present.append(system)
        # The systems take turns at each number of processes: on a shared machine the
        # load drifts over a run, and neighbours in time see about the same load.
        for count in procs:
            for system in present:
                row = await measure(
                    server, system, count, n=n, latency_jobs=latency_jobs, rate=rate
                )
                rows.append(row)
                log(_line(row))
        if backlog:
            for system in present:
                size = min(backlog, BACKLOG_CAPS.get(system, backlog))
                note = f"capped at {size:,} (too slow for {backlog:,})" if size < backlog else ""
                row = await measure(
                    server,
                    system,
                    1,
                    n=size,
                    latency_jobs=0,
                    rate=rate,
                    within=max(PHASE_TIMEOUT, size / 100),
                    backlog=True,
                    note=note,
                )
                rows.append(row)
                log(_line(row))
    finally:
        server.stop()
    rows.sort(key=lambda row: systems.index(row.system))
    return {
        "n": n,
        "backlog": backlog,
        "latency_jobs": latency_jobs,
        "rate": rate,
        "settings": SETTINGS,
        "postgresql": pg_version,
        "durability": durability,
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPUs",
        "load_average_start": load_at_start,
        "load_average": _load(),
        "versions": _versions(),
        "rows": with_ratios([{**row.summary(), "raw": asdict(row)} for row in rows]),
    }


def with_ratios(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``summaries`` with each row's figures divided by the floor's of the same kind
    (the same number of worker processes; the backlog row by the floor's backlog row):
    ``jobs_vs_floor``, ``enqueue_vs_floor`` (None without a floor's figure)."""
    floors = {
        (r["procs"], r.get("backlog", False)): r
        for r in summaries
        if r["system"] == FLOOR and not r["error"]
    }
    for r in summaries:
        floor = floors.get((r["procs"], r.get("backlog", False)))
        for key, figure in (("jobs_vs_floor", "jobs_per_s"), ("enqueue_vs_floor", "enqueue_per_s")):
            ok = floor is not None and not r["error"] and floor[figure] > 0
            r[key] = round(r[figure] / floor[figure], 3) if ok and floor is not None else None
    return summaries


async def _server_facts(dsn: str) -> tuple[str, str]:
    """The server's version, and its durability settings as read from it."""
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        version = str(await conn.fetchval("SHOW server_version"))
        settings = [
            f"{name}={await conn.fetchval(f'SHOW {name}')}"
            for name in ("fsync", "synchronous_commit", "full_page_writes")
        ]
    finally:
        await conn.close()
    return version, ", ".join(settings)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    found = {"python": platform.python_version()}
    for dist in ("envq", "pgqueuer", "procrastinate", "asyncpg", "psycopg"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- output ------------------------------------------------------------------------

HEAD = (
    "system",
    "worker processes",
    "N",
    "jobs/s",
    "÷ floor",
    "enqueue jobs/s",
    "÷ floor",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "note",
)
#: The second table: where the drain's time goes.
COST_HEAD = (
    "system",
    "worker processes",
    "N",
    "wall µs/job",
    "worker CPU µs/job",
    "server CPU µs/job",
)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _n(summary: dict[str, Any]) -> str:
    return f"{summary['n']:,}" + (" (backlog)" if summary.get("backlog") else "")


def _cells(summary: dict[str, Any]) -> list[str]:
    if summary["error"]:
        procs = str(summary["procs"]) if summary["procs"] else "–"
        dashes = ["–"] * (len(HEAD) - 4)
        return [summary["system"], procs, _n(summary), *dashes, summary["error"]]
    lat = summary["latency_ms"]
    latency = (
        [f"{lat['p50']:.1f}", f"{lat['p95']:.1f}", f"{lat['p99']:.1f}"]
        if summary["latency_jobs"]
        else ["–", "–", "–"]
    )
    return [
        summary["system"],
        str(summary["procs"]),
        _n(summary),
        f"{summary['jobs_per_s']:,.0f}",
        _ratio(summary.get("jobs_vs_floor")),
        f"{summary['enqueue_per_s']:,.0f}",
        _ratio(summary.get("enqueue_vs_floor")),
        *latency,
        summary.get("note", ""),
    ]


def _cost_cells(summary: dict[str, Any]) -> list[str]:
    def us(value: float | None) -> str:
        return "–" if value is None else f"{value:,.0f}"

    wall = 1e6 / summary["jobs_per_s"] if summary["jobs_per_s"] else None
    return [
        summary["system"],
        str(summary["procs"]),
        _n(summary),
        us(wall),
        us(summary.get("worker_cpu_us_per_job")),
        us(summary.get("server_cpu_us_per_job")),
    ]


def _line(row: Row) -> str:
    return "  ".join(_cells(row.summary())).rstrip()


def _plain(head: Sequence[str], rows: list[list[str]]) -> str:
    body = [list(head), *rows]
    widths = [max(len(cells[i]) for cells in body) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    )


def table(result: dict[str, Any]) -> str:
    """The figures as plain text tables: the main one, then where the drain's time
    goes (CPU per job)."""
    rows = result["rows"]
    costs = [_cost_cells(r) for r in rows if not r["error"]]
    return _plain(HEAD, [_cells(r) for r in rows]) + "\n\n" + _plain(COST_HEAD, costs)


#: The heading of the section in ``docs/benchmarks.md``.
HEADING = "## PostgreSQL"
#: The sections of the suite's report this one goes before (the first found).
_BEFORE = ("## Profile", "## Method", "## Notes")


def section(result: dict[str, Any], command: str = "python -m benchmarks.postgres") -> str:
    """The ``## PostgreSQL`` section of ``docs/benchmarks.md`` for ``result``."""
    v = result["versions"]
    backlog = result.get("backlog", 0)
    lines = [
        HEADING,
        "",
        f"Generated by `{command}` (N = {result['n']:,}"
        + (f"; a backlog row of {backlog:,}" if backlog else "")
        + f"; {result['latency_jobs']} latency "
        f"jobs at {result['rate']:g}/s; wall time {result.get('wall_s', 0):.0f} s; load "
        + (
            f"average {result['load_average_start']} at the start, "
            if "load_average_start" in result
            else "average "
        )
        + f"{result['load_average']} at the end). Job queues that keep their jobs "
        "in PostgreSQL, side by side in one run against one throwaway PostgreSQL "
        f"{result['postgresql'].split()[0]} server with its default durability "
        f"({result['durability']}); each system and each number of worker "
        "processes gets a fresh database with the system's own schema. The job is a "
        "no-op. *floor* is not a library: it is the minimal durable queue written for "
        "this benchmark (one table, an enqueue of one INSERT with the payloads sent from "
        "the client, claims of up to 10 with `FOR UPDATE SKIP LOCKED` once half of the 10 "
        "slots are free, the ends of the moment in one UPDATE; no trigger, fencing, "
        "events or lifecycle), the yardstick: *÷ floor* is a row's figure divided by the "
        "floor's in the same kind of row. *jobs/s*: N jobs enqueued first, then the "
        "worker processes (each one event loop, already imported and connected) are "
        "released together, and the clock runs until the system's tables say all N are "
        "done. *enqueue jobs/s*: the one batch call that enqueued them (envq "
        "`send(*envelopes)`, pgqueuer `Queries.enqueue` with lists, procrastinate "
        "`batch_defer_async`, the floor's INSERT). *p50/p95/p99*: send → start latency "
        "with the workers idle and running, jobs sent one at a time; the job body's "
        "`time.time()` minus the one read just before the send call. Higher jobs/s and "
        "lower latency are better. "
        + (
            "The *backlog* rows: one worker process draining a queue filled with the "
            "backlog before it starts (no latency phase). "
            if backlog
            else ""
        )
        + "The systems take turns at each number of worker processes. One run, no "
        "repetitions: on a shared machine the figures move from run to run by tens of "
        "percent, so compare the systems within one run.",
        "",
        f"- **Software:** Python {v.get('python', '?')}; envq {v.get('envq', '?')}; "
        f"pgqueuer {v.get('pgqueuer', '?')} (asyncpg {v.get('asyncpg', '?')}); "
        f"procrastinate {v.get('procrastinate', '?')} (psycopg {v.get('psycopg', '?')})",
        f"- **Machine:** {result['machine']}",
        f"- **Settings:** {result['settings']}",
        "",
        "| " + " | ".join(HEAD) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
    costs = [_cost_cells(r) for r in result["rows"] if not r["error"]]
    if costs:
        lines += [
            "",
            "Where the drain's time goes: per job, the wall time (1 / jobs/s), the CPU "
            "time of the worker processes and that of the whole PostgreSQL server (every "
            "backend, the parent's polling for the end included), read from `/proc` "
            "before the release and once all N are done; on 2 cores, CPU beyond the wall "
            "time ran in parallel.",
            "",
            "| " + " | ".join(COST_HEAD) + " |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
            *("| " + " | ".join(cells) + " |" for cells in costs),
        ]
    missing = [r for r in result["rows"] if r["system"] == "envq" and r["error"]]
    if missing:
        lines += [
            "",
            "envq.postgres was not available on the checkout that measured these "
            "figures, so envq has no numbers here yet; its rows are to be filled in by "
            "a run on a checkout that has it.",
        ]
    lines += [
        "",
        "To run it (needs PostgreSQL's server programs, found as for the tests of "
        "`envq.postgres`, and the `bench` extra):",
        "",
        "```sh",
        "python -m benchmarks.postgres                 # N=5000, 1/2/4 processes, backlog 100k",
        "python -m benchmarks.postgres --n 1000 --procs 1 --backlog 0 --systems envq,floor",
        "python -m benchmarks.postgres --json pg.json --docs docs/benchmarks.md",
        "python -m benchmarks --postgres               # the suite, with this section",
        "python -m benchmarks.pg_costs                 # envq's cost per call vs backlog",
        "```",
        "",
    ]
    return "\n".join(lines)


def splice(markdown: str, new: str | None, old: str | None = None) -> str:
    """``markdown`` with its PostgreSQL section replaced by ``new``; when ``new`` is
    None, by the PostgreSQL section of ``old`` (a previous report), if any."""
    if new is None:
        new = _find(old or "")
        if new is None:
            return markdown
    lines = markdown.splitlines()
    found = _span(lines)
    if found is not None:
        del lines[found[0] : found[1]]
    at = len(lines)
    for heading in _BEFORE:
        if heading in lines:
            at = lines.index(heading)
            break
    block = [*new.rstrip("\n").splitlines(), ""]
    if at == len(lines) and lines and lines[-1] != "":
        block = ["", *block]
    lines[at:at] = block
    return "\n".join(lines).rstrip("\n") + "\n"


def _span(lines: list[str]) -> tuple[int, int] | None:
    if HEADING not in lines:
        return None
    start = lines.index(HEADING)
    end = start + 1
    while end < len(lines) and not lines[end].startswith("## "):
        end += 1
    return start, end


def _find(markdown: str) -> str | None:
    lines = markdown.splitlines()
    found = _span(lines)
    if found is None:
        return None
    return "\n".join(lines[found[0] : found[1]]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.postgres``: measure and print the table."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.postgres",
        description="envq.postgres, pgqueuer and procrastinate on one throwaway "
        "PostgreSQL server: throughput, enqueue rate and send→start latency.",
    )
    ap.add_argument("--n", type=int, default=DEFAULT_N, help="jobs pre-enqueued (5000)")
    ap.add_argument(
        "--procs", default=",".join(map(str, DEFAULT_PROCS)), help="worker processes (1,2,4)"
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="systems to run (all)")
    ap.add_argument(
        "--latency-jobs", type=int, default=DEFAULT_LATENCY_JOBS, help="jobs sent one at a time"
    )
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE, help="their rate, jobs/s (100)")
    ap.add_argument(
        "--backlog",
        type=int,
        default=DEFAULT_BACKLOG,
        help=f"jobs of the backlog row, one worker process (100000; 0: none; "
        f"procrastinate capped at {BACKLOG_CAPS['procrastinate']:,})",
    )
    ap.add_argument("--json", metavar="FILE", type=Path, help="save the raw figures")
    ap.add_argument(
        "--docs",
        metavar="FILE",
        type=Path,
        help="write the PostgreSQL section into this report (e.g. docs/benchmarks.md)",
    )
    args = ap.parse_args(argv)
    systems = [s.strip() for s in str(args.systems).split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    try:
        procs = [int(p) for p in str(args.procs).split(",") if p.strip()]
    except ValueError:
        ap.error(f"--procs must be comma-separated integers, got {args.procs!r}")
    if not procs or min(procs) < 1:
        ap.error(f"--procs must be integers >= 1, got {args.procs!r}")
    if args.n < 1 or args.latency_jobs < 1 or args.rate <= 0:
        ap.error("--n, --latency-jobs and --rate must be positive")
    if args.backlog < 0:
        ap.error(f"--backlog must be 0 or more, got {args.backlog}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.perf_counter()
    log(f"load average at start: {_load()}")
    result = asyncio.run(
        run_all(
            systems,
            procs,
            n=args.n,
            latency_jobs=args.latency_jobs,
            rate=args.rate,
            log=log,
            backlog=args.backlog,
        )
    )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    log(f"load average at end: {_load()}; wall time {result['wall_s']:.0f} s")
    log("")
    log(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.docs is not None:
        text = args.docs.read_text(encoding="utf-8") if args.docs.exists() else ""
        args.docs.write_text(splice(text, section(result)), encoding="utf-8")
        log(f"wrote the PostgreSQL section into {args.docs}")
    return 0


if __name__ == "__main__":
    # Through the package's module, so that the job functions and the worker processes'
    # entry routine are importable by name (not ``__main__``'s copies).
    from benchmarks.postgres import main as _main

    sys.exit(_main())
