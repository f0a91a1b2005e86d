"""One behavioural test per row of the runtime tables (``envq._machine``).

``scripts/mutate.py`` changes each row of each table in turn (target, action, dropped)
and runs the behavioural tests against the mutant; every row therefore needs a test
that *observes* it: the exact path of the envelope's events (``FROM>TO/OUTCOME``), the
queue's own events, the hooks called, the time things happen, ``statistics()`` — never
the table itself. Each test says which rows it pins. The lifecycle rows are in
``test_lifecycle_rows.py``; the harness in ``rows.py``.
"""

from __future__ import annotations

import asyncio

import pytest

import envq
from envq import EnvState, Outcome
from tests.queue.rows import (
    DRAIN,
    ES,
    STOP,
    LeaseExpired,
    World,
    advance,
    reject_type,
    tell_expired,
    within,
)
from tests.support import now, settle

pytestmark = pytest.mark.usefixtures("no_internal_errors", "expired_told")


@pytest.fixture
def expired_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``"expired"`` step ends its attempt EXPIRED (``rows.tell_expired``)."""
    tell_expired(monkeypatch)


# ---------------------------------------------------------------------------------------
# OUTCOMES: every (kind, outcome) row, with hooks and a retry policy that must (not) act
# ---------------------------------------------------------------------------------------

#: The failures whose rows decide (``hang`` times out at the deadline; ``expired``
#: stands for a lease another process found expired).
FAILURES = [("error", Outcome.ERROR), ("hang", Outcome.TIMEOUT), ("expired", Outcome.EXPIRED)]
#: The error each failure step ends its attempt with, as on_failure and the events see it.
CAUSE: dict[Outcome, type[BaseException]] = {
    Outcome.ERROR: ValueError,
    Outcome.TIMEOUT: TimeoutError,
    Outcome.EXPIRED: LeaseExpired,
}
RETRY = envq.Retry(attempts=3, base=2, jitter=False)


class TestOneOffRows:
    @pytest.mark.parametrize("schedule", [envq.FIXED_DELAY, envq.FIXED_RATE])
    async def test_ok_succeeds(self, schedule: envq.Schedule) -> None:
        """(ONE_OFF, OK) SUCCEED → SUCCEEDED, on_success once (a one-off's schedule
        plays no part)."""
        w = World()
        a = w.env("a", schedule=schedule)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>SUCCEEDED/OK"]
        assert w.called() == [("success", "a")]
        assert w.by_state() == {ES.SUCCEEDED: 1}
        assert w.cause(a) is None
        assert w.outcomes() == {Outcome.OK: 1}
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_without_hook_or_policy_fails(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT|EXPIRED) DECIDE → FAILED: no decision, no policy: dropped."""
        w = World()
        a = w.env("a", step, hooks=False, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", f"RUNNING>FAILED/{outcome.name}"]
        assert w.runs("a") == [0.0]
        assert w.by_state() == {ES.FAILED: 1}
        timeout = outcome is Outcome.TIMEOUT
        assert isinstance(w.cause(a), CAUSE[outcome])
        # A timeout ends the attempt at its deadline.
        assert w.timed(a)[-1][1] == (2.0 if timeout else 0.0)
        assert w.outcomes() == {outcome: 1}
        # The failure does not blacklist the (empty) type.
        b = w.env("b", hooks=False)
        w.q.send(b)
        await w.ended(b)
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_asks_on_failure(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT|EXPIRED) DECIDE: on_failure's decisions (retry_now → READY,
        retry_after → DELAYED, drop → FAILED); attempt numbers count every attempt."""
        w = World()
        decisions = iter([envq.retry_now(), envq.retry_after(7), envq.drop()])
        a = w.env("a", step, step, step, decisions=decisions, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>READY" + end,
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t, 2 * t + 7]
        exc = CAUSE[outcome].__name__
        assert w.called() == [("failure", "a", exc, n) for n in (1, 2, 3)]
        assert w.by_state() == {ES.FAILED: 1}
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_follows_the_retry_policy(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT|EXPIRED) DECIDE without on_failure: the Retry policy
        (retry_after its backoff) until exhausted, then FAILED with MaxRetriesExceeded."""
        w = World()
        a = w.env("a", step, step, step, hooks=False, deadline=2, retry=RETRY)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t + 2, 2 * t + 6]
        assert isinstance(w.cause(a), envq.MaxRetriesExceeded)
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_retry_now_waits_for_the_limiter(
        self, step: str, outcome: Outcome
    ) -> None:
        """(ONE_OFF, ERROR|TIMEOUT|EXPIRED) limited: a retry_now the queue's failure
        limiter makes wait goes DELAYED for the limiter's delay (2 s, then 4 s)."""
        w = World(limiter=envq.ExponentialBackoff(2, 100))
        decisions = iter([envq.retry_now(), envq.retry_now()])
        a = w.env("a", step, step, decisions=decisions, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t + 2, 2 * t + 6]
        await w.q.terminate()

    async def test_no_retry_reports_and_fails(self) -> None:
        """(ONE_OFF, NO_RETRY) REPORT_FAILURE → FAILED: on_failure is told (attempt 1),
        its retry decision and the Retry policy are ignored."""
        w = World()
        a = w.env("a", "no_retry", decisions=iter([envq.retry_now()]))
        b = w.env("b", "no_retry", hooks=False, retry=RETRY)
        w.q.start()
        w.q.send(a, b)
        await w.ended(a)
        await w.ended(b)
        await advance(100)
        for env in (a, b):
            assert w.path(env) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.called() == [("failure", "a", "DoNotRetry", 1)]
        assert w.by_state() == {ES.FAILED: 2}
        assert w.outcomes() == {Outcome.NO_RETRY: 2}
        await w.q.terminate()

    async def test_stop_envelope_ends_stopped_quietly(self) -> None:
        """(ONE_OFF, STOP) END → STOPPED: no hook, no retry, the type not blacklisted."""
        w = World()
        a = w.env("a", "stop", decisions=iter([envq.retry_now()]), type="t")
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP"]
        assert w.called() == []
        b = w.env("b", type="t")
        w.q.send(b)
        await w.ended(b)
        assert w.path(b)[-1] == "RUNNING>SUCCEEDED/OK"
        assert w.by_state() == {ES.STOPPED: 1, ES.SUCCEEDED: 1}
        await w.q.terminate()

    async def test_stop_type_blacklists_and_stops(self) -> None:
        """(ONE_OFF, STOP_TYPE) BLACKLIST → STOPPED: no hook; waiting envelopes of the
        type are stopped (READY|DELAYED, BLACKLIST) and the type is refused."""
        w = World(workers=1)
        a = w.env("a", "stop_type", decisions=iter([envq.retry_now()]), type="t")
        r, d = w.env("r", type="t"), w.env("d", type="t", delay=30)
        other = w.env("o", type="u")
        w.q.start()
        w.q.send(a, r, d, other)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP_TYPE"]
        assert w.path(r) == ["NEW>READY", "READY>STOPPED"]
        assert w.path(d) == ["NEW>DELAYED", "DELAYED>STOPPED"]
        assert w.path(other)[-1] == "RUNNING>SUCCEEDED/OK"
        assert w.called() == [("success", "o")]
        reject_type(lambda: w.q.send(w.env("x", type="t")), envq.TypeBlacklisted)
        assert w.by_state() == {ES.STOPPED: 3, ES.SUCCEEDED: 1}
        await w.q.terminate()

    async def test_cancelled_by_stop_is_parked(self) -> None:
        """(ONE_OFF, CANCELLED) SHELVE, cause STOP → PARKED; no hook; runs on restart."""
        w = World()
        a = w.env("a", "hang", decisions=iter([envq.retry_now()]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(STOP, cancel=True))
        assert report.cancelled == (a,)
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/CANCELLED"]
        assert w.called() == []
        assert w.by_state() == {ES.PARKED: 1}
        w.q.start()
        await w.ended(a)
        assert w.path(a)[3:] == ["PARKED>READY", "READY>RUNNING", "RUNNING>SUCCEEDED/OK"]
        await w.q.terminate()

    async def test_cancelled_by_terminate_is_returned(self) -> None:
        """(ONE_OFF, CANCELLED) SHELVE, cause TERMINATE → RETURNED directly."""
        w = World()
        a = w.env("a", "hang", decisions=iter([envq.retry_now()]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        assert await within(w.q.terminate()) == [a]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>RETURNED/CANCELLED"]
        assert w.called() == []
        assert w.by_state() == {ES.RETURNED: 1}


class TestPeriodicRows:
    async def test_ok_reschedules_after_the_interval(self) -> None:
        """(PERIODIC, OK) RESCHEDULE → DELAYED: on_success each run, next run one
        interval after the end."""
        w = World()
        a = w.env("a", ("sleep", 1, "ok"), ("sleep", 1, "ok"), interval=10)
        w.q.start()
        w.q.send(a)
        await advance(25)
        assert w.runs("a") == [0.0, 11.0, 22.0]
        assert w.path(a)[:6] == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
        ]
        assert w.called()[:2] == [("success", "a"), ("success", "a")]
        assert w.by_state() == {ES.DELAYED: 1}
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_without_hook_waits_an_interval(
        self, step: str, outcome: Outcome
    ) -> None:
        """(PERIODIC, ERROR|TIMEOUT|EXPIRED) DECIDE_PERIODIC without on_failure → DELAYED by the
        interval."""
        w = World()
        a = w.env("a", step, step, hooks=False, interval=10, deadline=2)
        w.q.start()
        w.q.send(a)
        await advance(25)
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t + 10, 2 * t + 20]
        assert w.path(a)[:4] == [
            "NEW>READY",
            "READY>RUNNING",
            f"RUNNING>DELAYED/{outcome.name}",
            "DELAYED>READY",
        ]
        ends = w.attempt_ends(a)
        assert isinstance(ends[0].cause, CAUSE[outcome])
        # A timeout ends the attempt at its deadline; it never fails the envelope.
        assert [e.time for e in ends[:2]] == [t, 2 * t + 10]
        assert ES.FAILED not in w.by_state()
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_asks_on_failure(self, step: str, outcome: Outcome) -> None:
        """(PERIODIC, ERROR|TIMEOUT|EXPIRED) DECIDE_PERIODIC: on_failure decides; its attempt
        number counts the failures since the last success."""
        w = World()
        decisions = iter([envq.retry_now(), envq.retry_after(3), envq.drop()])
        a = w.env("a", "ok", step, step, step, decisions=decisions, interval=10, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>READY" + end,
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, 10.0, 10 + t, 10 + 2 * t + 3]
        exc = CAUSE[outcome].__name__
        assert w.called() == [("success", "a")] + [("failure", "a", exc, n) for n in (1, 2, 3)]
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_waits_at_least_the_limiter(self, step: str, outcome: Outcome) -> None:
        """(PERIODIC, ERROR|TIMEOUT|EXPIRED) limited: the next run after a failure waits
        max(interval, the failure limiter's delay): 5, 5, then 8 s."""
        w = World(limiter=envq.ExponentialBackoff(2, 100))
        a = w.env("a", step, step, step, hooks=False, interval=5, deadline=2)
        w.q.start()
        w.q.send(a)
        await advance(40)
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a")[:4] == [0.0, t + 5, 2 * t + 10, 3 * t + 18]
        await w.q.terminate()

    async def test_no_retry_reports_and_fails(self) -> None:
        """(PERIODIC, NO_RETRY) REPORT_FAILURE → FAILED: on_failure told (failures since
        the last success + 1), its decision ignored."""
        w = World()
        a = w.env("a", "ok", "no_retry", decisions=iter([envq.retry_now()]), interval=10)
        b = w.env("b", "no_retry", hooks=False, interval=10)
        w.q.start()
        w.q.send(a, b)
        await w.ended(a)
        await w.ended(b)
        await advance(100)
        assert w.path(a)[-2:] == ["READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.path(b) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.called() == [("success", "a"), ("failure", "a", "DoNotRetry", 1)]
        assert w.runs("a") == [0.0, 10.0]
        assert w.runs("b") == [0.0]
        assert w.by_state() == {ES.FAILED: 2}
        await w.q.terminate()

    async def test_stop_envelope_ends_stopped_quietly(self) -> None:
        """(PERIODIC, STOP) END → STOPPED: no hook, no next run, no blacklist."""
        w = World()
        a = w.env("a", "stop", decisions=iter([envq.retry_now()]), interval=10, type="t")
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP"]
        assert w.called() == []
        assert w.runs("a") == [0.0]
        assert w.by_state() == {ES.STOPPED: 1}
        w.q.send(w.env("b", type="t"))
        await w.q.terminate()

    async def test_stop_type_blacklists_and_stops(self) -> None:
        """(PERIODIC, STOP_TYPE) BLACKLIST → STOPPED: no hook; the type is refused."""
        w = World(workers=1)
        a = w.env("a", "stop_type", decisions=iter([envq.retry_now()]), interval=10, type="t")
        d = w.env("d", type="t", delay=30, interval=5)
        w.q.start()
        w.q.send(a, d)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP_TYPE"]
        assert w.path(d) == ["NEW>DELAYED", "DELAYED>STOPPED"]
        assert w.called() == []
        reject_type(lambda: w.q.send(w.env("x", type="t")), envq.TypeBlacklisted)
        await w.q.terminate()

    async def test_cancelled_is_parked_or_returned(self) -> None:
        """(PERIODIC, CANCELLED) SHELVE: PARKED by a cancelling stop, RETURNED by
        terminate; no hook."""
        w = World()
        a = w.env("a", "hang", "hang", interval=10)
        w.q.start()
        w.q.send(a)
        await advance(1)
        await within(w.q.stop(STOP, cancel=True))
        w.q.start()
        await advance(1)
        assert await within(w.q.terminate()) == [a]
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>PARKED/CANCELLED",
            "PARKED>READY",
            "READY>RUNNING",
            "RUNNING>RETURNED/CANCELLED",
        ]
        assert w.called() == []


# ---------------------------------------------------------------------------------------
# OUTCOMES, kind BLACKLISTED: an attempt in flight when its type was blacklisted
# ---------------------------------------------------------------------------------------


class TestBlacklistedRows:
    @pytest.mark.parametrize(
        ("step", "outcome"),
        [
            ("ok", Outcome.OK),
            ("error", Outcome.ERROR),
            ("stop", Outcome.STOP),
            ("stop_type", Outcome.STOP_TYPE),
            ("no_retry", Outcome.NO_RETRY),
            ("expired", Outcome.EXPIRED),
        ],
    )
    @pytest.mark.parametrize("interval", [0, 50])
    async def test_any_outcome_ends_stopped(
        self, step: str, outcome: Outcome, interval: float
    ) -> None:
        """(BLACKLISTED, *) END → STOPPED: whatever the attempt does, no hook, no retry."""
        w = World(workers=2)
        gate = asyncio.Event()
        v = w.env(
            "v",
            ("wait", gate, step),
            decisions=iter([envq.retry_now()]),
            type="t",
            interval=interval,
        )
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(culprit)
        gate.set()
        await w.ended(v)
        await advance(200)
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", f"RUNNING>STOPPED/{outcome.name}"]
        assert w.called() == []
        assert w.runs("v") == [0.0]
        assert w.by_state() == {ES.STOPPED: 2}
        await w.q.terminate()

    async def test_timeout_ends_stopped(self) -> None:
        """(BLACKLISTED, TIMEOUT) END → STOPPED."""
        w = World(workers=2)
        v = w.env("v", "hang", decisions=iter([envq.retry_now()]), type="t", deadline=5)
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(v)
        await advance(100)
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/TIMEOUT"]
        assert w.called() == []
        assert w.runs("v") == [0.0]
        await w.q.terminate()

    @pytest.mark.parametrize("by", ["stop", "terminate"])
    async def test_cancelled_ends_stopped(self, by: str) -> None:
        """(BLACKLISTED, CANCELLED) END → STOPPED: neither parked nor handed back."""
        w = World(workers=2)
        v = w.env("v", "hang", decisions=iter([envq.retry_now()]), type="t")
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(culprit)
        if by == "stop":
            report = await within(w.q.stop(STOP, cancel=True))
            assert report.parked == ()
            assert report.cancelled == (v,)
            assert await w.q.terminate() == []
        else:
            assert await within(w.q.terminate()) == []
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/CANCELLED"]
        assert w.called() == []
        assert w.by_state() == {ES.STOPPED: 2}


# ---------------------------------------------------------------------------------------
# DECISION_TARGET, SHELVE_TARGET, PARK_INSTEAD
# ---------------------------------------------------------------------------------------


class TestDecisionTargets:
    async def test_each_decision(self) -> None:
        """DECISION_TARGET: drop → FAILED, retry_now → READY (at once, no DELAYED step),
        retry_after(s) → DELAYED for s."""
        w = World(workers=3)
        d = w.env("d", "error", decisions=iter([envq.drop()]))
        n = w.env("n", "error", decisions=iter([envq.retry_now()]))
        a = w.env("a", "error", decisions=iter([envq.retry_after(4)]))
        w.q.start()
        w.q.send(d, n, a)
        for env in (d, n, a):
            await w.ended(env)
        assert w.path(d) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/ERROR"]
        assert w.timed(n)[2:4] == [("RUNNING>READY", 0.0), ("READY>RUNNING", 0.0)]
        assert w.timed(a)[2:4] == [("RUNNING>DELAYED", 0.0), ("DELAYED>READY", 4.0)]
        assert w.by_state() == {ES.FAILED: 1, ES.SUCCEEDED: 2}
        await w.q.terminate()


class TestParkInstead:
    async def test_retry_now_during_stop_is_parked(self) -> None:
        """PARK_INSTEAD[READY]: a retry_now decided while STOPPING parks the envelope
        (it does not run again during the stop); it runs on restart."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "error"), decisions=iter([envq.retry_now()]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/ERROR"]
        assert w.runs("a") == [0.0]
        await advance(10)
        w.q.start()
        await w.ended(a)
        assert w.timed(a)[3:5] == [("PARKED>READY", 15.0), ("READY>RUNNING", 15.0)]
        await w.q.terminate()

    async def test_retry_after_during_stop_is_parked_with_its_delay(self) -> None:
        """PARK_INSTEAD[DELAYED]: a retry_after decided while STOPPING parks the
        envelope, which keeps its delay for the restart."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "error"), decisions=iter([envq.retry_after(3)]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/ERROR"]
        await advance(10)
        w.q.start()
        await w.ended(a)
        assert w.timed(a)[3:5] == [("PARKED>DELAYED", 15.0), ("DELAYED>READY", 18.0)]
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), [("ok", Outcome.OK), *FAILURES])
    async def test_periodic_next_run_during_stop_is_parked(
        self, step: str, outcome: Outcome
    ) -> None:
        """PARK_INSTEAD[DELAYED] for a periodic run ending while STOPPING (OK, ERROR,
        TIMEOUT, EXPIRED): parked with the interval still to wait."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 1, step), hooks=False, interval=10, deadline=2)
        w.q.start()
        w.q.send(a)
        await settle()
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", f"RUNNING>PARKED/{outcome.name}"]
        end = now()
        assert end == (2.0 if outcome is Outcome.TIMEOUT else 1.0)
        w.q.start()
        await advance(11)
        assert w.timed(a)[3:5] == [("PARKED>DELAYED", end), ("DELAYED>READY", end + 10)]
        await w.q.terminate()


# ---------------------------------------------------------------------------------------
# ENVELOPE_MOVES: the queue-side moves not shown above
# ---------------------------------------------------------------------------------------


class TestEnvelopeMoves:
    async def test_stop_parks_ready_and_delayed_restart_rearms(self) -> None:
        """(READY, STOP) and (DELAYED, STOP) → PARKED; (PARKED, START) → READY, or
        DELAYED with the delay that was left."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "ok"))
        r, d = w.env("r"), w.env("d", delay=10)
        w.q.start()
        w.q.send(a, r, d)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == (r, d)
        await advance(100 - now())
        w.q.start()
        await w.ended(d)
        assert w.timed(r)[1:3] == [("READY>PARKED", 1.0), ("PARKED>READY", 100.0)]
        assert w.timed(d)[1:4] == [
            ("DELAYED>PARKED", 1.0),
            ("PARKED>DELAYED", 100.0),
            ("DELAYED>READY", 109.0),
        ]
        await w.q.terminate()

    async def test_blacklist_stops_parked(self) -> None:
        """(PARKED, BLACKLIST) → STOPPED: a StopType during a stop."""
        w = World(workers=1)
        c = w.env("c", ("sleep", 5, "stop_type"), type="t")
        p = w.env("p", type="t")
        w.q.start()
        w.q.send(c, p)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == ()
        assert w.path(p) == ["NEW>READY", "READY>PARKED", "PARKED>STOPPED"]
        assert await w.q.terminate() == []


