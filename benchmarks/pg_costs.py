"""What one call of envq.postgres costs as the backlog grows.

On one throwaway PostgreSQL server with the default durability, a fresh database per
scenario, a queue filled with no-op envelopes (READY: the queue runs, nobody works)
and ``VACUUM ANALYZE``-d, each call timed ``--repeat`` times on its own, as a
process calls it:

* **send 1, capacity**: ``PgQueue.send`` of one envelope to a queue with a capacity
  (the admission check counts the live envelopes under the queue's send lock);
* **send 1, no capacity**: the same with the queue's capacity set to 0 (no limit);
* **claim 10**: ``envq.claim(queue, owner, 10, lease)``, the node's pump's statement
  (each claims 10 more; they stay RUNNING);
* **end 10 + claim 10**: ``envq.finish_and_claim`` ending 10 attempts as succeeded and
  claiming 10 more, the node's finisher's statement in a steady drain;
* **counts()**: ``PgQueue.counts``.

At 100 and 100,000 live envelopes (``--live``); then item 10 of issue 28's scenario:
100,000 live envelopes, 20,000 of them claimed and ended (in claims and ends of 100)
with autovacuum off on the table and no vacuum in between, then **claim 10** again,
once more after a ``VACUUM``, and once more after an ``ANALYZE``. Milliseconds per
call: the median and the mean (and the slowest).

``--explain`` prints the plan of a claim's pick at each step of that scenario, and
the plans of a claim, an end with a claim and a send, with the time of each nested
statement and of the trigger (``auto_explain``, nested statements, ``ANALYZE`` and
``BUFFERS``), at the largest ``--live``. ``--drain N`` (default 20,000; 0: none)
restarts the server with ``pg_stat_statements`` and ``track_functions`` and drains N
envelopes with one in-process node of 10 workers, then prints the statements that
took the server's time (nested ones included), the heaviest first, and the time spent
in each of envq's functions (the trigger's included).

Run it from the project root::

    python -m benchmarks.pg_costs                  # ~2 min
    python -m benchmarks.pg_costs --repeat 20 --live 100,10000 --drain 0
    python -m benchmarks.pg_costs --explain --json /tmp/costs.json

A program, not a test: it reports numbers and never fails on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # ``python benchmarks/pg_costs.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.postgres import create_database, noop
from envq.postgres._node import _FINISH_AND_CLAIM

QUEUE = "costs"
OWNER = "costs-owner"
#: A capacity no scenario reaches: the admission check runs, and always passes.
CAPACITY = 10_000_000
#: The envelopes of one send while filling the queue.
FILL_BATCH = 10_000
DEFAULT_LIVE = (100, 100_000)
DEFAULT_REPEAT = 50
#: Item 10 of issue 28: claimed and ended without a vacuum in between.
ENDED_WITHOUT_VACUUM = 20_000
DEFAULT_DRAIN = 20_000

_CLAIM = "SELECT * FROM envq.claim($1, $2, $3, $4 * interval '1 second')"


def _log(message: str) -> None:
    print(message, flush=True)


class Timing:
    """Milliseconds of the calls of one kind."""

    def __init__(self, what: str, live: str, ms: list[float]) -> None:
        self.what = what
        self.live = live
        self.ms = ms

    def row(self) -> dict[str, Any]:
        """The figures (what the table and the JSON file show)."""
        return {
            "call": self.what,
            "live": self.live,
            "calls": len(self.ms),
            "median_ms": round(statistics.median(self.ms), 3),
            "mean_ms": round(statistics.fmean(self.ms), 3),
            "max_ms": round(max(self.ms), 3),
        }


async def _time(times: int, call: Callable[[], Awaitable[object]]) -> list[float]:
    found = []
    for _ in range(times):
        started = time.perf_counter()
        await call()
        found.append((time.perf_counter() - started) * 1000.0)
    return found


async def _filled(server: Any, database: str, live: int) -> tuple[Any, Any]:
    """A fresh database whose queue holds ``live`` READY envelopes, vacuumed and
    analysed; the queue (connected, a producer) and a plain connection."""
    import asyncpg  # noqa: PLC0415

    import envq  # noqa: PLC0415
    from envq.postgres import PgQueue  # noqa: PLC0415

    await create_database(server.dsn(), database)
    dsn = server.dsn(database)
    queue = PgQueue(dsn, QUEUE, workers=0, capacity=CAPACITY, node="costs")
    await queue.install()
    await queue.connect()
    await queue.start()
    left = live
    while left:
        batch = min(left, FILL_BATCH)
        await queue.send(*(envq.Envelope(invoke=noop, payload=-1) for _ in range(batch)))
        left -= batch
    conn = await asyncpg.connect(dsn)
    await conn.execute("VACUUM ANALYZE envq.envelopes")
    return queue, conn


async def _claim(conn: Any, how_many: int) -> list[Any]:
    return list(await conn.fetch(_CLAIM, QUEUE, OWNER, how_many, 300.0))


async def _end_and_claim(conn: Any, rows: list[Any], how_many: int) -> list[Any]:
    k = len(rows)
    return list(
        await conn.fetch(
            _FINISH_AND_CLAIM,
            [r["seq"] for r in rows],
            [r["lease_token"] for r in rows],
            ["attempt_ok"] * k,
            [None] * k,
            [None] * k,
            [0.0] * k,
            [None] * k,
            [None] * k,
            QUEUE,
            OWNER,
            how_many,
            300.0,
        )
    )


async def at_live(server: Any, live: int, repeat: int) -> list[Timing]:
    """The calls' costs with ``live`` envelopes in the queue."""
    import envq  # noqa: PLC0415

    label = f"{live:,}"
    queue, conn = await _filled(server, f"costs_{live}", live)
    found: list[Timing] = []
    try:

        async def send_one() -> None:
            await queue.send(envq.Envelope(invoke=noop, payload=-1))

        found.append(Timing("send 1, capacity", label, await _time(repeat, send_one)))
        await conn.execute("UPDATE envq.queues SET capacity = 0 WHERE name = $1", QUEUE)
        found.append(Timing("send 1, no capacity", label, await _time(repeat, send_one)))
        await conn.execute("UPDATE envq.queues SET capacity = $2 WHERE name = $1", QUEUE, CAPACITY)
        found.append(Timing("claim 10", label, await _time(repeat, lambda: _claim(conn, 10))))
        held = await _claim(conn, 10)
        ms = []
        for _ in range(repeat):
            started = time.perf_counter()
            rows = await _end_and_claim(conn, held, 10)
            ms.append((time.perf_counter() - started) * 1000.0)
            held = [r for r in rows if r["state"] == "running"]
        found.append(Timing("end 10 + claim 10", label, ms))
        found.append(Timing("counts()", label, await _time(min(repeat, 10), queue.counts)))
    finally:
        await conn.close()
        await queue.close()
    return found


