"""Prometheus metrics with client-go's workqueue names, types, label and buckets, plus
envq's own; served over HTTP on the loopback interface only."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import envq
from envq import _metrics
from tests.queue.rows import LeaseExpired, tell_expired

BUCKETS = ["1e-08", "1e-07", "1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1", "1.0", "10.0"]

#: Family name (as the parser reports it, without ``_total``) → type.
WORKQUEUE = {
    "workqueue_adds": "counter",
    "workqueue_depth": "gauge",
    "workqueue_queue_duration_seconds": "histogram",
    "workqueue_work_duration_seconds": "histogram",
    "workqueue_unfinished_work_seconds": "gauge",
    "workqueue_longest_running_processor_seconds": "gauge",
    "workqueue_retries": "counter",
}
ENVQ = {
    "envq_capacity_used": "gauge",
    "envq_capacity_limit": "gauge",
    "envq_envelopes": "gauge",
    "envq_envelopes_ended": "counter",
    "envq_parked": "gauge",
    "envq_in_flight": "gauge",
    "envq_outcomes": "counter",
    "envq_dedups": "counter",
    "envq_rejections": "counter",
    "envq_stuck_threads": "gauge",
    "envq_queue_state": "gauge",
}


def families(text: str) -> dict[str, Metric]:
    """Parse an exposition into family name → family."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape_registry(registry: CollectorRegistry) -> dict[str, Metric]:
    """Render and parse ``registry`` in this thread."""
    return families(generate_latest(registry).decode())


def http_get(url: str) -> str:
    """GET ``url`` with a real HTTP client."""
    assert url.startswith("http://127.0.0.1:")  # loopback only
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body: bytes = resp.read()
    return body.decode()


def value(fams: dict[str, Metric], sample: str, **labels: str) -> float:
    """The value of the one sample named ``sample`` with exactly ``labels``."""
    family = sample.removesuffix("_total").removesuffix("_bucket")
    family = family.removesuffix("_count").removesuffix("_sum")
    found = [s.value for s in fams[family].samples if s.name == sample and dict(s.labels) == labels]
    assert len(found) == 1, (sample, labels, fams[family].samples)
    return found[0]


def buckets(fams: dict[str, Metric], family: str, queue: str) -> dict[str, float]:
    """``le`` → cumulative count of one histogram series."""
    return {
        s.labels["le"]: s.value
        for s in fams[family].samples
        if s.name == f"{family}_bucket" and s.labels["name"] == queue
    }


async def sleeper(env: envq.Envelope) -> None:
    """Sleeps ``env.payload["sleep"]`` seconds; fails while ``payload["fail"]`` > 0."""
    await asyncio.sleep(env.payload["sleep"])
    if env.payload.get("fail", 0) > 0:
        env.payload["fail"] -= 1
        raise RuntimeError("transient")


def job(ident: int, sleep: float, fail: int = 0, **kwargs: Any) -> envq.Envelope:
    """An envelope of type ``job`` that sleeps, then fails ``fail`` times."""
    return envq.Envelope(
        invoke=sleeper, id=ident, type="job", payload={"sleep": sleep, "fail": fail}, **kwargs
    )


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh registry (never the global one)."""
    return CollectorRegistry()


class TestImport:
    def test_import_envq_imports_no_extra(self) -> None:
        """``import envq`` imports neither prometheus_client, opentelemetry nor rich."""
        code = (
            "import sys, envq; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('prometheus_client', 'opentelemetry', 'rich')]; "
            "assert not bad, bad"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stderr

    def test_missing_prometheus_client_is_a_clear_import_error(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without prometheus_client, the API raises ImportError naming the extra."""
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
        q = envq.Queue("x")
        with pytest.raises(ImportError, match=r"envq\[prometheus\]"):
            envq.prometheus_metrics(q)
        with pytest.raises(ImportError, match=r"envq\[prometheus\]"):
            envq.serve_metrics()


