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
    # t = 0, then about once a minute (failures 60, 120, 180 in a row)
    assert 3 <= len(logged) <= 4, [r.getMessage() for r in logged]
    assert "60 in a row" in logged[1].getMessage()
    await q.terminate()


async def test_every_failure_of_a_slow_job_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="envq")
    q = envq.Queue("slow")
    q.start()
    q.send(envq.Envelope(invoke=broken, interval=120))
    await asyncio.sleep(500)
    assert len(failures(caplog)) == 5  # t = 0, 120, 240, 360, 480
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