#: The rows a claim picks (envq.claim's first step), to show its plan: the claim's own
#: plan is made inside the function, for the same statement.
_PICK = """
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
SELECT c.seq FROM envq.envelopes AS c
 WHERE c.queue = $1 AND c.state = 'ready'
 ORDER BY c.updated_at, c.seq LIMIT 10 FOR UPDATE OF c SKIP LOCKED
"""


async def _picking(conn: Any) -> str:
    """The plan of a claim's pick, run in a transaction rolled back."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        plan = [r[0] for r in await conn.fetch(_PICK, QUEUE)]
    finally:
        await transaction.rollback()
    return "\n".join(plan)


async def without_vacuum(
    server: Any,
    live: int,
    repeat: int,
    log: Callable[[str], None],
    plans: list[str] | None = None,
) -> list[Timing]:
    """Issue 28's item 10: claims after ``ENDED_WITHOUT_VACUUM`` envelopes were claimed
    and ended with no vacuum in between, after a ``VACUUM``, and after an ``ANALYZE``;
    with ``plans``, the plan of a claim's pick at each step is appended to it."""
    queue, conn = await _filled(server, "costs_dead", live)
    label = f"{live:,}"
    found: list[Timing] = []
    try:
        await conn.execute("ALTER TABLE envq.envelopes SET (autovacuum_enabled = false)")
        found.append(Timing("claim 10", label, await _time(repeat, lambda: _claim(conn, 10))))
        started = time.perf_counter()
        # (Fewer when the queue holds fewer: half of them.)
        target = min(ENDED_WITHOUT_VACUUM, live // 2)
        held = await _claim(conn, min(100, target))
        ended = 0
        while held and ended + len(held) < target:
            rows = await _end_and_claim(conn, held, min(100, target - ended - len(held)))
            ended += len(held)
            held = [r for r in rows if r["state"] == "running"]
        await _end_and_claim(conn, held, 0)
        await conn.execute("SELECT pg_stat_force_next_flush()")
        dead = await conn.fetchval("SELECT pg_stat_get_dead_tuples('envq.envelopes'::regclass)")
        log(
            f"  claimed and ended {ended + len(held):,} in {time.perf_counter() - started:.1f} s"
            f" without a vacuum; dead rows {dead:,}"
        )
        total = ended + len(held)
        for step, command in (
            ("no vacuum", None),
            ("vacuumed", "VACUUM envq.envelopes"),
            ("analysed", "ANALYZE envq.envelopes"),
        ):
            if command is not None:
                await conn.execute(command)
            where = f"{label}, {total:,} ended, {step}"
            if plans is not None:
                plans.append(f"==== a claim's pick at {where}\n" + await _picking(conn))
            found.append(Timing("claim 10", where, await _time(repeat, lambda: _claim(conn, 10))))
    finally:
        await conn.close()
        await queue.close()
    return found


# -- where the time goes -----------------------------------------------------------


#: auto_explain in every session of the database: every statement's plan, with the
#: nested ones (envq's functions, its trigger) and the trigger's time.
_AUTO_EXPLAIN = {
    "session_preload_libraries": "auto_explain",
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
    "auto_explain.log_nested_statements": "on",
    "auto_explain.log_triggers": "on",
}


def _plans(log: str) -> str:
    """The plans auto_explain logged in ``log``: without the driver's own statements
    (its type introspection) and the log's context lines, each statement once (with
    how often it ran and its total time: the trigger's runs once per row)."""
    found: dict[str, list[Any]] = {}
    for entry in log.split("LOG:  duration: ")[1:]:
        lines = []
        for line in entry.splitlines():
            if " CONTEXT:  " in line or (line[:4].isdigit() and " UTC [" in line):
                break
            lines.append(line.replace("\t", "  ", 1))
        text = "\n".join(lines).rstrip()
        if "typeinfo_tree" in text or "'jit'" in text:
            continue
        ms, _, plan = text.partition(" ms  plan:")
        query = " ".join(plan.split("Query Text:", 1)[-1].splitlines()[0].split())
        if query in found:
            found[query][0] += 1
            found[query][1] += float(ms)
        else:
            found[query] = [1, float(ms), plan.strip("\n")]
    return "\n\n".join(
        f"-- {count} run(s), {total:.3f} ms in all\n{plan}" for count, total, plan in found.values()
    )


def _read_from(path: Path, offset: int) -> str:
    with path.open(encoding="utf-8", errors="replace") as text:
        text.seek(offset)
        return text.read()


async def explain(server: Any, live: int) -> str:
    """The plans of a claim, an end with a claim, and a send with a capacity, each
    with its nested statements and the trigger's time (``auto_explain``, from the
    server's log), each statement run once before so that its session has planned
    and compiled what it runs."""
    import asyncpg  # noqa: PLC0415

    import envq  # noqa: PLC0415
    from envq.postgres import PgQueue  # noqa: PLC0415

    database = "costs_explain"
    queue, conn = await _filled(server, database, live)
    await queue.close()
    for name, value in _AUTO_EXPLAIN.items():
        await conn.execute(f"ALTER DATABASE {database} SET {name} = '{value}'")
    await conn.close()
    dsn = server.dsn(database)
    conn = await asyncpg.connect(dsn)
    queue = PgQueue(dsn, QUEUE, workers=0, node="costs")
    await queue.connect()
    log = Path(server.log_file)
    out = []
    try:
        held = await _claim(conn, 10)
        held = [r for r in await _end_and_claim(conn, held, 10) if r["state"] == "running"]

        async def send() -> None:
            await queue.send(envq.Envelope(invoke=noop, payload=-1))

        await send()
        calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("claim 10", lambda: _claim(conn, 10)),
            ("end 10 + claim 10", lambda: _end_and_claim(conn, held, 10)),
            ("send 1, capacity", send),
        ]
        for what, call in calls:
            mark = await asyncio.to_thread(lambda: log.stat().st_size)
            await call()
            logged = await asyncio.to_thread(_read_from, log, mark)
            out.append(f"==== {what} at {live:,} live\n" + _plans(logged))
    finally:
        await conn.close()
        await queue.close()
    return "\n\n".join(out)