class TestWorkqueueMetrics:
    async def test_names_types_buckets_and_values(self, registry: CollectorRegistry) -> None:
        """A known workload on virtual time gives exact client-go metrics.

        One worker; a (0.5 s) and b (0.25 s, fails once, retried 1 s later) sent at 0:
        a runs 0–0.5; b waits 0.5, fails at 0.75, is ready again at 1.75, runs to 2.0.
        """
        q = envq.Queue("jobs", workers=1)
        envq.prometheus_metrics(q, registry)
        retry = envq.Retry(attempts=2, base=1, jitter=False)
        q.send(job(1, 0.5), job(2, 0.25, fail=1, retry=retry))
        q.start()
        await asyncio.sleep(5)
        fams = scrape_registry(registry)

        for name, typ in {**WORKQUEUE, **ENVQ}.items():
            assert fams[name].type == typ, name
        assert fams["workqueue_depth"].documentation == "Current depth of workqueue"
        for name in WORKQUEUE:
            for sample in fams[name].samples:
                assert sample.labels["name"] == "jobs"
                assert set(sample.labels) <= {"name", "le"}

        assert value(fams, "workqueue_adds_total", name="jobs") == 3
        assert value(fams, "workqueue_retries_total", name="jobs") == 1
        assert value(fams, "workqueue_depth", name="jobs") == 0
        queue_d = buckets(fams, "workqueue_queue_duration_seconds", "jobs")
        assert list(queue_d) == [*BUCKETS, "+Inf"]
        # Waits 0, 0.5 and 0: two in the first bucket, all three by le=1.
        assert queue_d["1e-08"] == 2
        assert queue_d["0.1"] == 2
        assert queue_d["1.0"] == queue_d["+Inf"] == 3
        assert value(fams, "workqueue_queue_duration_seconds_sum", name="jobs") == 0.5
        assert value(fams, "workqueue_queue_duration_seconds_count", name="jobs") == 3
        work_d = buckets(fams, "workqueue_work_duration_seconds", "jobs")
        assert work_d["0.1"] == 0
        assert work_d["1.0"] == 3  # 0.5, 0.25, 0.25
        assert value(fams, "workqueue_work_duration_seconds_sum", name="jobs") == 1.0
        assert value(fams, "workqueue_unfinished_work_seconds", name="jobs") == 0
        assert value(fams, "workqueue_longest_running_processor_seconds", name="jobs") == 0
        await q.terminate()

    async def test_in_flight_gauges_are_computed_at_scrape(
        self, registry: CollectorRegistry
    ) -> None:
        """Unfinished work sums the ages of the attempts in flight, longest running is
        the oldest; depth counts the READY envelopes."""
        q = envq.Queue("busy", workers=2)
        envq.prometheus_metrics(q, registry)
        q.start()
        q.send(job(1, 100), job(2, 100, delay=1), job(3, 100, delay=2))
        await asyncio.sleep(3)
        fams = scrape_registry(registry)
        assert value(fams, "workqueue_unfinished_work_seconds", name="busy") == 3 + 2
        assert value(fams, "workqueue_longest_running_processor_seconds", name="busy") == 3
        assert value(fams, "workqueue_depth", name="busy") == 1
        await asyncio.sleep(1)
        fams = scrape_registry(registry)
        assert value(fams, "workqueue_unfinished_work_seconds", name="busy") == 4 + 3
        assert value(fams, "workqueue_longest_running_processor_seconds", name="busy") == 4
        await q.terminate()

    async def test_retries_count_failed_attempts_put_back(
        self, registry: CollectorRegistry
    ) -> None:
        """Failed attempts that are retried (or rescheduled, periodic) count; a failure
        that ends the envelope and a success do not."""
        q = envq.Queue("r", workers=1)
        envq.prometheus_metrics(q, registry)
        q.start()
        retry = envq.Retry(attempts=3, base=1, jitter=False)
        q.send(job(1, 0, fail=5, retry=retry))  # 3 attempts: 2 retries, then FAILED
        q.send(job(2, 0, fail=1, interval=10))  # periodic: error, then next run
        q.send(job(3, 0))
        await asyncio.sleep(15)
        fams = scrape_registry(registry)
        assert value(fams, "workqueue_retries_total", name="r") == 2 + 1
        await q.terminate()

    async def test_an_expired_lease_put_back_is_a_retry(
        self, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An attempt whose lease expired is a failure: put back by the Retry policy,
        it counts as a retry, as an error does."""
        tell_expired(monkeypatch)

        async def expires(env: envq.Envelope) -> None:
            raise LeaseExpired

        q = envq.Queue("x", workers=1)
        envq.prometheus_metrics(q, registry)
        q.start()
        q.send(envq.Envelope(invoke=expires, id=1, retry=envq.Retry(attempts=3, jitter=False)))
        await asyncio.sleep(15)
        assert q.statistics().outcomes[envq.Outcome.EXPIRED] == 3
        fams = scrape_registry(registry)
        assert value(fams, "workqueue_retries_total", name="x") == 2
        await q.terminate()

    async def test_attached_while_running(self, registry: CollectorRegistry) -> None:
        """An attempt already in flight when the export attaches is not timed."""
        q = envq.Queue("late", workers=1)
        q.start()
        q.send(job(1, 1))
        await asyncio.sleep(0.5)
        envq.prometheus_metrics(q, registry)
        await asyncio.sleep(1)
        fams = scrape_registry(registry)
        assert value(fams, "workqueue_work_duration_seconds_count", name="late") == 0
        assert value(fams, "workqueue_adds_total", name="late") == 0
        assert value(fams, "envq_outcomes_total", name="late", outcome="ok") == 1
        await q.terminate()


class TestEnvqMetrics:
    async def test_capacity_outcomes_dedups_rejections_parked(
        self, registry: CollectorRegistry
    ) -> None:
        """envq's own metrics follow Queue.statistics()."""
        q = envq.Queue("own", workers=1, capacity=3)
        envq.prometheus_metrics(q, registry)
        q.start()
        a = job(1, 1)
        q.send(a, job(2, 0, fail=1), job(3, 1, delay=10))
        q.send(a)  # dedup
        with pytest.raises(envq.CapacityExceeded):
            q.send(job(4, 0))
        await asyncio.sleep(2)
        await q.stop(mode=envq.StopMode.STOP)  # the delayed one is parked
        fams = scrape_registry(registry)
        assert value(fams, "envq_capacity_limit", name="own") == 3
        assert value(fams, "envq_capacity_used", name="own") == 1
        assert value(fams, "envq_parked", name="own") == 1
        assert value(fams, "envq_envelopes", name="own", state="parked") == 1
        assert value(fams, "envq_envelopes", name="own", state="ready") == 0
        assert value(fams, "envq_envelopes_ended_total", name="own", state="succeeded") == 1
        assert value(fams, "envq_envelopes_ended_total", name="own", state="failed") == 1
        assert value(fams, "envq_outcomes_total", name="own", outcome="ok") == 1
        assert value(fams, "envq_outcomes_total", name="own", outcome="error") == 1
        assert value(fams, "envq_outcomes_total", name="own", outcome="timeout") == 0
        assert value(fams, "envq_dedups_total", name="own") == 1
        assert value(fams, "envq_rejections_total", name="own", reason="capacity") == 1
        assert value(fams, "envq_rejections_total", name="own", reason="state") == 0
        assert value(fams, "envq_in_flight", name="own") == 0
        assert value(fams, "envq_stuck_threads", name="own") == 0
        assert value(fams, "envq_queue_state", name="own", state="stopped") == 1
        assert value(fams, "envq_queue_state", name="own", state="running") == 0
        await q.terminate()


class TestRegistry:
    def test_queues_share_one_family_per_metric(self, registry: CollectorRegistry) -> None:
        """Two queues in one registry: one family each, one series per queue, and the
        exposition names every family once."""
        a, b = envq.Queue("a"), envq.Queue("b")
        ma = envq.prometheus_metrics(a, registry)
        mb = envq.prometheus_metrics(b, registry)
        text = generate_latest(registry).decode()
        assert text.count("# TYPE workqueue_depth gauge") == 1
        fams = families(text)
        assert [s.labels["name"] for s in fams["workqueue_depth"].samples] == ["a", "b"]
        ma.close()
        fams = scrape_registry(registry)
        assert [s.labels["name"] for s in fams["workqueue_depth"].samples] == ["b"]
        mb.close()
        assert scrape_registry(registry) == {}

    def test_same_name_twice_is_refused(self, registry: CollectorRegistry) -> None:
        """Queue names label the series, so a registry exports each name once."""
        envq.prometheus_metrics(envq.Queue("dup"), registry)
        with pytest.raises(ValueError, match="already exported"):
            envq.prometheus_metrics(envq.Queue("dup"), registry)

    def test_clash_with_an_existing_metric_is_refused(self, registry: CollectorRegistry) -> None:
        """A registry already holding a workqueue metric refuses envq's collector."""
        Gauge("workqueue_depth", "someone else's", registry=registry)
        q = envq.Queue("c")
        with pytest.raises(ValueError, match="workqueue_depth"):
            envq.prometheus_metrics(q, registry)
        with envq.prometheus_metrics(q, CollectorRegistry()):  # the queue is still usable
            pass

    async def test_close_unsubscribes(self, registry: CollectorRegistry) -> None:
        """After close() the listener no longer sees the queue's events; close is
        idempotent and a context manager closes too."""
        q = envq.Queue("closing")
        with envq.prometheus_metrics(q, registry) as export:
            assert not export.closed
            assert "closing" in repr(export)
        assert export.closed
        export.close()
        source = export._source
        q.start()
        q.send(job(1, 0))
        await asyncio.sleep(1)
        assert source.adds == 0
        await q.terminate()

    def test_default_registry_is_the_global_one(self) -> None:
        """Without a registry the export goes to prometheus_client.REGISTRY, and close()
        leaves it as it was."""
        with envq.prometheus_metrics(envq.Queue("global_q")):
            assert REGISTRY.get_sample_value("envq_capacity_limit", {"name": "global_q"}) == 0
        assert REGISTRY.get_sample_value("envq_capacity_limit", {"name": "global_q"}) is None


class TestHttp:
    @pytest.mark.real_clock
    async def test_scrape_over_http_on_a_real_loop(self, registry: CollectorRegistry) -> None:
        """The endpoint serves on 127.0.0.1; a real HTTP client reads the metrics of a
        workload running on a real loop, scraped while attempts are in flight."""
        q = envq.Queue("web", workers=2)
        gate = asyncio.Event()

        async def held(env: envq.Envelope) -> None:
            await gate.wait()

        with (
            envq.prometheus_metrics(q, registry),
            envq.serve_metrics(0, registry=registry) as server,
        ):
            assert server.host == "127.0.0.1"
            assert server.port > 0
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            q.start()
            q.send(*(envq.Envelope(invoke=held, id=i) for i in range(5)))
            await asyncio.sleep(0.05)
            fams = families(await asyncio.to_thread(http_get, server.url))
            assert value(fams, "workqueue_adds_total", name="web") == 5
            assert value(fams, "workqueue_depth", name="web") == 3
            assert value(fams, "envq_in_flight", name="web") == 2
            assert value(fams, "workqueue_longest_running_processor_seconds", name="web") > 0
            unfinished = value(fams, "workqueue_unfinished_work_seconds", name="web")
            longest = value(fams, "workqueue_longest_running_processor_seconds", name="web")
            assert longest <= unfinished <= 2 * longest + 1e-9
            gate.set()
            await q.stop()
            fams = families(await asyncio.to_thread(http_get, server.url))
            assert value(fams, "workqueue_depth", name="web") == 0
            assert value(fams, "workqueue_work_duration_seconds_count", name="web") == 5
            assert value(fams, "workqueue_queue_duration_seconds_count", name="web") == 5
            assert value(fams, "envq_envelopes_ended_total", name="web", state="succeeded") == 5
            assert value(fams, "envq_queue_state", name="web", state="stopped") == 1
            for name, typ in {**WORKQUEUE, **ENVQ}.items():
                assert fams[name].type == typ
            await q.terminate()
        with pytest.raises(urllib.error.URLError):  # closed: the port is released
            await asyncio.to_thread(http_get, server.url)

    def test_served_by_prometheus_clients_own_server(
        self, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """serve_metrics() delegates to prometheus_client.start_http_server (the same
        endpoint as a plain prometheus_client program: gzip, ``name[]`` filters, TLS
        fixes) and close() stops its thread and releases the port."""
        import prometheus_client  # noqa: PLC0415

        calls: list[tuple[Any, ...]] = []
        threads: list[threading.Thread] = []
        real = prometheus_client.start_http_server

        def spy(port: int, addr: str = "0.0.0.0", registry: Any = REGISTRY) -> Any:
            calls.append((port, addr, registry))
            server, thread = real(port, addr=addr, registry=registry)
            threads.append(thread)
            return server, thread

        monkeypatch.setattr(prometheus_client, "start_http_server", spy)
        Gauge("served_gauge", "A gauge.", registry=registry).set(7)
        with envq.serve_metrics(0, registry=registry) as server:
            assert calls == [(0, "127.0.0.1", registry)]
            assert server.port > 0
            assert threads[0].is_alive()
            fams = families(http_get(server.url))
            assert fams["served_gauge"].samples[0].value == 7
            assert "closed" not in repr(server)
        assert not threads[0].is_alive()
        assert "closed" in repr(server)
        server.close()  # idempotent
        with pytest.raises(urllib.error.URLError):
            http_get(server.url)

    async def test_scrape_from_a_thread_on_virtual_time(self, registry: CollectorRegistry) -> None:
        """A scrape from the server's thread reads the queue on the queue's loop."""
        q = envq.Queue("virt", workers=1)
        envq.prometheus_metrics(q, registry)
        q.start()
        q.send(job(1, 2), job(2, 2))
        await asyncio.sleep(1)
        with envq.serve_metrics(registry=registry) as server:
            fams = families(await asyncio.to_thread(http_get, server.url))
        assert value(fams, "workqueue_adds_total", name="virt") == 2
        assert value(fams, "workqueue_depth", name="virt") == 1
        assert value(fams, "envq_in_flight", name="virt") == 1
        await q.terminate()

    @pytest.mark.real_clock
    async def test_a_blocked_loop_serves_the_last_snapshot(
        self, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """When the queue's loop does not answer in time, the scrape gets the last
        snapshot instead of hanging."""
        monkeypatch.setattr(_metrics, "SCRAPE_TIMEOUT", 0.2)
        q = envq.Queue("blocked", workers=1)
        envq.prometheus_metrics(q, registry)
        q.start()
        scraped = threading.Event()
        result: list[dict[str, Metric]] = []

        def scrape_in_thread() -> None:
            result.append(scrape_registry(registry))
            scraped.set()

        async def block_the_loop(env: envq.Envelope) -> None:
            threading.Thread(target=scrape_in_thread).start()
            # Blocks the loop itself (a bug in user code): only the fallback can answer.
            assert scraped.wait(10)

        scrape_registry(registry)  # a first snapshot, taken on the loop
        started = time.monotonic()
        q.send(envq.Envelope(invoke=block_the_loop))
        await asyncio.sleep(0.05)
        assert scraped.is_set()
        assert time.monotonic() - started < 5
        # The last snapshot was taken before the send.
        assert value(result[0], "workqueue_adds_total", name="blocked") == 0
        await q.terminate()
