"""Periodic schedules on a PostgreSQL queue: calendar (cron) envelopes stored in their
row and timed on the database's clock, and FIXED_RATE runs kept on the grid of their
scheduled starts whatever node runs them and however late they are claimed.

Real clock, on a real server: the margins are generous (a run is due when a keeper
moves it, every ``poll`` seconds).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
import uuid
import zoneinfo
from pathlib import Path

import pytest

import envq
from envq.postgres._codec import decode, encode
from envq.postgres._queue import PgQueue
from envq.postgres.driver import invoke

pytestmark = pytest.mark.real_clock

#: Wall-clock start times of the runs of ``record`` and ``slow_first``.
RUNS: list[float] = []


def record(env: envq.Envelope) -> None:
    """Note when this run began."""
    RUNS.append(time.time())


async def slow_first(env: envq.Envelope) -> None:
    """Note when this run began; the first run takes 1.5 s."""
    RUNS.append(time.time())
    if len(RUNS) == 1:
        await asyncio.sleep(1.5)


def _name() -> str:
    return f"sched-{uuid.uuid4().hex[:10]}"


async def _runs(count: int, within: float) -> list[float]:
    """Wait (at most ``within`` s) until ``count`` runs were recorded."""
    for _ in range(int(within / 0.02)):
        if len(RUNS) >= count:
            break
        await asyncio.sleep(0.02)
    assert len(RUNS) >= count, RUNS
    return RUNS[:count]


async def _row(q: PgQueue) -> dict[str, object]:
    found = await q._db().fetchrow(
        "SELECT state::text, due_at, cron, cron_tz FROM envq.envelopes WHERE queue = $1",
        q.name,
    )
    assert found is not None
    return dict(found)


# -- calendars -----------------------------------------------------------------------


async def test_a_cron_envelope_runs_at_its_fires(pg_dsn: str) -> None:
    RUNS.clear()
    env = envq.Envelope(invoke=record, id="tick", schedule=envq.Cron("* * * * * *"))
    async with PgQueue(pg_dsn, _name(), workers=1, poll=0.05) as q:
        await q.start()
        sent = time.time()
        assert await q.send(env) == 1
        runs = await _runs(3, within=6.0)
        await q.terminate()
    # The first run is the first fire at or after the send; each run follows a whole
    # second closely, and no second runs twice.
    assert runs[0] >= math.ceil(sent) - 0.01
    for at in runs:
        assert at - math.floor(at + 0.01) < 0.6, runs
    seconds = [math.floor(at + 0.01) for at in runs]
    assert seconds == sorted(set(seconds)), runs


async def test_a_cron_envelope_is_stored_by_expression_and_zone(pg_dsn: str) -> None:
    cron = envq.Cron("0 0 3 * * *", tz="Europe/Berlin")
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.start()
        now = time.time()
        await q.send(envq.Envelope(invoke=invoke, id="daily", schedule=cron))
        row = await _row(q)
        assert (row["state"], row["cron"], row["cron_tz"]) == (
            "delayed",
            "0 0 3 * * *",
            "Europe/Berlin",
        )
        # Due at the first fire after the send: 03:00:00 Berlin time.
        due = row["due_at"]
        assert isinstance(due, dt.datetime)
        assert abs(due.timestamp() - cron.first_fire(now)) < 0.2
        fetched = await q._db().fetchrow("SELECT * FROM envq.envelopes WHERE queue = $1", q.name)
        assert decode(fetched).schedule == cron
        await q.terminate()


async def test_a_restart_waits_for_the_first_fire_after_it(pg_dsn: str) -> None:
    cron = envq.Cron("0 0 3 * * *")
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="daily", schedule=cron))
        await q.stop()
        assert (await _row(q))["state"] == "parked"
        await asyncio.sleep(1.0)
        started = time.time()
        await q.start()
        row = await _row(q)
        assert row["state"] == "delayed"
        due = row["due_at"]
        assert isinstance(due, dt.datetime)
        # On the fire itself, not the wait left at the stop measured from the start.
        assert abs(due.timestamp() - cron.first_fire(started)) < 0.2
        await q.terminate()


async def test_a_buffered_cron_envelope_is_armed_by_the_start(pg_dsn: str) -> None:
    cron = envq.Cron("0 0 3 * * *")
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.send(envq.Envelope(invoke=invoke, id="daily", schedule=cron, delay=1.0))
        assert (await _row(q))["state"] == "buffered"
        await asyncio.sleep(0.3)
        started = time.time()
        await q.start()
        row = await _row(q)
        assert row["state"] == "delayed"
        due = row["due_at"]
        assert isinstance(due, dt.datetime)
        assert abs(due.timestamp() - cron.first_fire(started + 1.0)) < 0.2
        await q.terminate()


async def test_a_restarted_cron_envelope_skips_the_fires_missed_while_stopped(
    pg_dsn: str,
) -> None:
    RUNS.clear()
    env = envq.Envelope(invoke=record, id="tick", schedule=envq.Cron("* * * * * *"))
    async with PgQueue(pg_dsn, _name(), workers=1, poll=0.05) as q:
        await q.start()
        await q.send(env)
        await _runs(1, within=3.0)
        await q.stop()
        stopped = len(RUNS)
        await asyncio.sleep(1.5)
        restarted = time.time()
        await q.start()
        runs = await _runs(stopped + 1, within=3.0)
        await q.terminate()
    after = runs[stopped]
    # No burst for the fires missed: the next run is the first fire at or after the
    # restart.
    assert after >= math.ceil(restarted) - 0.01, (restarted, runs)
    assert after - math.floor(after + 0.01) < 0.6, runs


class _Weekly:
    """A schedule another process cannot rebuild."""

    def first_run(self, at: float, offset: float) -> float:
        return at

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        return ended + 7 * 86400


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        (_Weekly(), ("schedule=", "envq.Cron")),
        (
            envq.Cron("0 3 * * *", tz=dt.timezone(dt.timedelta(hours=2))),
            ("schedule=", "tz=", "IANA"),
        ),
    ],
    ids=["another-timing", "zone-without-a-name"],
)
async def test_a_schedule_that_cannot_cross_is_refused_at_send(
    pg_dsn: str, schedule: object, words: tuple[str, ...]
) -> None:
    env = envq.Envelope(invoke=invoke, id="x", schedule=schedule)  # type: ignore[arg-type]
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="kept"))
        with pytest.raises(envq.BadEnvelopeType) as caught:
            await q.send(envq.Envelope(invoke=invoke, id="ok"), env)
        for word in words:
            assert word in str(caught.value)
        # All or none: the good envelope of the batch was not admitted, the one
        # admitted before is still there.
        assert await q.counts() == {"ready": 1}
        await q.terminate()


def test_a_zone_read_from_a_file_has_no_name_to_cross() -> None:
    path = Path(zoneinfo.TZPATH[0]) / "Europe" / "Berlin" if zoneinfo.TZPATH else None
    if path is None or not path.exists():
        pytest.skip("no time zone files on this machine")
    with path.open("rb") as file:
        zone = zoneinfo.ZoneInfo.from_file(file)
    env = envq.Envelope(invoke=invoke, schedule=envq.Cron("0 3 * * *", tz=zone))
    with pytest.raises(envq.BadEnvelopeType, match=r"schedule=.*tz=.*IANA"):
        encode(env, "send()")


# -- the FIXED_RATE grid -------------------------------------------------------------


async def test_fixed_rate_runs_stay_on_the_grid_after_a_late_claim(pg_dsn: str) -> None:
    """The first run is claimed 0.6 s late (no node serves yet) and takes 1.5 s; the
    next runs fall on the grid of the scheduled start, not of the claim."""
    RUNS.clear()
    name = _name()
    env = envq.Envelope(
        invoke=slow_first, id="rate", interval=1.0, delay=0.2, schedule=envq.FIXED_RATE
    )
    async with PgQueue(pg_dsn, name, workers=0) as producer:
        await producer.start()
        await producer.send(env)
        due = (await _row(producer))["due_at"]
        assert isinstance(due, dt.datetime)
        origin = due.timestamp()
        await asyncio.sleep(max(0.0, origin + 0.6 - time.time()))
        async with PgQueue(pg_dsn, name, workers=1, poll=0.05) as node:
            await node.start()
            runs = await _runs(3, within=8.0)
            await producer.terminate()
    first, second, third = (at - origin for at in runs)
    assert first >= 0.55, runs
    # It ended about 2.1 s after its scheduled start: the next grid point is 3 s, then 4 s.
    assert 3.0 - 0.01 <= second < 3.6, (first, second, third)
    assert 4.0 - 0.01 <= third < 4.6, (first, second, third)


async def test_the_next_fixed_rate_point_is_computed_by_the_database(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        db = q._db()
        base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

        async def next_due(schedule: str, every: float, ended: float) -> float:
            found = await db.fetchval(
                "SELECT envq.next_due($1::envq.schedule, $2, $3, $4)",
                schedule,
                every,
                base,
                base + dt.timedelta(seconds=ended),
            )
            return float((found - base).total_seconds())

        assert await next_due("fixed_rate", 1.0, 0.5) == 1.0
        assert await next_due("fixed_rate", 1.0, 1.0) == 2.0  # strictly after the end
        assert await next_due("fixed_rate", 1.0, 7.25) == 8.0
        assert await next_due("fixed_rate", 0.1, 0.3) == pytest.approx(0.4, abs=2e-6)
        assert await next_due("fixed_delay", 1.0, 7.25) == 8.25


@pytest.mark.one_python
async def test_the_databases_grid_is_the_engines_for_every_input_class(pg_dsn: str) -> None:
    """``envq.next_due`` (PL/pgSQL) and ``envq._schedule.fixed_rate_slot`` (the engine's)
    pick the same grid point — the first strictly after the end — for every class of
    input: an end inside a slot, a microsecond either side of a grid point, before the
    first point, long overdue (up to a million slots, thirty years), the shortest
    interval, intervals with no exact float (0.1 s, 1/3 s), a day, random ones. The
    database keeps microseconds, the engine floats: at an end exactly on a grid point
    (to the microsecond) the database takes the next point, and the engine that one or
    the point itself when its float product lands a hair past the end (0.1 × 3 is
    0.30000000000000004): the one place the two clocks' resolutions differ."""
    import random  # noqa: PLC0415

    from envq._schedule import MIN_INTERVAL, fixed_rate_slot  # noqa: PLC0415

    rng = random.Random(20261128)
    intervals_us = [1, 7, 1_000, 100_000, 333_333, 1_000_000, 2_500_000, 86_400_000_000]
    intervals_us += [rng.randrange(1, 10**10) for _ in range(40)]
    cases: list[tuple[int, int]] = []  # (interval µs, end µs after the scheduled start)
    for every in intervals_us:
        for k in (0, 1, 2, 3, 17, 1_000_000, rng.randrange(1, 10**6)):
            point = k * every
            if point > 10**15:  # over 30 years of grid: past a float's microseconds
                continue
            cases += [(every, point + d) for d in (-1, 0, 1) if point + d >= 0]
            cases.append((every, point + rng.randrange(every)))
    assert MIN_INTERVAL == 1e-6  # intervals_us starts at the shortest
    base = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        rows = await q._db().fetch(
            "SELECT i, envq.next_due('fixed_rate'::envq.schedule, e / 1e6, $1::timestamptz,"
            " $1::timestamptz + x * interval '1 microsecond')"
            " AS due FROM unnest($2::float8[], $3::bigint[]) WITH ORDINALITY AS t(e, x, i)"
            " ORDER BY i",
            base,
            [every for every, _ in cases],
            [end for _, end in cases],
        )
    ties = 0
    for (every, end), row in zip(cases, rows, strict=True):
        due_us = round((row["due"] - base) / dt.timedelta(microseconds=1))
        assert due_us > end, (every, end, due_us)  # strictly after the end
        assert due_us % every == 0, (every, end, due_us)  # on the grid
        n_db = due_us // every
        n_engine = fixed_rate_slot(0.0, every / 1e6, end / 1e6)
        if end % every == 0 and end > 0:  # an end on a grid point, to the microsecond
            ties += 1
            assert n_db == end // every + 1, (every, end)
            assert n_engine in (end // every, end // every + 1), (every, end, n_engine)
        else:
            assert n_engine == n_db, (every, end, n_engine, n_db)
    assert ties > 100  # the boundary class was drawn


@pytest.mark.parametrize(
    "schedule",
    [envq.FIXED_RATE, envq.Cron("0 0 3 * * *")],
    ids=["fixed-rate", "cron"],
)
async def test_a_reaped_run_is_rescheduled_on_its_schedule(
    pg_dsn: str, schedule: envq.Timing
) -> None:
    """An attempt whose lease expired on another node is reaped and the envelope goes
    on with its schedule: the next grid point or fire, not the reap's time plus the
    interval."""
    interval = 10.0 if schedule is envq.FIXED_RATE else 0.0
    env = envq.Envelope(invoke=invoke, id="p", interval=interval, schedule=schedule)
    name = _name()
    async with PgQueue(pg_dsn, name, workers=0) as producer:
        db = producer._db()
        await producer.start()
        await producer.send(env)
        row = await _row(producer)
        due = row["due_at"]
        assert isinstance(due, dt.datetime)
        scheduled = due.timestamp()
        if row["state"] == "delayed":  # a calendar: make its fire due now
            await db.execute(
                "UPDATE envq.envelopes SET state = 'ready', event = 'due' WHERE queue = $1",
                name,
            )
        claimed = await db.fetch(
            "SELECT * FROM envq.claim($1, 'elsewhere', 1, interval '0.2 seconds')", name
        )
        assert len(claimed) == 1
        async with PgQueue(pg_dsn, name, workers=1, poll=0.05) as reaper:
            await reaper.start()
            for _ in range(150):
                if (await _row(producer))["state"] == "delayed":
                    break
                await asyncio.sleep(0.02)
            row = await _row(producer)
            await producer.terminate()
    assert row["state"] == "delayed"
    due = row["due_at"]
    assert isinstance(due, dt.datetime)
    if isinstance(schedule, envq.Cron):
        expected = schedule.next_fire(scheduled)
    else:
        expected = scheduled + interval
    assert abs(due.timestamp() - expected) < 0.05, (due.timestamp() - scheduled, expected)
