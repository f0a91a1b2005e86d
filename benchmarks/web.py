"""How fast the dashboard (``envq.web``) answers over a large queue, on PostgreSQL or
in process.

A throwaway PostgreSQL server gets one queue of N envelopes (100,000 by default), its
journal on, moved through the tables as a node would move them: most claimed and
ended (SUCCEEDED, some FAILED), some left READY, some DELAYED, some periodic ones
waiting for their next run. Then each page is asked for through the app in process
(httpx's ASGI transport: the time is the app's and the database's, no socket), once
to warm up and ``--reps`` times measured; the median and the slowest are printed.

The failed ones carry a last error with a traceback and a story of one attempt, as a
node writes them. An envelope's page reads its moves from the journal through the
index ``journal_seq (queue, seq, n)``: the oldest envelope's page costs what the
newest one's does.

``--store memory``: an in-process :class:`envq.Queue` instead, holding N envelopes
(DELAYED an hour, so that they stay), the app subscribed to it before the sends; the
same pages, asked through the app on the queue's own loop.

Run it from the project root::

    python -m benchmarks.web                 # N=100000 (about a minute to fill)
    python -m benchmarks.web --n 20000 --reps 3
    python -m benchmarks.web --store memory

It is a program, not a test: it reports numbers and never fails on them (the target
is under a second a page on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

BATCH = 20_000
#: Attempts claimed and ended per statement while filling: a statement that moves many
#: rows of one queue updates its kept counts (envq.counts) as often, and each update
#: of a row already updated in the same transaction walks the versions before it.
ENDS = 1_000
#: The error of a failed attempt: a traceback of a common size.
ERROR = json.dumps(
    {
        "type": "builtins.RuntimeError",
        "message": "the mail server said no",
        "traceback": "Traceback (most recent call last):\n"
        + '  File "/srv/app/jobs.py", line 42, in send_mail\n    raise RuntimeError(...)\n' * 12
        + "RuntimeError: the mail server said no\n",
    }
)


async def _fill(dsn: str, n: int) -> dict[str, int]:
    import asyncpg  # noqa: PLC0415

    from envq.postgres.schema import render  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(render())
        await conn.execute(
            "INSERT INTO envq.queues (name, capacity, journal) VALUES ('bench', 0, true)"
        )
        await conn.execute("UPDATE envq.queues SET state = 'running', call = 'start'")
        ready = n // 10
        delayed = n // 20
        periodic = min(1000, n // 100)
        ended = n - ready - delayed - periodic
        sent = 0
        while sent < ended + ready:
            size = min(BATCH, ended + ready - sent)
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, id, type, invoke, payload, kind, state,"
                " event)"
                " SELECT 'bench', to_jsonb('job-' || g), CASE WHEN g % 97 = 0 THEN 'rare'"
                " ELSE 'mail' END, 'benchmarks.web:job', jsonb_build_object('to', g || '@x'),"
                " 'one_off', 'ready', 'send' FROM generate_series($1::int, $2::int) AS g",
                sent + 1,
                sent + size,
            )
            sent += size
        await conn.execute(
            "INSERT INTO envq.envelopes (queue, id, type, invoke, kind, state, event, wait,"
            " due_at) SELECT 'bench', to_jsonb('later-' || g), 'mail', 'benchmarks.web:job',"
            " 'one_off', 'delayed', 'send', true, now() + interval '1 hour'"
            " FROM generate_series(1, $1::int) AS g",
            delayed,
        )
        await conn.execute(
            "INSERT INTO envq.envelopes (queue, id, type, invoke, kind, state, event, wait,"
            " due_at, interval_s) SELECT 'bench', to_jsonb('tick-' || g), 'tick',"
            " 'benchmarks.web:job', 'periodic', 'delayed', 'send', true,"
            " now() + g * interval '1 second', 60 FROM generate_series(1, $1::int) AS g",
            periodic,
        )
        done = 0
        while done < ended:
            size = min(ENDS, ended - done)
            claimed = await conn.fetch(
                "SELECT seq, lease_token FROM envq.claim('bench', 'bench-node', $1,"
                " interval '1 hour')",
                size,
            )
            seqs = [r["seq"] for r in claimed]
            failing = [s % 10 == 0 for s in seqs]
            await conn.execute(
                "SELECT count(*) FROM envq.finish_many($1::bigint[], $2::uuid[],"
                " $3::envq.envelope_event[], $4::envq.decision_kind[],"
                " $5::envq.cancel_cause[], $6::float8[], $7::int[], $8::jsonb[])",
                seqs,
                [r["lease_token"] for r in claimed],
                ["attempt_error" if f else "attempt_ok" for f in failing],
                ["drop" if f else None for f in failing],
                [None] * len(seqs),
                [None] * len(seqs),
                [None] * len(seqs),
                [ERROR if f else None for f in failing],
            )
            done += size
        await conn.execute("ANALYZE")
        rows = await conn.fetch(
            "SELECT state::text, count(*) FROM envq.envelopes GROUP BY 1 ORDER BY 1"
        )
        journal = await conn.fetchval("SELECT count(*) FROM envq.journal")
        return {**{r[0]: r[1] for r in rows}, "journal rows": journal}
    finally:
        await conn.close()


async def _measure(reps: int, dsn: str | None = None, n: int = 0) -> list[tuple[str, list[float]]]:
    """Time the pages of the app over ``dsn``, or (None) over an in-process queue of
    ``n`` envelopes made here."""
    import httpx  # noqa: PLC0415

    import envq  # noqa: PLC0415
    import envq.web  # noqa: PLC0415

    queue: envq.Queue | None = None
    if dsn is None:
        queue = envq.Queue("bench", workers=4)
        web = envq.web.app(queue)
        queue.start()
        start = time.perf_counter()
        queue.send(
            *(
                envq.Envelope(
                    invoke=_job,
                    id=f"job-{g}",
                    type="rare" if g % 97 == 0 else "mail",
                    delay=3600,
                    payload={"to": f"{g}@x"},
                )
                for g in range(1, n + 1)
            )
        )
        print(f"sent {n:,} envelopes in process in {time.perf_counter() - start:.1f} s")
    else:
        web = envq.web.app(dsn=dsn)
    transport = httpx.ASGITransport(app=web)
    results: list[tuple[str, list[float]]] = []
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as c:
            first = (await c.get("/envelopes?q=bench&limit=1")).text
            top = int(first.split("key=", 1)[1].split('"', 1)[0])
            mid = top // 2
            pages = [
                ("overview /", "/"),
                ("machines /queue", "/queue?q=bench"),
                ("live counts /api/counts", "/api/counts?q=bench"),
                ("envelopes, first page", "/envelopes?q=bench"),
                ("envelopes, a page in the middle", f"/envelopes?q=bench&before={mid}"),
                ("envelopes, the page before it", f"/envelopes?q=bench&after={mid}"),
                ("envelopes state=ready", "/envelopes?q=bench&state=ready"),
                (
                    "envelopes state=delayed, middle",
                    f"/envelopes?q=bench&state=delayed&before={mid}",
                ),
                ("envelopes type=rare", "/envelopes?q=bench&type=rare"),
                ("envelopes id=job-50000", '/envelopes?q=bench&id="job-50000"'),
                ("one envelope, the newest", f"/envelope?q=bench&key={top}"),
                ("one envelope, in the middle", f"/envelope?q=bench&key={mid}"),
                ("one envelope, the oldest", "/envelope?q=bench&key=1"),
                ("its state (the open page's poll)", f"/api/envelope?q=bench&key={mid}"),
                ("schedules", "/schedules?q=bench"),
            ]
            if queue is None:
                failed = await c.get(f"/envelopes?q=bench&state=failed&before={mid}&limit=1")
                bad = int(failed.text.split("key=", 1)[1].split('"', 1)[0])
                story = (await c.get(f"/envelope?q=bench&key={bad}")).text
                assert 'class="traceback"' in story, "the failed envelope shows no error"
                pages.append(("one failed envelope (its error)", f"/envelope?q=bench&key={bad}"))
            for name, url in pages:
                answer = await c.get(url)
                assert answer.status_code == 200, (url, answer.status_code, answer.text[:300])
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    answer = await c.get(url)
                    times.append(time.perf_counter() - start)
                    assert answer.status_code == 200
                results.append((name, times))
    finally:
        await envq.web.aclose(web)
        if queue is not None:
            await queue.terminate()
    return results


def main(argv: list[str] | None = None) -> int:
    """Fill a throwaway server, time the pages, print a table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.web", description=__doc__)
    parser.add_argument("--n", type=int, default=100_000, help="envelopes (default 100000)")
    parser.add_argument("--reps", type=int, default=5, help="measured requests a page (5)")
    parser.add_argument(
        "--store",
        choices=("postgres", "memory"),
        default="postgres",
        help="the queue shown: a throwaway PostgreSQL server's, or an in-process one",
    )
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    if args.store == "memory":
        _print(asyncio.run(_measure(args.reps, n=args.n)))
        return 0
    from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

    with ThrowawayServer() as server:
        admin = server.dsn()
        dsn = server.dsn("webbench")

        async def create() -> None:
            import asyncpg  # noqa: PLC0415

            conn = await asyncpg.connect(admin)
            try:
                await conn.execute("CREATE DATABASE webbench")
            finally:
                await conn.close()

        asyncio.run(create())
        start = time.perf_counter()
        counts = asyncio.run(_fill(dsn, args.n))
        print(f"filled in {time.perf_counter() - start:.1f} s: {counts}")
        results = asyncio.run(_measure(args.reps, dsn))
    _print(results)
    return 0


def _print(results: list[tuple[str, list[float]]]) -> None:
    width = max(len(name) for name, _ in results)
    print(f"\n{'page'.ljust(width)}  median ms  slowest ms")
    for name, times in results:
        median, slowest = statistics.median(times) * 1000, max(times) * 1000
        print(f"{name.ljust(width)}  {median:9.1f}  {slowest:10.1f}")


def job(env: Any) -> None:
    """The envelopes' callable (never run: the benchmark only reads their rows)."""


async def _job(env: Any) -> None:
    """The in-process envelopes' callable (never run: they wait an hour)."""


if __name__ == "__main__":
    sys.exit(main())
