"""Listeners at an envelope's end: when a terminal event is delivered the envelope has
left the queue (it may be sent again, here or elsewhere) and ``statistics()`` agrees
with the event; listeners are always called on the loop's thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

import envq
from envq.testing import VirtualTimeLoop
from tests.support import noop

S = envq.EnvState


async def boom(env: envq.Envelope) -> None:
    raise ValueError("boom")


async def stop_it(env: envq.Envelope) -> None:
    raise envq.StopEnvelope


@pytest.mark.parametrize(
    ("invoke", "end"),
    [(noop, S.SUCCEEDED), (boom, S.FAILED), (stop_it, S.STOPPED)],
)
async def test_statistics_inside_a_terminal_event_agree_with_it(
    invoke: envq.Invoker, end: envq.EnvState
) -> None:
    q = envq.Queue("stats", capacity=5)
    seen: list[tuple[envq.EnvState | None, envq.Statistics]] = []
    q.subscribe(lambda ev: seen.append((ev.to_state, q.statistics())))
    q.start()
    env = envq.Envelope(invoke=invoke)
    q.send(env)
    await asyncio.sleep(1)
    snaps = [stats for to, stats in seen if to is end]
    assert len(snaps) == 1
    stats = snaps[0]
    assert stats.capacity_used == 0
    assert stats.by_state[end] == 1
    assert stats.by_state[S.RUNNING] == 0
    assert stats.in_flight == 0
    assert q.state_of(env) is None
    await q.terminate()


async def test_returned_event_statistics_agree() -> None:
    q = envq.Queue("returned")
    seen: list[envq.Statistics] = []
    q.subscribe(lambda ev: seen.append(q.statistics()) if ev.to_state is S.RETURNED else None)
    q.send(envq.Envelope(invoke=noop), envq.Envelope(invoke=noop))
    handed = await q.terminate()
    assert len(handed) == 2
    assert [s.capacity_used for s in seen] == [1, 0]
    assert [s.by_state[S.RETURNED] for s in seen] == [1, 2]


async def test_forward_on_failed_event_to_another_queue() -> None:
    main = envq.Queue("main")
    spare = envq.Queue("spare")
    errors: list[BaseException] = []

    def forward(ev: envq.Event) -> None:
        if ev.to_state is S.FAILED and ev.envelope is not None:
            try:
                spare.send(ev.envelope)
            except envq.EnvqError as exc:
                errors.append(exc)

    main.subscribe(forward)
    env = envq.Envelope(invoke=boom)
    main.start()
    main.send(env)
    await asyncio.sleep(1)
    assert errors == []
    assert spare.state_of(env) is S.BUFFERED
    assert main.state_of(env) is None
    await main.terminate()
    assert await spare.terminate() == [env]


async def test_resend_on_succeeded_event_runs_again() -> None:
    q = envq.Queue("again")
    runs: list[float] = []

    async def count(env: envq.Envelope) -> None:
        runs.append(asyncio.get_running_loop().time())

    env = envq.Envelope(invoke=count)

    def again(ev: envq.Event) -> None:
        if ev.to_state is S.SUCCEEDED and len(runs) < 3:
            q.send(ev.envelope)  # type: ignore[arg-type]

    q.subscribe(again)
    q.start()
    q.send(env)
    await asyncio.sleep(1)
    assert len(runs) == 3
    assert q.state_of(env) is None
    stats = q.statistics()
    assert stats.by_state[S.SUCCEEDED] == 3
    assert stats.capacity_used == 0
    await q.terminate()


def test_send_from_another_thread_between_runs_calls_listeners_on_the_loop_thread() -> None:
    loop = VirtualTimeLoop()
    q = envq.Queue("between")
    threads: list[int] = []
    q.subscribe(lambda ev: threads.append(threading.get_ident()))

    async def begin() -> None:
        q.start()

    async def later() -> None:
        await asyncio.sleep(1)

    try:
        loop.run_until_complete(begin())
        threads.clear()
        env = envq.Envelope(invoke=noop)
        sender = threading.Thread(target=q.send, args=(env,))
        sender.start()
        sender.join()
        loop.run_until_complete(later())
        assert q.statistics().by_state[S.SUCCEEDED] == 1
        assert threads  # SEND, DISPATCH and SUCCEEDED were delivered
        assert set(threads) == {threading.get_ident()}
        loop.run_until_complete(q.terminate())
    finally:
        loop.close()


def test_send_from_another_thread_between_runs_still_raises_at_once() -> None:
    loop = VirtualTimeLoop()
    q = envq.Queue("refusing", capacity=1)
    q.subscribe(lambda ev: None)

    async def begin() -> None:
        q.start()

    errors: list[BaseException] = []

    def send_two() -> None:
        try:
            q.send(envq.Envelope(invoke=noop), envq.Envelope(invoke=noop))
        except envq.EnvqError as exc:
            errors.append(exc)

    try:
        loop.run_until_complete(begin())
        sender = threading.Thread(target=send_two)
        sender.start()
        sender.join()
        assert [type(e) for e in errors] == [envq.CapacityExceeded]
        assert q.capacity_used == 0
        loop.run_until_complete(q.terminate())
    finally:
        loop.close()


def _paths_from_new(events: list[envq.Event]) -> dict[object, list[envq.EnvState]]:
    """Each envelope's moves as a path of states; asserts every path starts at NEW and
    each move starts where the last one ended (none lost, none out of order)."""
    paths: dict[object, list[envq.EnvState]] = {}
    for ev in events:
        if ev.envelope is None:
            continue
        path = paths.setdefault(ev.envelope.id, [])
        expected = path[-1] if path else S.NEW
        assert ev.from_state is expected, (ev.envelope.id, path, ev.from_state, ev.to_state)
        path.append(ev.to_state)
    return paths


class _Gated:
    """A schedule of one's own whose first run waits (in the sender's thread) for the
    test to let it go: a send that is paused half-way."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()

    def first_run(self, at: float, offset: float) -> float:
        self.entered.set()
        assert self.go.wait(10)
        return at

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        return ended + 3600


