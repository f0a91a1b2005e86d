"""Calendar schedules: ``envq.Cron`` over virtual time, across daylight-saving changes,
stops and failures, and the ``Timing`` protocol every schedule satisfies."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import sys
import zoneinfo
from collections.abc import Awaitable, Callable

import pytest

import envq
from envq import EnvState, Outcome
from envq.testing import run

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
HOUR = 3600.0
DAY = 86_400.0


def berlin(*args: int, fold: int = 0) -> dt.datetime:
    return dt.datetime(*args, tzinfo=BERLIN, fold=fold)  # type: ignore[misc]


def wall() -> float:
    return asyncio.get_running_loop().wall_time()  # type: ignore[attr-defined,no-any-return]


def local(ts: float) -> dt.datetime:
    """A wall time as Berlin time, to the second."""
    return dt.datetime.fromtimestamp(round(ts), BERLIN)


class Runs:
    """An invoke that notes the Berlin time of each start."""

    def __init__(self, seconds: float = 0.0, error: BaseException | None = None) -> None:
        self.starts: list[dt.datetime] = []
        self.seconds = seconds
        self.error = error

    async def __call__(self, env: envq.Envelope) -> None:
        self.starts.append(local(wall()))
        await asyncio.sleep(self.seconds)
        if self.error is not None:
            raise self.error


def on_virtual_time(
    start: dt.datetime, body: Callable[[envq.Queue], Awaitable[None]]
) -> list[envq.Event]:
    """Run ``body`` with a started queue on a virtual loop whose wall clock starts at
    ``start``; the queue's events."""
    events: list[envq.Event] = []

    async def main() -> None:
        q = envq.Queue("cron")
        q.subscribe(events.append)
        q.start()
        try:
            await body(q)
        finally:
            await q.terminate()

    run(main(), wall_start=start.timestamp())
    return events


