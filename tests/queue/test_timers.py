"""The queue's timer heap: DELAYED envelopes wait in one heap per queue under a single
loop timer (see docs/decisions.md, "One timer heap per queue").

Behaviour first (when and in what order delayed envelopes become READY), then the
two white-box properties the heap owes its users: a stop leaves no timer behind, and
an envelope that leaves DELAYED early is not kept alive by a stale heap entry.
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest

import envq
from envq._timers import STALE_SLACK
from tests.support import now


class Starts:
    """An invoke that records (envelope id, loop time) at each start."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, float]] = []

    async def __call__(self, env: envq.Envelope) -> None:
        self.seen.append((env.id, now()))

    @property
    def order(self) -> list[object]:
        return [ident for ident, _t in self.seen]


async def test_due_together_run_in_the_order_they_were_delayed() -> None:
    """Envelopes due at the same instant become READY in the order they entered
    DELAYED (not in an arbitrary heap order): one worker runs them in that order."""
    starts = Starts()
    ids = list(range(60))
    random.Random(7).shuffle(ids)
    q = envq.Queue("q", workers=1)
    q.start()
    for ident in ids:
        q.send(envq.Envelope(invoke=starts, id=ident, delay=5))
    await asyncio.sleep(6)
    assert starts.order == ids
    assert {t for _i, t in starts.seen} == {5.0}
    await q.terminate()


async def test_an_earlier_due_rearms_the_timer() -> None:
    """A later-sent envelope due sooner runs first, at its own time."""
    starts = Starts()
    q = envq.Queue("q")
    q.start()
    q.send(envq.Envelope(invoke=starts, id="late", delay=10))
    await asyncio.sleep(1)
    q.send(envq.Envelope(invoke=starts, id="soon", delay=2))
    q.send(envq.Envelope(invoke=starts, id="middle", delay=5))
    await asyncio.sleep(20)
    assert starts.seen == [("soon", 3.0), ("middle", 6.0), ("late", 10.0)]
    await q.terminate()


async def test_retries_and_periodic_runs_share_the_heap() -> None:
    """Periodic runs and retry delays interleave on one clock."""
    starts = Starts()
    attempts: list[float] = []

    async def flaky(env: envq.Envelope) -> None:
        attempts.append(now())
        if len(attempts) < 3:
            raise RuntimeError("again")

    q = envq.Queue("q", workers=2)
    q.start()
    q.send(
        envq.Envelope(invoke=starts, id="tick", interval=4, schedule=envq.FIXED_RATE),
        envq.Envelope(invoke=flaky, retry=envq.Retry(attempts=5, base=3, cap=100, jitter=False)),
    )
    await asyncio.sleep(13)
    assert starts.seen == [("tick", 0.0), ("tick", 4.0), ("tick", 8.0), ("tick", 12.0)]
    assert attempts == [0.0, 3.0, 9.0]  # waits of 3 then 6 (exponential backoff)
    await q.terminate()


async def test_stop_leaves_no_timer_and_start_rearms() -> None:
    """A stop parks every DELAYED envelope and drops the loop timer (white-box);
    start() arms the remaining delays again."""
    starts = Starts()
    q = envq.Queue("q")
    q.start()
    q.send(*(envq.Envelope(invoke=starts, id=i, delay=10 + i) for i in range(3)))
    await asyncio.sleep(4)
    await q.stop()
    assert not q._store.delays.armed
    assert len(q._store.delays) == 0
    await asyncio.sleep(100)
    assert starts.seen == []
    q.start()  # at t=104: 6, 7 and 8 s were left
    await asyncio.sleep(20)
    assert starts.seen == [(0, 110.0), (1, 111.0), (2, 112.0)]
    await q.terminate()


async def test_envelopes_leaving_delayed_early_are_not_kept_alive() -> None:
    """Blacklisting DELAYED envelopes leaves stale heap entries behind; once they
    outnumber the live ones the heap is rebuilt without them, so the queue does not
    hold the envelopes (and a live one still runs on time)."""
    starts = Starts()

    async def stop_type(env: envq.Envelope) -> None:
        raise envq.StopType("enough")

    q = envq.Queue("q", keep_ended=0)  # the heap's hold, not the kept ended ones
    q.start()
    keeper = envq.Envelope(invoke=starts, id="keeper", delay=50)
    victims = [envq.Envelope(invoke=starts, type="t", delay=100) for _ in range(200)]
    refs = [weakref.ref(env) for env in victims]
    q.send(keeper, *victims)
    q.send(envq.Envelope(invoke=stop_type, type="t", delay=1))
    await asyncio.sleep(2)
    assert q.statistics().by_state[envq.EnvState.STOPPED] == 201
    del victims
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    # White-box: the rebuilt heap holds the keeper and fewer than STALE_SLACK stale entries.
    assert len(q._store.delays) <= STALE_SLACK + 2
    await asyncio.sleep(60)
    assert starts.seen == [("keeper", 50.0)]
    await q.terminate()


