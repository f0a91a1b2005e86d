"""The PostgreSQL benchmark's harness (``benchmarks/postgres.py``) measures what it says.

One tiny run of the measuring function with envq.postgres and with the floor (the
minimal queue written for the benchmark; both need only asyncpg, which the dev extra
installs; the peers need the bench extra) and one worker process: every job it
enqueued is done, every latency job reported its start, and the figures are positive;
the report divides every row by the floor's. One tiny run of each measurement of
``benchmarks.pg_costs``. No figure is compared with a target: speed is never asserted.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import postgres as bench
from envq.postgres._server import ThrowawayServer


@pytest.mark.parametrize("system", ["envq", bench.FLOOR])
def test_tiny_run_gives_well_formed_figures(pg_server: ThrowawayServer, system: str) -> None:
    row = asyncio.run(
        bench.measure(
            pg_server,
            system,
            1,
            n=50,
            latency_jobs=10,
            rate=200.0,
            database=f"bench_harness_{system}",
            within=30.0,
        )
    )
    assert row.error == "", row
    assert row.done == 50 + 10
    assert row.enqueue_s > 0
    assert row.run_s > 0
    assert len(row.latencies_ms) == 10
    assert all(ms > 0 for ms in row.latencies_ms)
    summary = row.summary()
    assert summary["jobs_per_s"] > 0
    assert summary["enqueue_per_s"] > 0
    lat = summary["latency_ms"]
    # Interpolated percentiles may pass the largest sample by a float's rounding error,
    # and the summary's (to 0.01 ms) by that rounding.
    assert row.percentile(99) <= max(row.latencies_ms) * (1 + 1e-9)
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= round(max(row.latencies_ms), 2) + 1e-9
    if summary["worker_cpu_us_per_job"] is not None:  # (read from /proc)
        assert summary["worker_cpu_us_per_job"] >= 0
        assert summary["server_cpu_us_per_job"] >= 0
    # The report's section holds the row, and replaces itself rather than stacking.
    result = {
        "n": 50,
        "latency_jobs": 10,
        "rate": 200.0,
        "settings": bench.SETTINGS,
        "postgresql": "15",
        "machine": "test",
        "durability": "fsync=on",
        "load_average": "0",
        "versions": {},
        "rows": bench.with_ratios([summary]),
    }
    text = bench.section(result)
    assert f"| {system} | 1 | 50 |" in text
    report = bench.splice("# report\n\n## Method\n\nhow\n", text)
    again = bench.splice(report, text)
    assert again == report
    assert again.count(bench.HEADING) == 1
    assert again.index(bench.HEADING) < again.index("## Method")
    kept = bench.splice("# report\n\n## Method\n\nhow\n", None, old=report)
    assert kept == report


def test_the_systems_take_turns_at_each_number_of_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measured in turns (envq 1, pgqueuer 1, envq 2, ...), reported by system."""
    import envq.postgres._server as server_module  # noqa: PLC0415

    class Server:
        def start(self) -> None: ...

        def stop(self) -> None: ...

        def dsn(self, name: str = "postgres") -> str:
            return name

    order: list[tuple[str, int]] = []

    async def measure(server: object, system: str, procs: int, **_: object) -> bench.Row:
        order.append((system, procs))
        return bench.Row(system=system, procs=procs, n=1)

    async def facts(dsn: str) -> tuple[str, str]:
        return "15.0", "fsync=on"

    monkeypatch.setattr(server_module, "ThrowawayServer", lambda fast: Server())
    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "_server_facts", facts)
    monkeypatch.setattr(bench, "_available", lambda system: None)
    result = asyncio.run(
        bench.run_all(
            ["envq", "pgqueuer"], [1, 2], n=1, latency_jobs=1, rate=1.0, log=lambda _: None
        )
    )
    assert order == [("envq", 1), ("pgqueuer", 1), ("envq", 2), ("pgqueuer", 2)]
    reported = [(row["system"], row["procs"]) for row in result["rows"]]
    assert reported == [("envq", 1), ("envq", 2), ("pgqueuer", 1), ("pgqueuer", 2)]


def test_every_row_is_divided_by_the_floor_s_of_its_kind() -> None:
    """The ratios: the floor's row of the same number of processes, the backlog row by
    the floor's backlog row; none where the floor has no figure."""
    rows = [
        bench.Row("envq", 1, 100, run_s=2.0, enqueue_s=1.0),
        bench.Row(bench.FLOOR, 1, 100, run_s=1.0, enqueue_s=0.25),
        bench.Row("envq", 1, 1000, backlog=True, run_s=10.0, enqueue_s=1.0),
        bench.Row(bench.FLOOR, 1, 1000, backlog=True, run_s=5.0, enqueue_s=0.5),
        bench.Row("envq", 2, 100, run_s=1.0, enqueue_s=1.0),
        bench.Row(bench.FLOOR, 2, 100, error="failed"),
    ]
    found = bench.with_ratios([row.summary() for row in rows])
    assert [(r["jobs_vs_floor"], r["enqueue_vs_floor"]) for r in found] == [
        (0.5, 0.25),
        (1.0, 1.0),
        (0.5, 0.5),
        (1.0, 1.0),
        (None, None),
        (None, None),
    ]
    assert "0.50×" in bench.table({"rows": found})


def test_the_cost_measurements_run(pg_server: ThrowawayServer) -> None:
    """``benchmarks.pg_costs``, tiny: every call is timed as often as asked."""
    from benchmarks import pg_costs  # noqa: PLC0415

    timings = asyncio.run(pg_costs.at_live(pg_server, 30, 2))
    assert [t.what for t in timings] == [
        "send 1, capacity",
        "send 1, no capacity",
        "claim 10",
        "end 10 + claim 10",
        "counts()",
    ]
    assert all(len(t.ms) == 2 and min(t.ms) > 0 for t in timings)
    plans: list[str] = []
    after = asyncio.run(pg_costs.without_vacuum(pg_server, 60, 2, lambda _: None, plans))
    assert len(plans) == 3
    assert all("Limit" in plan for plan in plans), plans
    assert [t.live for t in after] == [
        "60",
        "60, 30 ended, no vacuum",
        "60, 30 ended, vacuumed",
        "60, 30 ended, analysed",
    ]
    assert "claim 10" in pg_costs.table([t.row() for t in [*timings, *after]])
