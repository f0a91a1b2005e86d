"""Job queues on PostgreSQL side by side: envq.postgres, pgqueuer and procrastinate.

One throwaway PostgreSQL server with the default durability (``fsync`` and
``synchronous_commit`` on), a fresh database per system and worker-process count, and
the same no-op job everywhere. For each system and 1, 2 and 4 worker processes (each
process one event loop, started with ``multiprocessing``'s *spawn*):

* **enqueue**: N jobs sent in one batch call before any worker runs (jobs/s);
* **throughput**: the worker processes are started, imported and connected, then
  released together; the time from the release until the system's own tables say all
  N jobs are done (jobs/s);
* **send → start latency**: with the workers idle and running, jobs are sent one at a
  time at a steady rate; each job's body records ``time.time()`` on entry, and the
  latency is that minus ``time.time()`` read just before the send call (p50/p95/p99).

Run it from the project root::

    python -m benchmarks.postgres                 # N=5000, 1/2/4 processes (~2-3 min)
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

#: The systems, in the order they run and are reported.
SYSTEMS = ("envq", "pgqueuer", "procrastinate")
#: Jobs one worker process may run at once (envq ``workers``, procrastinate
#: ``concurrency``) or fetch in one go (pgqueuer ``batch_size``).
CONCURRENCY = 10
DEFAULT_N = 5000
DEFAULT_PROCS = (1, 2, 4)
DEFAULT_LATENCY_JOBS = 200
DEFAULT_RATE = 100.0
#: How often the parent asks the database how many jobs are done.
POLL = 0.01
#: Longest wait for any one phase before the run is given up as failed.
PHASE_TIMEOUT = 120.0
#: The one line of settings every report states.
SETTINGS = (
    f"envq: PgQueue(workers={CONCURRENCY}); "
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
    enqueue_s: float = 0.0
    run_s: float = 0.0
    done: int = 0
    latencies_ms: list[float] = field(default_factory=list)
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

    def summary(self) -> dict[str, Any]:
        """The derived figures (what the table and the JSON file show)."""
        return {
            "system": self.system,
            "procs": self.procs,
            "n": self.n,
            "jobs_per_s": round(self.jobs_per_s, 1),
            "enqueue_per_s": round(self.enqueue_per_s, 1),
            "latency_ms": {f"p{p}": round(self.percentile(p), 2) for p in (50, 95, 99)},
            "latency_jobs": len(self.latencies_ms),
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
        importlib.import_module(system)
    except ImportError as error:
        return f"not installed ({error}; pip install -e '.[bench]')"
    return None


PRODUCERS: dict[str, Callable[[str], contextlib.AbstractAsyncContextManager[Producer]]] = {
    "envq": _envq_producer,
    "pgqueuer": _pgq_producer,
    "procrastinate": _procrastinate_producer,
}
SERVERS: dict[str, Serve] = {
    "envq": _envq_serve,
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


async def _until(what: str, check: Callable[[], Awaitable[bool]], within: float) -> None:
    limit = time.perf_counter() + within
    while not await check():
        if time.perf_counter() > limit:
            raise TimeoutError(f"{what}: not done after {within:.0f} s")
        await asyncio.sleep(POLL)


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
) -> Row:
    """Measure ``system`` with ``procs`` worker processes on ``server`` (an
    ``envq.postgres._server.ThrowawayServer``) in a fresh database; a phase that takes
    longer than ``within`` seconds, and any other error, ends up in :attr:`Row.error`,
    never raised."""
    row = Row(system=system, procs=procs, n=n)
    why = _available(system)
    if why is not None:
        row.error = why
        return row
    name = database or f"bench_{system}_{procs}"
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

            await _until("throughput", all_done, within)
            row.run_s = time.perf_counter() - started

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

            await _until("latency jobs", rest_done, within)
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
) -> dict[str, Any]:
    """Start one server (default durability), measure every system with every number
    of worker processes, stop the server; returns the raw figures."""
    from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

    rows: list[Row] = []
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
    finally:
        server.stop()
    rows.sort(key=lambda row: systems.index(row.system))
    return {
        "n": n,
        "latency_jobs": latency_jobs,
        "rate": rate,
        "settings": SETTINGS,
        "postgresql": pg_version,
        "durability": durability,
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}, "
        f"{cpu_model()}, {os.cpu_count()} CPUs",
        "load_average": _load(),
        "versions": _versions(),
        "rows": [{**row.summary(), "raw": asdict(row)} for row in rows],
    }


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
    "jobs/s",
    "enqueue jobs/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "note",
)


def _cells(summary: dict[str, Any]) -> list[str]:
    if summary["error"]:
        procs = str(summary["procs"]) if summary["procs"] else "–"
        return [summary["system"], procs, "–", "–", "–", "–", "–", summary["error"]]
    lat = summary["latency_ms"]
    return [
        summary["system"],
        str(summary["procs"]),
        f"{summary['jobs_per_s']:,.0f}",
        f"{summary['enqueue_per_s']:,.0f}",
        f"{lat['p50']:.1f}",
        f"{lat['p95']:.1f}",
        f"{lat['p99']:.1f}",
        "",
    ]


def _line(row: Row) -> str:
    return "  ".join(_cells(row.summary())).rstrip()


def table(result: dict[str, Any]) -> str:
    """The figures as a plain text table."""
    body = [list(HEAD), *(_cells(r) for r in result["rows"])]
    widths = [max(len(cells[i]) for cells in body) for i in range(len(HEAD))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    )


#: The heading of the section in ``docs/benchmarks.md``.
HEADING = "## PostgreSQL"
#: The sections of the suite's report this one goes before (the first found).
_BEFORE = ("## Profile", "## Method", "## Notes")


def section(result: dict[str, Any], command: str = "python -m benchmarks.postgres") -> str:
    """The ``## PostgreSQL`` section of ``docs/benchmarks.md`` for ``result``."""
    v = result["versions"]
    lines = [
        HEADING,
        "",
        f"Generated by `{command}` (N = {result['n']:,}; {result['latency_jobs']} latency "
        f"jobs at {result['rate']:g}/s; wall time {result.get('wall_s', 0):.0f} s; load "
        f"average {result['load_average']} at the end). Job queues that keep their jobs "
        "in PostgreSQL, side by side in one run against one throwaway PostgreSQL "
        f"{result['postgresql'].split()[0]} server with its default durability "
        f"({result['durability']}); each system and each number of worker "
        "processes gets a fresh database with the system's own schema. The job is a "
        "no-op. *jobs/s*: N jobs enqueued first, then the worker processes (each one "
        "event loop, already imported and connected) are released together, and the "
        "clock runs until the system's tables say all N are done. *enqueue jobs/s*: "
        "the one batch call that enqueued them (envq `send(*envelopes)`, pgqueuer "
        "`Queries.enqueue` with lists, procrastinate `batch_defer_async`). *p50/p95/p99*: "
        "send → start latency with the workers idle and running, jobs sent one at a "
        "time; the job body's `time.time()` minus the one read just before the send "
        "call. Higher jobs/s and lower latency are better. The systems take turns at "
        "each number of worker processes. One run, no repetitions: on a shared machine "
        "the figures move from run to run by tens of percent, so compare the systems "
        "within one run.",
        "",
        f"- **Software:** Python {v.get('python', '?')}; envq {v.get('envq', '?')}; "
        f"pgqueuer {v.get('pgqueuer', '?')} (asyncpg {v.get('asyncpg', '?')}); "
        f"procrastinate {v.get('procrastinate', '?')} (psycopg {v.get('psycopg', '?')})",
        f"- **Machine:** {result['machine']}",
        f"- **Settings:** {result['settings']}",
        "",
        "| " + " | ".join(HEAD) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
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
        "python -m benchmarks.postgres                      # N=5000, 1/2/4 processes, ~2-3 min",
        "python -m benchmarks.postgres --n 1000 --procs 1 --systems pgqueuer",
        "python -m benchmarks.postgres --json pg.json --docs docs/benchmarks.md",
        "python -m benchmarks --postgres                    # the suite, with this section",
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

    def log(msg: str) -> None:
        print(msg, flush=True)

    started = time.perf_counter()
    log(f"load average at start: {_load()}")
    result = asyncio.run(
        run_all(systems, procs, n=args.n, latency_jobs=args.latency_jobs, rate=args.rate, log=log)
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