def _restart_with_statements(server: Any) -> None:
    """Restart ``server`` with ``pg_stat_statements`` loaded, tracking nested
    statements (those of envq's functions and trigger)."""
    data = Path(server.socket_dir) / "data"
    with (data / "postgresql.auto.conf").open("a", encoding="utf-8") as conf:
        conf.write(
            "shared_preload_libraries = 'pg_stat_statements'\n"
            "pg_stat_statements.track = 'all'\ntrack_functions = 'all'\n"
        )
    prefix = ("runuser", "-u", "postgres", "--") if os.geteuid() == 0 else ()
    subprocess.run(
        [
            *prefix,
            str(server.bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(server.log_file),
            "-m",
            "fast",
            "-w",
            "-t",
            "60",
            "restart",
        ],
        check=True,
        capture_output=True,
    )


async def _succeeded(conn: Any) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM envq.envelopes WHERE queue = $1 AND state = 'succeeded'", QUEUE
        )
    )


async def drain_statements(
    server: Any, n: int
) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
    """Drain ``n`` envelopes with one node of 10 workers in this process; the drain's
    seconds, the statements the server ran meanwhile (by total time) and the time in
    envq's functions (the trigger's included; by their own time)."""
    import asyncpg  # noqa: PLC0415

    import envq  # noqa: PLC0415
    from envq.postgres import PgQueue  # noqa: PLC0415

    await create_database(server.dsn(), "costs_drain")
    dsn = server.dsn("costs_drain")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        producer = PgQueue(dsn, QUEUE, workers=0, node="producer")
        await producer.install()
        async with producer:
            await producer.start()
            left = n
            while left:
                batch = min(left, FILL_BATCH)
                await producer.send(*(envq.Envelope(invoke=noop, payload=-1) for _ in range(batch)))
                left -= batch
            await conn.execute("VACUUM ANALYZE envq.envelopes")
            await conn.execute("SELECT pg_stat_statements_reset(), pg_stat_reset()")
            node = PgQueue(dsn, QUEUE, workers=10, node="drain")
            started = time.perf_counter()
            async with node:
                await node.start()
                while await _succeeded(conn) < n:  # noqa: ASYNC110 - rows of other sessions
                    await asyncio.sleep(0.2)
                seconds = time.perf_counter() - started
                rows = await conn.fetch(
                    "SELECT toplevel, calls, total_exec_time, rows, query"
                    " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                    " ORDER BY total_exec_time DESC LIMIT 25"
                )
                await producer.stop()
        # (A session's function times reach the statistics when it ends, at the latest.)
        functions = await conn.fetch(
            "SELECT schemaname || '.' || funcname AS name, calls, total_time, self_time"
            " FROM pg_stat_user_functions ORDER BY self_time DESC LIMIT 12"
        )
    finally:
        await conn.close()
    timed = [
        {
            "function": f["name"],
            "calls": f["calls"],
            "total_ms": round(f["total_time"], 1),
            "self_ms": round(f["self_time"], 1),
            "self_us_per_envelope": round(f["self_time"] * 1000.0 / n, 1),
        }
        for f in functions
    ]
    return (
        seconds,
        timed,
        [
            {
                "toplevel": r["toplevel"],
                "calls": r["calls"],
                "total_ms": round(r["total_exec_time"], 1),
                "mean_ms": round(r["total_exec_time"] / max(r["calls"], 1), 3),
                "us_per_envelope": round(r["total_exec_time"] * 1000.0 / n, 1),
                "rows": r["rows"],
                "query": " ".join(r["query"].split())[:160],
            }
            for r in rows
        ],
    )