def test_a_send_from_another_thread_still_running_when_the_loop_runs_loses_no_event() -> None:
    """A send from another thread between two runs of the loop is still admitting when
    the loop runs again: its admission events (NEW → READY) are delivered, on the
    loop's thread, in order with the moves that follow (they were lost: the loop
    delivered the list set aside before the send had added to it)."""
    loop = VirtualTimeLoop()
    q = envq.Queue("paused-send")
    events: list[envq.Event] = []
    threads: set[int] = set()

    def listen(ev: envq.Event) -> None:
        events.append(ev)
        threads.add(threading.get_ident())

    q.subscribe(listen)
    gate = _Gated()
    plain = envq.Envelope(invoke=noop, id="plain")
    gated = envq.Envelope(invoke=noop, id="gated", schedule=gate)

    async def begin() -> None:
        q.start()

    async def let_go() -> None:
        gate.go.set()
        await asyncio.to_thread(sender.join)
        await asyncio.sleep(1)

    sender = threading.Thread(target=q.send, args=(plain, gated))
    try:
        loop.run_until_complete(begin())
        sender.start()
        assert gate.entered.wait(10)
        loop.run_until_complete(let_go())
        paths = _paths_from_new(events)
        assert paths["plain"] == [S.READY, S.RUNNING, S.SUCCEEDED]
        assert paths["gated"][:3] == [S.READY, S.RUNNING, S.DELAYED]
        assert threads == {threading.get_ident()}
        loop.run_until_complete(q.terminate())
    finally:
        gate.go.set()
        loop.close()


def test_eight_threads_sending_while_the_loop_stops_and_runs_again() -> None:
    """Eight threads send while the loop is run again and again: every admitted
    envelope's moves reach the listener from NEW on, in order, on the loop's thread."""
    loop = VirtualTimeLoop()
    q = envq.Queue("many-senders", workers=4)
    events: list[envq.Event] = []
    threads: set[int] = set()

    def listen(ev: envq.Event) -> None:
        events.append(ev)
        threads.add(threading.get_ident())

    q.subscribe(listen)
    done = threading.Event()

    def produce(k: int) -> None:
        for i in range(150):
            q.send(envq.Envelope(invoke=noop, id=(k, i)))

    async def begin() -> None:
        q.start()

    async def a_while() -> None:
        await asyncio.sleep(0.01)

    senders = [threading.Thread(target=produce, args=(k,)) for k in range(8)]
    try:
        loop.run_until_complete(begin())
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            loop.run_until_complete(a_while())
        done.set()
        loop.run_until_complete(asyncio.sleep(1))
        paths = _paths_from_new(events)
        assert len(paths) == 8 * 150
        assert all(path[-1] is S.SUCCEEDED for path in paths.values())
        assert q.statistics().by_state[S.SUCCEEDED] == 8 * 150
        assert threads == {threading.get_ident()}
        loop.run_until_complete(q.terminate())
    finally:
        loop.close()
