"""Seeing a shared queue from a node: ``prometheus_metrics(pg_queue)`` (the database's
numbers, this node's attempts), and stamps on a node (``logging_stamp``,
``current_attempt()`` inside an attempt)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue

pytestmark = pytest.mark.real_clock
prometheus_client = pytest.importorskip("prometheus_client")


def _name() -> str:
    return f"observe-{uuid.uuid4().hex[:8]}"


async def _until_counts(q: PgQueue, want: dict[str, int]) -> None:
    async with asyncio.timeout(30):
        while await q.counts() != want:  # noqa: ASYNC110 - the database's state
            await asyncio.sleep(0.05)


def _samples(registry: object, name: str) -> dict[tuple[str, ...], float]:
    """The samples of family ``name`` by their labels (without the queue's name)."""
    out: dict[tuple[str, ...], float] = {}
    for family in registry.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            if sample.name == name:
                labels = tuple(v for k, v in sorted(sample.labels.items()) if k != "name")
                out[labels] = sample.value
    return out


async def test_prometheus_metrics_serve_a_shared_queue(pg_dsn: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    name = _name()
    q = PgQueue(pg_dsn, name, workers=2, poll=0.05)
    await q.install()
    async with q:
        metrics = envq.prometheus_metrics(q, registry)
        await q.start()
        await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=f"ok{i}") for i in range(3)))
        await q.send(envq.Envelope(invoke=pg_jobs.fail, id="bad"))
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", delay=3600))
        await _until_counts(q, {"succeeded": 3, "failed": 1, "delayed": 1})
        # A scrape comes from another thread (the HTTP server's): it reads the database
        # on the queue's loop.
        text = await asyncio.to_thread(prometheus_client.generate_latest, registry)
        assert f'envq_queue_state{{name="{name}",state="running"}} 1.0'.encode() in text
        envelopes = await asyncio.to_thread(_samples, registry, "envq_envelopes")
        assert envelopes[("delayed",)] == 1
        assert envelopes[("succeeded",)] == 3  # ended rows kept: a gauge
        assert envelopes[("failed",)] == 1
        outcomes = await asyncio.to_thread(_samples, registry, "envq_outcomes_total")
        assert outcomes[("ok",)] == 3
        assert outcomes[("error",)] == 1
        work = await asyncio.to_thread(_samples, registry, "workqueue_work_duration_seconds_count")
        assert work[()] == 4  # this node's four attempts
        used = await asyncio.to_thread(_samples, registry, "envq_capacity_used")
        assert used[()] == 1
        # What a node cannot know of a shared queue is not made up.
        assert await asyncio.to_thread(_samples, registry, "workqueue_adds_total") == {}
        metrics.close()
        assert not q._node.watches
        assert await asyncio.to_thread(_samples, registry, "envq_envelopes") == {}
        await q.terminate()


async def test_a_queue_exported_twice_is_refused_and_keeps_no_watch(pg_dsn: str) -> None:
    registry = prometheus_client.CollectorRegistry()
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        first = envq.prometheus_metrics(q, registry)
        with pytest.raises(ValueError, match="already exported"):
            envq.prometheus_metrics(q, registry)
        assert len(q._node.watches) == 1
        first.close()
        assert q._node.watches == []


async def test_stamps_run_on_a_node_and_see_the_attempt(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger(f"envq.test.{uuid.uuid4().hex[:6]}")
    name = _name()
    q = PgQueue(pg_dsn, name, workers=1, poll=0.05, stamps=[envq.logging_stamp(logger)])
    await q.install()
    caplog.set_level(logging.INFO, logger=logger.name)
    async with q:
        await q.start()
        env = envq.Envelope(
            invoke=pg_jobs.note_attempt, id="noted", retry=envq.Retry(attempts=3, base=0.01)
        )
        await q.send(env)
        await _until_counts(q, {"succeeded": 1})
        await q.terminate()
    assert pg_jobs.ATTEMPTS["noted"] == (name, 2)
    records = [r for r in caplog.records if r.name == logger.name]
    seen = [(r.envq_queue, r.envq_attempt, r.envq_outcome) for r in records]  # type: ignore[attr-defined]
    assert seen == [(name, 1, "error"), (name, 2, "ok")]


def test_stamps_are_checked_at_the_call() -> None:
    with pytest.raises(TypeError, match="stamps"):
        PgQueue("postgresql://localhost/x", "q", stamps=3)  # type: ignore[arg-type]