# -- output ------------------------------------------------------------------------


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The timings as a plain text table."""
    head = ["call", "live envelopes", "calls", "median ms", "mean ms", "max ms"]
    body = [
        head,
        *(
            [
                r["call"],
                r["live"],
                str(r["calls"]),
                f"{r['median_ms']:.2f}",
                f"{r['mean_ms']:.2f}",
                f"{r['max_ms']:.2f}",
            ]
            for r in rows
        ),
    ]
    widths = [max(len(cells[i]) for cells in body) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    )


def _plain(head: list[str], rows: list[list[str]]) -> str:
    body = [head, *rows]
    widths = [max(len(cells[i]) for cells in body) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip() for cells in body
    )


def statements_table(rows: Sequence[dict[str, Any]]) -> str:
    """The drain's statements as a plain text table."""
    head = ["level", "calls", "total ms", "µs/envelope", "mean ms", "statement"]
    body = [
        head,
        *(
            [
                "top" if r["toplevel"] else "nested",
                f"{r['calls']:,}",
                f"{r['total_ms']:,.0f}",
                f"{r['us_per_envelope']:,.0f}",
                f"{r['mean_ms']:.3f}",
                r["query"],
            ]
            for r in rows
        ),
    ]
    widths = [max(len(cells[i]) for cells in body) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)), cells[-1]])
        for cells in body
    )


