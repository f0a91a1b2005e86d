"""docs/events.md, Logging: ``envq.logging_stamp()`` logs each attempt through stdlib logging with
structured ``extra`` fields, and envq stays quiet unless the application configures
logging."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from typing import Any

import pytest

import envq
from envq import _stamps
from envq._machine import OUTCOMES, Action, Kind

FIELDS = (
    "envq_queue",
    "envq_type",
    "envq_id",
    "envq_attempt",
    "envq_outcome",
    "envq_duration",
    "envq_error",
)


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The stamp's structured fields of one record."""
    return {name: getattr(record, name) for name in FIELDS}


def stamp_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records of the stamp's default logger."""
    return [r for r in caplog.records if r.name == "envq.stamp"]


async def run(
    *envelopes: envq.Envelope, seconds: float = 30, stop_cancel_at: float | None = None
) -> envq.Queue:
    """Run ``envelopes`` on a queue ``stamped`` with a logging stamp, for ``seconds``."""
    q = envq.Queue("stamped", workers=4, stamps=[envq.logging_stamp()])
    q.start()
    q.send(*envelopes)
    if stop_cancel_at is not None:
        await asyncio.sleep(stop_cancel_at)
        await q.stop(mode=envq.StopMode.STOP, cancel=True)
    await asyncio.sleep(seconds)
    await q.terminate()
    return q


async def nap(env: envq.Envelope) -> None:
    """Sleeps ``env.payload`` seconds."""
    await asyncio.sleep(env.payload or 0)