# ---------------------------------------------------------------------------------------
# DISPATCHING, TERMINAL_STATES, LIVE_STATES
# ---------------------------------------------------------------------------------------


class TestDispatching:
    async def test_drain_stop_runs_ready_envelopes(self) -> None:
        """STOPPING dispatches: a DRAIN stop runs what is READY."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.completed == (a, b)
        assert w.runs("b") == [5.0]
        await w.q.terminate()

    async def test_workers_of_a_stopped_queue_retire(self) -> None:
        """STOPPED does not dispatch: the worker that ended the stop retires, so after a
        restart there is still one worker (one attempt at a time), not two."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        await within(w.q.stop(STOP))
        w.q.start()
        await settle()  # the new worker goes idle
        b, c = w.env("b", ("sleep", 5, "ok")), w.env("c", ("sleep", 5, "ok"))
        w.q.send(b, c)
        await w.ended(c)
        assert (w.runs("b"), w.runs("c")) == ([5.0], [10.0])
        await w.q.terminate()


class TestStatistics:
    async def test_by_state_counts_every_live_and_terminal_state(self) -> None:
        """``by_state`` has exactly the live and terminal states as keys, at every stage."""
        keys = {ES.BUFFERED, ES.READY, ES.DELAYED, ES.RUNNING, ES.PARKED}
        keys |= {ES.SUCCEEDED, ES.FAILED, ES.STOPPED, ES.RETURNED}
        w = World(workers=1)

        def full() -> dict[EnvState, int]:
            by_state = dict(w.q.statistics().by_state)
            assert set(by_state) == keys
            return {s: n for s, n in by_state.items() if n}

        assert full() == {}
        w.q.send(w.env("b0"))
        assert full() == {ES.BUFFERED: 1}
        w.q.start()
        w.q.send(
            w.env("a", ("sleep", 5, "ok")),
            w.env("r"),
            w.env("d", delay=50),
            w.env("f", "error"),
            w.env("s", "stop"),
        )
        await settle()
        assert full() == {ES.SUCCEEDED: 1, ES.RUNNING: 1, ES.READY: 3, ES.DELAYED: 1}
        await advance(6)
        assert full() == {ES.DELAYED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
        await w.q.stop(STOP)
        assert full() == {ES.PARKED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
        await w.q.terminate()
        assert full() == {ES.RETURNED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