async def run(
    live: Sequence[int], repeat: int, *, plans: bool, drain: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Start one server (default durability), measure, stop it; the figures."""
    from benchmarks.postgres import _load, _server_facts  # noqa: PLC0415
    from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

    server = ThrowawayServer(fast=False)
    server.start()
    result: dict[str, Any] = {"load_average_start": _load(), "repeat": repeat}
    try:
        version, durability = await _server_facts(server.dsn())
        result.update(postgresql=version, durability=durability)
        log(f"PostgreSQL {version}, {durability}; {repeat} calls each")
        timings: list[Timing] = []
        for count in live:
            log(f"-- {count:,} live envelopes")
            timings += await at_live(server, count, repeat)
        log(f"-- {max(live):,} live, {ENDED_WITHOUT_VACUUM:,} claimed and ended, no vacuum")
        picks: list[str] | None = [] if plans else None
        timings += await without_vacuum(server, max(live), repeat, log, picks)
        result["timings"] = [t.row() for t in timings]
        if plans:
            result["explain"] = "\n\n".join([*(picks or []), await explain(server, max(live))])
        if drain:
            log(f"-- a drain of {drain:,} with pg_stat_statements")
            _restart_with_statements(server)
            seconds, functions, found = await drain_statements(server, drain)
            result["drain"] = {
                "n": drain,
                "seconds": round(seconds, 2),
                "functions": functions,
                "statements": found,
            }
    finally:
        server.stop()
    result["load_average_end"] = _load()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.pg_costs``: measure and print."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.pg_costs",
        description="envq.postgres: the cost of a send, a claim, an end and counts() as "
        "the backlog grows, and where a drain's server time goes.",
    )
    ap.add_argument(
        "--live",
        default=",".join(map(str, DEFAULT_LIVE)),
        help="live envelopes in the queue (100,100000)",
    )
    ap.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="calls of each (50)")
    ap.add_argument("--explain", action="store_true", help="print the plans (auto_explain)")
    ap.add_argument(
        "--drain",
        type=int,
        default=DEFAULT_DRAIN,
        help="envelopes drained under pg_stat_statements (20000; 0: none)",
    )
    ap.add_argument("--json", metavar="FILE", type=Path, help="save the figures")
    args = ap.parse_args(argv)
    try:
        live = [int(x) for x in str(args.live).split(",") if x.strip()]
    except ValueError:
        ap.error(f"--live must be comma-separated integers, got {args.live!r}")
    if not live or min(live) < 1 or args.repeat < 1 or args.drain < 0:
        ap.error("--live and --repeat must be positive, --drain 0 or more")
    result = asyncio.run(run(live, args.repeat, plans=args.explain, drain=args.drain, log=_log))
    _log(
        f"load average at start {result['load_average_start']}, at end {result['load_average_end']}"
    )
    _log("")
    _log(table(result["timings"]))
    if "drain" in result:
        d = result["drain"]
        _log("")
        _log(
            f"A drain of {d['n']:,} envelopes, one node of 10 workers in this process: "
            f"{d['seconds']:.1f} s ({d['n'] / d['seconds']:,.0f}/s); the server's statements "
            "(nested: inside envq's functions and trigger):"
        )
        _log(statements_table(d["statements"]))
        _log("")
        _log(
            "Time in envq's functions during the drain (own time: without the other "
            "functions each calls; the trigger, envelopes_check, runs for the send, the "
            "claim and the end of each envelope):"
        )
        _log(
            _plain(
                ["function", "calls", "total ms", "own ms", "own µs/envelope"],
                [
                    [
                        f["function"],
                        f"{f['calls']:,}",
                        f"{f['total_ms']:,.0f}",
                        f"{f['self_ms']:,.0f}",
                        f"{f['self_us_per_envelope']:,.1f}",
                    ]
                    for f in d["functions"]
                ],
            )
        )
    if "explain" in result:
        _log("")
        _log(result["explain"])
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    from benchmarks.pg_costs import main as _main

    sys.exit(_main())