class TestLoggingStamp:
    async def test_ok_record_has_every_field(self, caplog: pytest.LogCaptureFixture) -> None:
        """An OK attempt logs one INFO record with queue, type, id, attempt, outcome and
        its duration on the loop's (virtual) clock."""
        caplog.set_level(logging.INFO, logger="envq")
        await run(envq.Envelope(invoke=nap, id=7, type="mail", payload=1.5))
        [record] = stamp_records(caplog)
        assert record.levelno == logging.INFO
        assert extras(record) == {
            "envq_queue": "stamped",
            "envq_type": "mail",
            "envq_id": 7,
            "envq_attempt": 1,
            "envq_outcome": "ok",
            "envq_duration": 1.5,
            "envq_error": None,
        }
        assert record.getMessage() == "envelope mail/7 ok in 1.500000 s"

    async def test_retries_count_attempts(self, caplog: pytest.LogCaptureFixture) -> None:
        """Each attempt is a record; the attempt number grows and the error is named."""
        caplog.set_level(logging.INFO, logger="envq")
        calls = 0

        async def flaky(env: envq.Envelope) -> None:
            nonlocal calls
            calls += 1
            if calls < 3:
                raise ValueError(f"boom {calls}")

        retry = envq.Retry(attempts=5, base=1, jitter=False)
        await run(envq.Envelope(invoke=flaky, id=1, type="t", retry=retry))
        got = [extras(r) for r in stamp_records(caplog)]
        assert [g["envq_attempt"] for g in got] == [1, 2, 3]
        assert [g["envq_outcome"] for g in got] == ["error", "error", "ok"]
        assert got[0]["envq_error"] == "ValueError('boom 1')"
        assert "envelope t/1 error in" in stamp_records(caplog)[0].getMessage()

    @pytest.mark.parametrize(
        ("exc", "kind", "outcome"),
        [
            (envq.StopEnvelope("done"), "t", "stop"),
            (envq.StopType("gone"), "t", "stop_type"),
            (envq.StopType("gone"), "", "stop"),
            (envq.DoNotRetry("bad"), "t", "no_retry"),
            (asyncio.CancelledError(), "t", "error"),
            (TimeoutError("user's own"), "t", "error"),
        ],
    )
    async def test_outcome_of_raised_signals(
        self, caplog: pytest.LogCaptureFixture, exc: BaseException, kind: str, outcome: str
    ) -> None:
        """Control signals and user exceptions map to the outcome the queue gives them
        (a CancelledError or TimeoutError raised by user code is ERROR)."""
        caplog.set_level(logging.INFO, logger="envq")

        async def raiser(env: envq.Envelope) -> None:
            raise exc

        q = await run(envq.Envelope(invoke=raiser, type=kind))
        [record] = stamp_records(caplog)
        assert record.envq_outcome == outcome
        assert q.statistics().outcomes[envq.Outcome(outcome)] == 1

    async def test_deadline_is_timeout(self, caplog: pytest.LogCaptureFixture) -> None:
        """The envelope's deadline cutting the chain is TIMEOUT, even after a slow
        ``before`` hook (the stamp starts after it)."""
        caplog.set_level(logging.INFO, logger="envq")

        async def slow_before(env: envq.Envelope) -> None:
            await asyncio.sleep(0.4)

        await run(
            envq.Envelope(invoke=nap, id=1, payload=10, deadline=1),
            envq.Envelope(invoke=nap, id=2, payload=10, deadline=1, before=slow_before),
        )
        records = sorted(stamp_records(caplog), key=lambda r: r.envq_id)
        assert [r.envq_outcome for r in records] == ["timeout", "timeout"]
        assert [r.envq_duration for r in records] == [1.0, pytest.approx(0.6)]

    async def test_stop_cancel_is_cancelled(self, caplog: pytest.LogCaptureFixture) -> None:
        """An attempt cancelled by stop(cancel=True) is CANCELLED, deadline or not."""
        caplog.set_level(logging.INFO, logger="envq")
        await run(
            envq.Envelope(invoke=nap, id=1, payload=10),
            envq.Envelope(invoke=nap, id=2, payload=10, deadline=5),
            stop_cancel_at=1,
        )
        records = stamp_records(caplog)
        assert sorted(r.envq_outcome for r in records) == ["cancelled", "cancelled"]

    async def test_custom_logger_and_level(self, caplog: pytest.LogCaptureFixture) -> None:
        """Records go to the given logger at the given level."""
        logger = logging.getLogger("app.jobs")
        caplog.set_level(logging.DEBUG, logger="app.jobs")
        q = envq.Queue("own", stamps=[envq.logging_stamp(logger, logging.DEBUG)])
        q.start()
        q.send(envq.Envelope(invoke=nap, id=3))
        await asyncio.sleep(1)
        await q.terminate()
        [record] = [r for r in caplog.records if r.name == "app.jobs"]
        assert record.levelno == logging.DEBUG
        assert record.envq_queue == "own"

    async def test_disabled_level_logs_nothing_but_counts(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With the level disabled there is no record; attempt numbers stay right when
        it is enabled later."""
        caplog.set_level(logging.WARNING, logger="envq")
        stamp = envq.logging_stamp()
        env = envq.Envelope(invoke=nap, id=1, interval=1)
        q = envq.Queue("quiet", stamps=[stamp])
        q.start()
        q.send(env)
        await asyncio.sleep(1.5)  # runs at 0 and 1
        assert stamp_records(caplog) == []
        caplog.set_level(logging.INFO, logger="envq")
        await asyncio.sleep(1)  # runs at 2
        await q.terminate()
        [record] = stamp_records(caplog)
        assert record.envq_attempt == 3


class TestQuietByDefault:
    def test_no_handlers_and_no_output(self) -> None:
        """envq adds no log handlers, and a logged attempt prints nothing when the
        application has not configured logging (its failure is handled: on_failure)."""
        code = (
            "import asyncio, logging, envq\n"
            "assert logging.getLogger('envq').handlers == []\n"
            "assert logging.getLogger('envq.stamp').handlers == []\n"
            "async def main():\n"
            "    async def boom(env):\n"
            "        raise ValueError('x')\n"
            "    q = envq.Queue('q', stamps=[envq.logging_stamp()])\n"
            "    q.start()\n"
            "    q.send(envq.Envelope(invoke=boom, on_failure=lambda *a: None))\n"
            "    await asyncio.sleep(0.05)\n"
            "    await q.terminate()\n"
            "asyncio.run(main())\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == ""
        assert proc.stderr == ""


def test_failures_are_the_outcomes_the_tables_treat_as_failures() -> None:
    """What a stamp reports as a failure: every outcome whose one-off row decides a
    failure or reports one (EXPIRED included, though a stamp never tells it)."""
    failing = {Action.DECIDE, Action.REPORT_FAILURE}
    expected = {
        o for (k, o), row in OUTCOMES.items() if k is Kind.ONE_OFF and row.action in failing
    }
    assert expected >= {envq.Outcome.ERROR, envq.Outcome.EXPIRED}
    assert expected == _stamps.FAILURES
