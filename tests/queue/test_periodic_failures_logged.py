"""A periodic envelope whose runs fail while nothing handles the failures is logged:
WARNING with the traceback, the first failure in a row at once, then about once a
minute however short the interval."""

from __future__ import annotations

import asyncio
import logging

import pytest

import envq

S = envq.EnvState


async def broken(env: envq.Envelope) -> None:
    raise ConnectionError("no route")


async def fine(env: envq.Envelope) -> None:
    pass


def failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "envq" and r.levelno >= logging.WARNING]


async def test_a_failing_periodic_run_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="envq")
    q = envq.Queue("jobs")
    q.start()
    q.send(envq.Envelope(invoke=broken, interval=600, type="sync", id=1))
    await asyncio.sleep(1)
    logged = failures(caplog)
    assert len(logged) == 1
    record = logged[0]
    assert record.levelno == logging.WARNING
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ConnectionError)
    message = record.getMessage()
    assert "sync/1" in message
    assert "jobs" in message
    await q.terminate()


async def test_a_one_second_job_failing_for_three_minutes_logs_a_handful(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("flood")
    q.start()
    q.send(envq.Envelope(invoke=broken, interval=1, type="tick"))
    await asyncio.sleep(180.5)
    logged = failures(caplog)
    assert q.statistics().outcomes[envq.Outcome.ERROR] >= 180
    # t = 0, then once a minute of loop time (t = 60, 120, 180: failures 61, 121, 181)
    assert len(logged) == 4, [r.getMessage() for r in logged]
    assert "61 in a row" in logged[1].getMessage()
    await q.terminate()


async def test_every_failure_of_a_slow_job_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("slow")
    q.start()
    q.send(envq.Envelope(invoke=broken, interval=120))
    await asyncio.sleep(500)
    assert len(failures(caplog)) == 5  # t = 0, 120, 240, 360, 480
    await q.terminate()


async def test_a_failing_cron_job_is_logged_about_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A calendar envelope has no interval: the limit is time, not failures × interval.
    An hourly cron job failing for ten days is logged at every failure (240)."""
    pytest.importorskip("cronsim")
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("cron")
    q.start()
    q.send(envq.Envelope(invoke=broken, schedule=envq.Cron("0 * * * *")))
    await asyncio.sleep(10 * 24 * 3600 - 1)
    assert q.statistics().outcomes[envq.Outcome.ERROR] == 240
    assert len(failures(caplog)) == 240
    await q.terminate()


async def test_a_cron_job_failing_every_second_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A six-field cron job failing every second is logged as an interval of 1 s is."""
    pytest.importorskip("cronsim")
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("cron-flood")
    q.start()
    q.send(envq.Envelope(invoke=broken, schedule=envq.Cron("* * * * * *")))
    await asyncio.sleep(180.5)
    logged = failures(caplog)
    assert q.statistics().outcomes[envq.Outcome.ERROR] >= 180
    assert 3 <= len(logged) <= 4, [r.getMessage() for r in logged]
    await q.terminate()


async def test_slow_failures_are_logged_about_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """interval=1 with attempts that fail after 59 s: one failure a minute, and one
    record a minute (a count of failures × interval would log one in fifteen)."""
    caplog.set_level(logging.WARNING, logger="envq")

    async def slow_broken(env: envq.Envelope) -> None:
        await asyncio.sleep(59)
        raise ConnectionError("timed out")

    q = envq.Queue("slow-failures")
    q.start()
    q.send(envq.Envelope(invoke=slow_broken, interval=1))
    await asyncio.sleep(3 * 3600 + 30)
    assert q.statistics().outcomes[envq.Outcome.ERROR] == 180
    assert len(failures(caplog)) == 180
    await q.terminate()


async def test_a_success_starts_a_new_row_logged_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first failure after a success is logged at once, whenever the last record was."""
    caplog.set_level(logging.WARNING, logger="envq")
    runs = 0

    async def flaky(env: envq.Envelope) -> None:
        nonlocal runs
        runs += 1
        if runs != 3:
            raise ConnectionError("flaky")

    q = envq.Queue("rows")
    q.start()
    q.send(envq.Envelope(invoke=flaky, interval=1))
    await asyncio.sleep(4.5)  # fails at 0, 1; succeeds at 2; fails at 3, 4
    assert [("1 in a row" in r.getMessage()) for r in failures(caplog)] == [True, True]
    await q.terminate()


@pytest.mark.parametrize("how", ["on_failure", "listener", "log_unhandled=False"])
async def test_handled_failures_are_not_logged(how: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("handled", log_unhandled=how != "log_unhandled=False")
    kwargs = {}
    if how == "on_failure":
        kwargs["on_failure"] = lambda env, error, attempt: None
    if how == "listener":
        q.subscribe(lambda ev: None)
    q.start()
    env = envq.Envelope(invoke=broken, interval=1, **kwargs)  # type: ignore[arg-type]
    q.send(env)
    await asyncio.sleep(5)
    assert failures(caplog) == []
    await q.terminate()


async def test_succeeding_runs_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="envq")
    q = envq.Queue("quiet")
    q.start()
    q.send(envq.Envelope(invoke=fine, interval=1))
    await asyncio.sleep(100)
    assert [r for r in caplog.records if r.name == "envq"] == []
    await q.terminate()
