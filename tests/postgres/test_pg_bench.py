"""The PostgreSQL benchmark's harness (``benchmarks/postgres.py``) measures what it says.

One tiny run of the measuring function with envq.postgres (which the dev extra
installs; the peers need the bench extra) and one worker process: every job it
enqueued is done, every latency job reported its start, and the figures are positive.
No figure is compared with a target: speed is never asserted.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks import postgres as bench
from envq.postgres._server import ThrowawayServer


def test_tiny_run_gives_well_formed_figures(pg_server: ThrowawayServer) -> None:
    row = asyncio.run(
        bench.measure(
            pg_server,
            "envq",
            1,
            n=50,
            latency_jobs=10,
            rate=200.0,
            database="bench_harness",
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
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= max(row.latencies_ms)
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
        "rows": [summary],
    }
    text = bench.section(result)
    assert "| envq | 1 |" in text
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
