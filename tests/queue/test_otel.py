"""``envq.otel_stamp()``: one OpenTelemetry span per attempt, the outcome as its status
(recorded with opentelemetry-sdk's in-memory exporter)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer

import envq


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """An in-memory exporter of a tracer provider of our own (the global one is left
    alone)."""
    memory = InMemorySpanExporter()
    yield memory
    memory.clear()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> Tracer:
    """A tracer whose spans end up in ``exporter``."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("tests")


async def run(tracer: Tracer, *envelopes: envq.Envelope, cancel_at: float | None = None) -> None:
    """Run ``envelopes`` on a queue ``traced`` stamped with ``otel_stamp(tracer)``."""
    q = envq.Queue("traced", workers=4, stamps=[envq.otel_stamp(tracer)])
    q.start()
    q.send(*envelopes)
    if cancel_at is not None:
        await asyncio.sleep(cancel_at)
        await q.stop(mode=envq.StopMode.STOP, cancel=True)
    await asyncio.sleep(30)
    await q.terminate()


def attempts(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    """The attempt spans, in the order they ended."""
    return [s for s in exporter.get_finished_spans() if s.name.startswith("envq ")]


async def nap(env: envq.Envelope) -> None:
    """Sleeps ``env.payload`` seconds."""
    await asyncio.sleep(env.payload or 0)


class TestOtelStamp:
    async def test_ok_span(self, tracer: Tracer, exporter: InMemorySpanExporter) -> None:
        """An OK attempt is one INTERNAL span with status OK and envq's attributes."""
        await run(tracer, envq.Envelope(invoke=nap, id=42, type="mail"))
        [span] = attempts(exporter)
        assert span.name == "envq mail"
        assert span.kind is SpanKind.INTERNAL
        assert span.status.status_code is StatusCode.OK
        assert dict(span.attributes or {}) == {
            "envq.queue": "traced",
            "envq.envelope.type": "mail",
            "envq.envelope.id": "42",
            "envq.attempt": 1,
            "envq.outcome": "ok",
        }

    async def test_error_retried(self, tracer: Tracer, exporter: InMemorySpanExporter) -> None:
        """Each attempt is a span: failures are ERROR with the exception recorded, and
        the attempt number grows."""
        calls = 0

        async def flaky(env: envq.Envelope) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise ValueError("boom")

        retry = envq.Retry(attempts=3, base=1, jitter=False)
        await run(tracer, envq.Envelope(invoke=flaky, retry=retry))
        first, second = attempts(exporter)
        assert first.name == "envq attempt"  # no type
        assert first.status.status_code is StatusCode.ERROR
        assert first.status.description == "error: ValueError('boom')"
        assert [e.name for e in first.events] == ["exception"]
        assert (first.attributes or {})["envq.attempt"] == 1
        assert second.status.status_code is StatusCode.OK
        assert (second.attributes or {})["envq.attempt"] == 2

    @pytest.mark.parametrize(
        ("exc", "outcome", "status"),
        [
            (envq.StopEnvelope("done"), "stop", StatusCode.UNSET),
            (envq.StopType("gone"), "stop_type", StatusCode.UNSET),
            (envq.DoNotRetry("bad"), "no_retry", StatusCode.ERROR),
        ],
    )
    async def test_signals(
        self,
        tracer: Tracer,
        exporter: InMemorySpanExporter,
        exc: BaseException,
        outcome: str,
        status: StatusCode,
    ) -> None:
        """Stops are not failures (status unset); DoNotRetry is."""

        async def raiser(env: envq.Envelope) -> None:
            raise exc

        await run(tracer, envq.Envelope(invoke=raiser, type="t"))
        [span] = attempts(exporter)
        assert (span.attributes or {})["envq.outcome"] == outcome
        assert span.status.status_code is status

    async def test_timeout_and_cancel(self, tracer: Tracer, exporter: InMemorySpanExporter) -> None:
        """A deadline is TIMEOUT (an error); stop(cancel=True) is CANCELLED (unset)."""
        await run(
            tracer,
            envq.Envelope(invoke=nap, id="dl", payload=10, deadline=0.5),
            envq.Envelope(invoke=nap, id="cx", payload=10),
            cancel_at=1,
        )
        spans = {(s.attributes or {})["envq.envelope.id"]: s for s in attempts(exporter)}
        assert (spans["dl"].attributes or {})["envq.outcome"] == "timeout"
        assert spans["dl"].status.status_code is StatusCode.ERROR
        assert (spans["cx"].attributes or {})["envq.outcome"] == "cancelled"
        assert spans["cx"].status.status_code is StatusCode.UNSET

    async def test_work_spans_are_children(
        self, tracer: Tracer, exporter: InMemorySpanExporter
    ) -> None:
        """Spans the work opens are children of the attempt's span."""

        async def traced(env: envq.Envelope) -> None:
            with tracer.start_as_current_span("smtp.send"):
                await asyncio.sleep(0.1)

        await run(tracer, envq.Envelope(invoke=traced, type="mail"))
        child = next(s for s in exporter.get_finished_spans() if s.name == "smtp.send")
        [parent] = attempts(exporter)
        assert child.parent is not None
        assert parent.context is not None
        assert child.parent.span_id == parent.context.span_id

    def test_missing_api_is_a_clear_import_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without opentelemetry-api, otel_stamp() raises ImportError naming the extra."""
        monkeypatch.setitem(sys.modules, "opentelemetry", None)
        with pytest.raises(ImportError, match=r"envq\[otel\]"):
            envq.otel_stamp()

    async def test_default_tracer_is_a_no_op(self) -> None:
        """With no SDK installed globally, the default tracer records nothing and the
        attempt runs as usual."""
        q = envq.Queue("noop", stamps=[envq.otel_stamp()])
        q.start()
        q.send(envq.Envelope(invoke=nap))
        await asyncio.sleep(1)
        await q.terminate()
        assert q.statistics().outcomes[envq.Outcome.OK] == 1