async def test_stale_entry_of_another_stay_never_fires() -> None:
    """An envelope blacklisted while DELAYED in one queue and then delayed in another
    runs once, at the second queue's time (the first queue's stale entry is ignored)."""
    starts = Starts()

    async def stop_type(env: envq.Envelope) -> None:
        raise envq.StopType("enough")

    a, b = envq.Queue("a"), envq.Queue("b")
    a.start()
    b.start()
    env = envq.Envelope(invoke=starts, id="x", type="t", delay=10)
    a.send(env, envq.Envelope(invoke=stop_type, type="t", delay=1))
    await asyncio.sleep(2)
    assert a.state_of(env) is None
    b.send(env)  # due at 12 in b; a's stale entry was due at 10
    await asyncio.sleep(30)
    assert starts.seen == [("x", 12.0)]
    await a.terminate()
    await b.terminate()


@pytest.mark.parametrize("n", [1, 500])
async def test_due_reports_the_heap_time(n: int) -> None:
    """Queue.due() is the loop time the envelope becomes READY."""
    q = envq.Queue("q")
    q.start()
    envs = [envq.Envelope(invoke=Starts(), delay=3 + i) for i in range(n)]
    q.send(*envs)
    assert [q.due(env) for env in envs] == [3.0 + i for i in range(n)]
    await q.terminate()


class TestDeadlineTimer:
    """The one deadline timer per queue: limits cost no loop timer per attempt, a
    limit still times out on the dot, and nothing is left armed to move the clock."""

    async def test_one_timer_for_many_attempts(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """300 attempts under the same 10 s deadline arm the loop's timers a handful of
        times, not once per attempt (white-box: counts ``call_at``)."""
        loop = asyncio.get_running_loop()
        calls: list[float] = []
        real_call_at = loop.call_at

        def counting(when: float, *args: object, **kwargs: object) -> asyncio.TimerHandle:
            calls.append(when)
            return real_call_at(when, *args, **kwargs)  # type: ignore[arg-type]

        q = envq.Queue("q", workers=4)
        q.start()
        envs = [envq.Envelope(invoke=_tick, deadline=10) for _ in range(300)]
        monkeypatch.setattr(loop, "call_at", counting)
        q.send(*envs)
        await q.run_until_empty()
        monkeypatch.undo()
        assert len(calls) <= 2
        assert now() < 1.0
        await q.terminate()

    async def test_overrun_times_out_on_time(self) -> None:
        """Staggered attempts each get their own full deadline: each one that hangs is
        cut off exactly ``deadline`` after it started."""
        ends: dict[object, tuple[envq.Outcome | None, float]] = {}
        q = envq.Queue("q", workers=3, log_unhandled=False)

        def record(event: envq.Event) -> None:
            if event.envelope is not None and event.outcome is not None:
                ends[event.envelope.id] = (event.outcome, now())

        q.subscribe(record)
        q.start()

        async def hang(env: envq.Envelope) -> None:
            await asyncio.sleep(1000)

        q.send(envq.Envelope(invoke=hang, id="a", deadline=5))
        await asyncio.sleep(1)
        q.send(envq.Envelope(invoke=hang, id="b", deadline=2))  # earlier than a's
        await asyncio.sleep(1)
        q.send(envq.Envelope(invoke=_tick, id="c", deadline=1))  # ends in time
        await asyncio.sleep(10)
        assert ends == {
            "a": (envq.Outcome.TIMEOUT, 5.0),
            "b": (envq.Outcome.TIMEOUT, 3.0),
            "c": (envq.Outcome.OK, 2.0),
        }
        await q.terminate()

    async def test_idle_queue_leaves_no_timer_to_move_the_clock(self) -> None:
        """Once the attempts with deadlines have ended and the workers are idle, no
        loop timer is left armed (white-box: the loop's own timer list), so a virtual
        clock has no stale deadline to jump to."""
        q = envq.Queue("q")
        q.start()
        q.send(envq.Envelope(invoke=_tick, deadline=30))
        for _ in range(5):
            await asyncio.sleep(0)
        assert q.statistics().by_state[envq.EnvState.SUCCEEDED] == 1
        assert not q._deadlines.armed
        live = [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        assert live == []
        await q.terminate()

    async def test_stop_and_terminate_disarm(self) -> None:
        """A stop cancelling an attempt under a deadline leaves no timer armed."""
        q = envq.Queue("q", stop_mode=envq.StopMode.STOP)
        q.start()

        async def hang(env: envq.Envelope) -> None:
            await asyncio.sleep(1000)

        q.send(envq.Envelope(invoke=hang, deadline=100))
        await asyncio.sleep(1)
        assert q._deadlines.armed
        await q.stop(cancel=True)
        assert not q._deadlines.armed
        await q.terminate()
        assert not q._deadlines.armed


async def _tick(env: envq.Envelope) -> None:
    await asyncio.sleep(0)