class TestCronValue:
    def test_fields_and_repr(self) -> None:
        """A Cron keeps its expression (blanks collapsed) and its zone."""
        c = envq.Cron("0  3 * * *", tz="Europe/Berlin")
        assert c.expr == "0 3 * * *"
        assert c.tz is BERLIN
        assert repr(c) == "Cron('0 3 * * *', tz='Europe/Berlin')"
        assert c == envq.Cron("0 3 * * *", BERLIN)
        assert hash(c) == hash(envq.Cron("0 3 * * *", BERLIN))
        assert envq.Cron("* * * * *").tz is dt.UTC

    def test_is_frozen(self) -> None:
        """A Cron is a value: its fields cannot be replaced."""
        c = envq.Cron("0 3 * * *")
        with pytest.raises(AttributeError):
            c.expr = "0 4 * * *"  # type: ignore[misc]

    @pytest.mark.parametrize("expr", ["", "0 3 * *", "61 * * * *", "0 3 31 2 *", "x y z w v"])
    def test_a_bad_expression_is_a_value_error(self, expr: str) -> None:
        """An expression cronsim cannot read raises ValueError naming it."""
        with pytest.raises(ValueError, match=r"Cron: expr .*" + re.escape(repr(expr))):
            envq.Cron(expr)

    def test_a_bad_zone_is_a_value_error(self) -> None:
        """An unknown time zone raises ValueError naming it."""
        with pytest.raises(ValueError, match=r"Cron: tz .*'Mars/Olympus'"):
            envq.Cron("0 3 * * *", tz="Mars/Olympus")

    @pytest.mark.parametrize("source", ["tzdata", "system"])
    def test_zones_found_both_ways_and_a_folder_is_a_value_error(
        self, source: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A zone is found in the tzdata package (Windows, or beside python-dateutil) or
        in the system's database; either way a folder of the database ("Europe") is a
        ValueError naming tz, not IsADirectoryError."""
        system = "/usr/share/zoneinfo"
        if source == "tzdata":
            pytest.importorskip("tzdata")
            paths: list[str] = []
        else:
            if not os.path.isfile(os.path.join(system, "Europe", "Berlin")):
                pytest.skip("no system zone database here")
            paths = [system]
            monkeypatch.setitem(sys.modules, "tzdata", None)  # the system's, or nothing
        zoneinfo.reset_tzpath(to=paths)
        zoneinfo.ZoneInfo.clear_cache()
        try:
            cron = envq.Cron("0 3 * * *", tz="Europe/Berlin")
            assert str(cron.tz) == "Europe/Berlin"
            for folder in ("Europe", "America/Argentina"):
                with pytest.raises(ValueError, match=r"Cron: tz .*" + re.escape(repr(folder))):
                    envq.Cron("0 3 * * *", tz=folder)
        finally:
            zoneinfo.reset_tzpath()
            zoneinfo.ZoneInfo.clear_cache()

    @pytest.mark.parametrize(("expr", "tz"), [(3, "UTC"), (b"* * * * *", "UTC"), ("* * * * *", 1)])
    def test_wrong_types_are_type_errors(self, expr: object, tz: object) -> None:
        """A non-str expression or a zone that is neither a str nor a tzinfo: TypeError."""
        with pytest.raises(TypeError, match=r"Cron: (expr|tz)"):
            envq.Cron(expr, tz=tz)  # type: ignore[arg-type]

    def test_without_cronsim_the_error_names_the_extra(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Without the cronsim package, Cron says which extra to install."""
        monkeypatch.setitem(sys.modules, "cronsim", None)
        with pytest.raises(ModuleNotFoundError, match=r"envq\[cron\]"):
            envq.Cron("0 3 * * *")


class TestCronEnvelope:
    def test_a_cron_envelope_is_periodic(self) -> None:
        """An envelope on a Cron schedule is periodic with no interval."""
        env = envq.Envelope(invoke=print, schedule=envq.Cron("0 3 * * *"))
        assert env.periodic
        assert env.interval == 0
        assert "Cron('0 3 * * *'" in repr(env)

    def test_an_interval_with_a_calendar_is_refused(self) -> None:
        """A calendar schedule sets the times: an interval beside it is a BadEnvelope."""
        with pytest.raises(envq.BadEnvelope, match=r"interval must be 0.*got 60\.0"):
            envq.Envelope(invoke=print, interval=60, schedule=envq.Cron("0 3 * * *"))

    def test_a_schedule_must_be_a_timing(self) -> None:
        """A schedule that is not a Timing is a BadEnvelopeType naming it."""
        with pytest.raises(envq.BadEnvelopeType, match=r"schedule.*'0 3 \* \* \*'"):
            envq.Envelope(invoke=print, schedule="0 3 * * *")  # type: ignore[arg-type]

    def test_every_schedule_is_a_timing(self) -> None:
        """FIXED_DELAY, FIXED_RATE and Cron all satisfy the Timing protocol."""
        for schedule in (envq.FIXED_DELAY, envq.FIXED_RATE, envq.Cron("* * * * *")):
            assert isinstance(schedule, envq.Timing)


class TestCronFires:
    def test_next_fire_is_strictly_after(self) -> None:
        """next_fire is the first fire strictly after the time given; first_fire the
        first at or after it."""
        c = envq.Cron("0 3 * * *", tz="Europe/Berlin")
        three = berlin(2026, 6, 1, 3).timestamp()
        assert c.next_fire(three) == berlin(2026, 6, 2, 3).timestamp()
        assert c.next_fire(three - 0.5) == three
        assert c.first_fire(three) == three
        assert c.first_fire(three + 0.5) == berlin(2026, 6, 2, 3).timestamp()

    def test_the_spring_gap_runs_when_the_clocks_have_jumped(self) -> None:
        """02:30 does not exist in Berlin on 29 March 2026: that day it fires at 03:00."""
        c = envq.Cron("30 2 * * *", tz="Europe/Berlin")
        t = berlin(2026, 3, 27, 12).timestamp()
        fires = []
        for _ in range(3):
            t = c.next_fire(t)
            fires.append(dt.datetime.fromtimestamp(t, BERLIN))
        assert fires == [
            berlin(2026, 3, 28, 2, 30),
            berlin(2026, 3, 29, 3),
            berlin(2026, 3, 30, 2, 30),
        ]

    def test_the_autumn_repeat_fires_once(self) -> None:
        """02:30 happens twice in Berlin on 25 October 2026: it fires at the first,
        also when asked during the second pass."""
        c = envq.Cron("30 2 * * *", tz="Europe/Berlin")
        first = berlin(2026, 10, 25, 2, 30).timestamp()
        assert c.next_fire(berlin(2026, 10, 25, 1).timestamp()) == first
        assert c.next_fire(first) == berlin(2026, 10, 26, 2, 30).timestamp()
        second_pass = berlin(2026, 10, 25, 2, 10, fold=1).timestamp()
        assert c.next_fire(second_pass) == berlin(2026, 10, 26, 2, 30).timestamp()


class TestCronOnVirtualTime:
    def test_daily_at_three_in_berlin_across_the_spring_change(self) -> None:
        """Every day at 03:00 Berlin time, before and after the clocks go forward: the
        UTC time moves by an hour, the local time does not drift."""
        runs = Runs()

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("0 3 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(8 * DAY)

        on_virtual_time(berlin(2026, 3, 25, 12), body)
        assert runs.starts == [berlin(2026, 3, d, 3) for d in range(26, 32)] + [
            berlin(2026, 4, 1, 3),
            berlin(2026, 4, 2, 3),
        ]
        utc = [s.astimezone(dt.UTC).hour for s in runs.starts]
        assert utc == [2, 2, 2, 1, 1, 1, 1, 1]

    def test_a_job_in_the_spring_gap_and_the_autumn_repeat(self) -> None:
        """A 02:30 job runs at 03:00 on the day 02:30 is skipped, and once on the day
        it is repeated, over seven months of virtual time."""
        runs = Runs()

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("30 2 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(214 * DAY)

        on_virtual_time(berlin(2026, 3, 28, 0), body)
        assert runs.starts[:3] == [
            berlin(2026, 3, 28, 2, 30),
            berlin(2026, 3, 29, 3),
            berlin(2026, 3, 30, 2, 30),
        ]
        autumn = [s for s in runs.starts if s.month == 10 and 24 <= s.day <= 26]
        assert autumn == [
            berlin(2026, 10, 24, 2, 30),
            berlin(2026, 10, 25, 2, 30),
            berlin(2026, 10, 26, 2, 30),
        ]
        assert autumn[1].utcoffset() == dt.timedelta(hours=2)  # the first pass
        assert len(runs.starts) == 214  # one a day, 28 March to 27 October

    def test_a_fire_missed_while_stopped_is_skipped(self) -> None:
        """Stopped over 03:00 and restarted at 05:00, the job next runs the following
        day at 03:00: a fire missed while the queue was stopped is not made up."""
        runs = Runs()

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("0 3 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(HOUR)  # 01:00
            report = await q.stop()
            assert len(report.parked) == 1
            await asyncio.sleep(4 * HOUR)  # 05:00
            q.start()
            await asyncio.sleep(DAY)

        events = on_virtual_time(berlin(2026, 6, 1, 0), body)
        assert runs.starts == [berlin(2026, 6, 2, 3)]
        assert EnvState.PARKED in [e.to_state for e in events]

    def test_a_restart_before_the_fire_keeps_the_calendar(self) -> None:
        """Parked at 01:00 with two hours to its 03:00 fire and restarted at 02:00, the
        job runs at 03:00, not two hours after the restart."""
        runs = Runs()

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("0 3 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(HOUR)
            await q.stop()
            await asyncio.sleep(HOUR)
            q.start()
            await asyncio.sleep(DAY + 2 * HOUR)

        on_virtual_time(berlin(2026, 6, 1, 0), body)
        assert runs.starts == [berlin(2026, 6, 1, 3), berlin(2026, 6, 2, 3)]

    def test_sent_before_start_waits_for_the_first_fire(self) -> None:
        """An envelope buffered before the first start runs at the first fire after
        the start, and a delay pushes the first run to the first fire after it."""
        runs, later = Runs(), Runs()

        async def main() -> None:
            q = envq.Queue("cron")
            cron = envq.Cron("0 * * * *")
            q.send(envq.Envelope(invoke=runs, schedule=cron))
            q.send(envq.Envelope(invoke=later, schedule=cron, delay=2 * HOUR))
            await asyncio.sleep(30 * 60)
            q.start()
            await asyncio.sleep(3.5 * HOUR)
            await q.terminate()

        run(main(), wall_start=berlin(2026, 6, 1, 0, 10).timestamp())
        assert runs.starts == [berlin(2026, 6, 1, h) for h in (1, 2, 3, 4)]
        assert later.starts == [berlin(2026, 6, 1, h) for h in (3, 4)]

    def test_an_attempt_overrunning_a_fire_skips_it(self) -> None:
        """A per-minute job whose attempt takes 90 s runs every other minute."""
        runs = Runs(seconds=90)

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("* * * * *")))
            await asyncio.sleep(6 * 60 + 30)

        on_virtual_time(berlin(2026, 6, 1, 0, 0, 30), body)
        assert [s.minute for s in runs.starts] == [1, 3, 5]

    def test_a_failure_runs_again_at_the_next_fire(self) -> None:
        """A failed cron attempt without on_failure waits for the next fire."""
        runs = Runs(error=ValueError("boom"))

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("0 3 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(2 * DAY)

        events = on_virtual_time(berlin(2026, 6, 1, 0), body)
        assert runs.starts == [berlin(2026, 6, 1, 3), berlin(2026, 6, 2, 3)]
        ends = [(e.outcome, e.to_state) for e in events if e.outcome is not None]
        assert ends == [(Outcome.ERROR, EnvState.DELAYED)] * 2

    def test_a_retry_then_back_on_the_calendar(self) -> None:
        """on_failure's retry_after runs a cron envelope again after that delay; the
        run after the retry is back on the calendar."""
        runs = Runs()
        calls: list[int] = []

        async def flaky(env: envq.Envelope) -> None:
            await runs(env)
            if len(runs.starts) == 1:
                raise ValueError("once")

        def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
            calls.append(attempt)
            return envq.retry_after(600)

        async def body(q: envq.Queue) -> None:
            cron = envq.Cron("0 3 * * *", tz="Europe/Berlin")
            q.send(envq.Envelope(invoke=flaky, schedule=cron, on_failure=on_failure))
            await asyncio.sleep(2 * DAY)

        on_virtual_time(berlin(2026, 6, 1, 0), body)
        assert runs.starts == [
            berlin(2026, 6, 1, 3),
            berlin(2026, 6, 1, 3, 10),
            berlin(2026, 6, 2, 3),
        ]
        assert calls == [1]

    def test_a_year_of_daily_runs(self) -> None:
        """A daily job over a whole year of virtual time: 365 runs, all at 03:00."""
        runs = Runs()

        async def body(q: envq.Queue) -> None:
            q.send(envq.Envelope(invoke=runs, schedule=envq.Cron("0 3 * * *", tz="Europe/Berlin")))
            await asyncio.sleep(365 * DAY)

        on_virtual_time(berlin(2026, 1, 1, 0), body)
        assert len(runs.starts) == 365
        assert {(s.hour, s.minute) for s in runs.starts} == {(3, 0)}


class _EveryOtherHour:
    """A schedule of the user's own: the next even hour of loop time."""

    def first_run(self, at: float, offset: float) -> float:
        return -(-at // (2 * HOUR)) * 2 * HOUR

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        return (ended // (2 * HOUR) + 1) * 2 * HOUR


class TestTimingProtocol:
    def test_a_schedule_of_ones_own(self) -> None:
        """Any object with first_run and next_run is a schedule: a calendar of its own."""
        starts: list[float] = []

        async def tick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())

        async def main() -> None:
            q = envq.Queue("own")
            q.start()
            await asyncio.sleep(1)
            env = envq.Envelope(invoke=tick, schedule=_EveryOtherHour())
            assert env.periodic
            q.send(env)
            await asyncio.sleep(7 * HOUR)
            await q.terminate()

        run(main())
        assert starts == [2 * HOUR, 4 * HOUR, 6 * HOUR]

    def test_fixed_schedules_answer_the_protocol(self) -> None:
        """FIXED_DELAY's next run is ended + interval; FIXED_RATE's the first grid
        point after the attempt ended; both first runs are the arming time."""
        assert envq.FIXED_DELAY.next_run(10, 0, 0, 13, 0) == 23
        assert envq.FIXED_RATE.next_run(10, 0, 0, 13, 0) == 20
        assert envq.FIXED_RATE.next_run(1, 2.1, 2.1, 5.1, 0) == 2.1 + 4
        assert envq.FIXED_RATE.first_run(7.5, 1e9) == 7.5
