"""A listener that sends while a batch is being admitted: the batch is written down
whole first (its seqs, its capacity), then its events reach the listeners."""

from __future__ import annotations

import pytest

import envq
from tests.support import lasting

S = envq.EnvState


def _send_on_first(q: envq.Queue, trigger: envq.Envelope, extra: envq.Envelope) -> list[object]:
    """Subscribe a listener that sends ``extra`` when ``trigger`` enters the queue; the
    outcomes of that nested send (the count, or the error)."""
    outcomes: list[object] = []

    def listener(event: envq.Event) -> None:
        if event.envelope is trigger and event.from_state is S.NEW:
            try:
                outcomes.append(q.send(extra))
            except envq.CapacityExceeded as error:
                outcomes.append(error)

    q.subscribe(listener)
    return outcomes


async def test_a_send_from_a_listener_gets_its_own_seq() -> None:
    q = envq.Queue("seqs")
    a, b, c = lasting(60, id="a"), lasting(60, id="b"), lasting(60, id="c")
    nested = _send_on_first(q, a, c)
    q.start()
    assert q.send(a, b) == 2
    assert nested == [1]
    seqs = {snap.envelope.id: snap.seq for snap in q.envelopes()}
    assert seqs == {"a": 1, "b": 2, "c": 3}
    await q.terminate()


@pytest.mark.parametrize("buffered", [False, True], ids=["running", "before-start"])
async def test_a_send_from_a_listener_cannot_overfill_the_queue(buffered: bool) -> None:
    q = envq.Queue("full", capacity=2)
    a, b, c = lasting(60, id="a"), lasting(60, id="b"), lasting(60, id="c")
    nested = _send_on_first(q, a, c)
    if not buffered:
        q.start()
    assert q.send(a, b) == 2
    assert len(nested) == 1
    assert isinstance(nested[0], envq.CapacityExceeded)
    assert q.capacity_used == 2
    assert q.state_of(c) is None
    await q.terminate()
