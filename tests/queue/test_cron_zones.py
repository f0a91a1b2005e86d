"""Cron expressions that follow real time (``*`` in the minute or hour field), in every
zone of the IANA database: around every offset change of a year, ``Cron.next_fire``
gives exactly the minutes whose local time the expression names, as an independent
minute-by-minute model finds them (both passes of a repeated half hour, none of a
skipped one, in zones that move by 30 minutes or by two hours)."""

from __future__ import annotations

import datetime as dt
import functools
import zoneinfo

import pytest

import envq

pytest.importorskip("cronsim")

#: Expressions that follow real time, with minute and hour steps and lists.
EXPRS = ("0 */2 * * *", "30 * * * *", "*/20 * * * *", "15,45 */3 * * *")
#: Minutes either side of each change (a change moves the clock by up to two hours).
AROUND = 3 * 60
YEAR = 2026


def _values(field: str, top: int) -> frozenset[int]:
    """The values of one cron field of the forms used here: ``*``, ``*/n``, a list of
    numbers. Written apart from cronsim, as the model must be."""
    if field == "*":
        return frozenset(range(top))
    if field.startswith("*/"):
        return frozenset(range(0, top, int(field[2:])))
    return frozenset(int(part) for part in field.split(","))


@functools.cache
def _model(expr: str) -> tuple[frozenset[int], frozenset[int]]:
    minute, hour, *rest = expr.split()
    assert rest == ["*", "*", "*"]
    return _values(minute, 60), _values(hour, 24)


def _model_fires(expr: str, tz: dt.tzinfo, start: int, end: int) -> list[int]:
    """Every whole minute in [start, end) whose local wall time the expression names."""
    minutes, hours = _model(expr)
    fires = []
    for t in range(start, end, 60):
        local = dt.datetime.fromtimestamp(t, tz)
        if local.minute in minutes and local.hour in hours:
            fires.append(t)
    return fires


def _cron_fires(cron: envq.Cron, start: int, end: int) -> list[int]:
    fires = []
    t = cron.next_fire(start - 1)
    while t < end:
        fires.append(int(t))
        t = cron.next_fire(t)
    return fires


def _offset(tz: dt.tzinfo, t: int) -> dt.timedelta | None:
    return dt.datetime.fromtimestamp(t, tz).utcoffset()


def _changes(tz: dt.tzinfo) -> list[int]:
    """The instants of the year at which the zone's offset changes (looked for a day
    at a time, then to the second)."""
    t = int(dt.datetime(YEAR, 1, 1, tzinfo=dt.UTC).timestamp())
    end = int(dt.datetime(YEAR + 1, 1, 1, tzinfo=dt.UTC).timestamp())
    changes = []
    while t < end:
        nxt = t + 86_400
        if _offset(tz, nxt) != _offset(tz, t):
            low, high = t, nxt
            while high - low > 1:
                middle = (low + high) // 2
                if _offset(tz, middle) == _offset(tz, t):
                    low = middle
                else:
                    high = middle
            changes.append(high)
        t = nxt
    return changes


def test_every_zone_follows_real_time_around_every_change() -> None:
    zones = sorted(zoneinfo.available_timezones())
    assert len(zones) > 300
    checked = 0
    wrong: list[str] = []
    for name in zones:
        tz = zoneinfo.ZoneInfo(name)
        for change in _changes(tz):
            start = (change // 60 - AROUND) * 60
            end = start + 2 * AROUND * 60
            for expr in EXPRS:
                want = _model_fires(expr, tz, start, end)
                got = _cron_fires(envq.Cron(expr, tz=name), start, end)
                checked += 1
                if got != want:
                    show = [
                        dt.datetime.fromtimestamp(t, tz).isoformat() for t in set(got) ^ set(want)
                    ]
                    wrong.append(f"{name} {expr!r} near {change}: differ at {show[:4]}")
    assert checked > 500  # every zone with daylight saving, four expressions each
    assert wrong == [], "\n".join(wrong[:20])


@pytest.mark.parametrize(
    ("expr", "start", "want"),
    [
        # 2026-04-05: 02:00 +11:00 becomes 01:30 +10:30.
        (
            "0 */2 * * *",
            dt.datetime(2026, 4, 4, 23, 0),
            ["00:00+11:00", "02:00+10:30", "04:00+10:30"],
        ),
        (
            "30 * * * *",
            dt.datetime(2026, 4, 5, 0, 0),
            ["00:30+11:00", "01:30+11:00", "01:30+10:30"],
        ),
        # 2026-10-04: 02:00 +10:30 becomes 02:30 +11:00.
        (
            "30 * * * *",
            dt.datetime(2026, 10, 4, 0, 0),
            ["00:30+10:30", "01:30+10:30", "02:30+11:00"],
        ),
    ],
)
def test_lord_howe_half_hour_changes(expr: str, start: dt.datetime, want: list[str]) -> None:
    tz = zoneinfo.ZoneInfo("Australia/Lord_Howe")
    cron = envq.Cron(expr, tz="Australia/Lord_Howe")
    t = start.replace(tzinfo=tz).timestamp()
    got = []
    for _ in want:
        t = cron.next_fire(t)
        got.append(dt.datetime.fromtimestamp(t, tz).isoformat(timespec="minutes")[11:])
    assert got == want
