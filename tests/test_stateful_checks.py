"""Checks of the stateful machine of ``tests/test_stateful.py`` itself, and regressions
it found: scripted runs that must pass, and wrong engines (a faulty driver, a changed
table row) that the machine must catch, so that a green deep profile means something.
The oracle's own checks that only this machine exercises are tested here too."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import (
    run_state_machine_as_test,
)
from strategies import (
    EnvSpec,
    Plan,
    QueueConfig,
)

import envq
import envq._outcomes
from envq._machine import (
    ENVELOPE_MOVES,
    OPERATOR_EVENTS,
    OUTCOMES,
    Action,
    EnvEvent,
    Kind,
    OutcomeRow,
)
from envq.conform.oracle import (
    Oracle,
    infer_event,
)
from envq.conform.oracle import Violation as OracleViolation
from envq.conform.protocol import SLOW_SECONDS
from envq.conform.runner import _without_source_constants
from tests.conform.faulty_drivers import DoubleCount, PeriodicAfterStop
from tests.conform.oracles import running_oracle
from tests.test_stateful import (
    EPS,
    ES,
    QS,
    QueueMachine,
    Violation,
)


async def test_send_wait_timeout_race() -> None:
    """Regression (found by the machine): two producers wait for room until t=1; the
    second one's envelope is meanwhile sent to another queue. At t=1 the first
    producer's timeout hands the turn to the second just as the second producer's own
    timeout fires. A woken producer admits (or is refused) only when it runs, so the
    timeout wins: both calls raise SendTimeout (a CapacityExceeded), and each counts as one
    rejection."""

    async def noop(env: envq.Envelope) -> None:
        pass

    q = envq.Queue("race", capacity=1)
    other = envq.Queue("other")
    q.send(envq.Envelope(invoke=noop))
    a, b = envq.Envelope(invoke=noop, id="a"), envq.Envelope(invoke=noop, id="b")
    first = asyncio.ensure_future(q.send_wait(a, timeout=1))
    second = asyncio.ensure_future(q.send_wait(b, timeout=1))
    await asyncio.sleep(0)
    other.send(b)
    await asyncio.sleep(2)
    assert type(first.exception()) is envq.SendTimeout
    assert type(second.exception()) is envq.SendTimeout
    assert q.statistics().rejections["capacity"] == 2
    assert sum(q.statistics().rejections.values()) == 2
    await q.terminate()
    await other.terminate()


async def test_start_admits_a_waiting_producer_once() -> None:
    """Two producers wait in an INIT queue: the first for room for two envelopes, the
    second, queued behind it, for one (there is room for one). The first one's second
    envelope is meanwhile sent to another queue. start() must reject the first producer
    (BadEnvelope), admit the second's envelope, and arm it once: it runs once."""
    runs: list[str] = []

    async def job(env: envq.Envelope) -> None:
        runs.append(str(env.id))
        await asyncio.sleep(1)

    q = envq.Queue("q", capacity=2)
    other = envq.Queue("other")
    a, b, c, d = (envq.Envelope(invoke=job, id=name) for name in "abcd")
    q.send(a)
    first = asyncio.ensure_future(q.send_wait(b, c, timeout=10))
    second = asyncio.ensure_future(q.send_wait(d, timeout=10))
    await asyncio.sleep(0)
    other.send(c)
    q.start()
    await asyncio.sleep(5)
    assert type(first.exception()) is envq.BadEnvelope
    assert second.result() == 1
    assert sorted(runs) == ["a", "d"]  # d runs once
    await q.terminate()
    await other.terminate()


def test_infer_event_covers_every_queue_side_move() -> None:
    """Every (from, to) pair of a queue-side move in ENVELOPE_MOVES is inferred back to
    the event that allows it (so the oracle's reconstruction is sound); an operator's
    move is not inferred (no protocol command makes one)."""
    for (frm, event), targets in ENVELOPE_MOVES.items():
        if isinstance(event, EnvEvent) and event not in OPERATOR_EVENTS:
            for to in targets:
                assert infer_event(frm, to) is event, (frm, event, to)


def test_send_wait_timeout_at_the_instant_room_is_freed() -> None:
    """Regression (the deep profile, seed 238466981112243565922858615954300807931): a
    ``send_wait(…, timeout=0.5)`` issued at t=8.0 into a full queue whose envelope
    runs at t=8.5 and frees the slot. The timeout, due at that very instant, wins (the
    decision records why); the machine used to count the room as free in time and
    report "timed out though room was free"."""
    machine = QueueMachine()
    try:
        machine.make_queue(QueueConfig(capacity=1), [EnvSpec(delay=8.5)], started=True)
        machine.advance(8.0)
        machine.send_wait([EnvSpec()], timeout=0.5, background=False)
        machine.advance(10.0)
        machine.no_violations()
    finally:
        machine.teardown()


class _PeriodicAfterStopMachine(QueueMachine):
    session_class = PeriodicAfterStop


class _DoubleCountMachine(QueueMachine):
    session_class = DoubleCount


def test_the_machine_catches_a_wrong_outcome() -> None:
    """The machine can fail: with a faulty driver whose periodic envelopes take
    ``StopEnvelope`` for a success, the oracle sees an attempt planned to stop end OK
    and the step fails."""
    machine = _PeriodicAfterStopMachine()
    try:
        spec = EnvSpec(interval=10.0, script=(Plan.STOP,))
        with pytest.raises(Violation, match="ended OK, expected STOP"):
            machine.make_queue(QueueConfig(), [spec], started=True)
    finally:
        machine.teardown()


def test_the_machine_catches_wrong_statistics() -> None:
    """The machine can fail: with a faulty driver whose statistics count a re-sent live
    envelope against the capacity again, the invariants after the step fail."""
    machine = _DoubleCountMachine()
    try:
        machine.make_queue(QueueConfig(capacity=3), [EnvSpec(delay=15.0)], started=True)
        machine.oracle_invariants_hold()
        machine.session.cmd_send({"envs": ["e1"]})
        with pytest.raises(Violation, match="capacity_used 2, live envelopes 1"):
            machine.oracle_invariants_hold()
    finally:
        machine.teardown()


def _no_retry_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong engine: its outcome table (as each new queue resolves it) ends a one-off
    envelope that raised DoNotRetry as STOPPED, without its on_failure call, instead of
    FAILED (a move the envelope machine allows, from another row)."""
    wrong = OutcomeRow(Action.END, ES.STOPPED)
    table = {**OUTCOMES, (Kind.ONE_OFF, envq.Outcome.NO_RETRY): wrong}
    monkeypatch.setattr(envq._outcomes, "OUTCOMES", table)


def test_the_machine_catches_a_wrong_table_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine can fail: with a wrong row in the engine's outcome table, the step
    whose attempt reaches the row fails."""
    _no_retry_stops(monkeypatch)
    machine = QueueMachine()
    try:
        spec = EnvSpec(script=(Plan.NO_RETRY,))
        with pytest.raises(Violation, match="NO_RETRY led to STOPPED, expected FAILED"):
            machine.make_queue(QueueConfig(), [spec], started=True)
    finally:
        machine.teardown()


def test_generated_runs_find_a_wrong_table_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine's own generated runs (no shrinking) find the wrong row above."""
    _no_retry_stops(monkeypatch)
    quick = settings(
        max_examples=200,
        stateful_step_count=30,
        phases=[Phase.generate],
        database=None,
        derandomize=True,
    )
    # The same examples whatever the process imported before (see the runner).
    with _without_source_constants(), pytest.raises(Violation, match="NO_RETRY led to STOPPED"):
        run_state_machine_as_test(QueueMachine, settings=quick)


def _running_oracle(spec: EnvSpec) -> Oracle:
    """An oracle that has seen a started queue admit envelope ``a`` and start running it."""
    return running_oracle(spec, invoke=None, tolerance=EPS)


def test_oracle_rejects_a_second_invoke_of_one_attempt() -> None:
    """An envelope's invoke called again while its attempt runs (two attempts at once)."""
    oracle = _running_oracle(EnvSpec(then=Plan.SLOW))
    invoke = {"t": 0.0, "kind": "invoke", "env": "a", "plan": "slow"}
    oracle.observe([invoke])
    with pytest.raises(OracleViolation, match="invoked again while its attempt runs"):
        oracle.observe([invoke])


def test_oracle_rejects_an_attempt_that_ends_before_its_body() -> None:
    """A SLOW attempt reported OK before its body slept its time."""
    oracle = _running_oracle(EnvSpec(then=Plan.SLOW))
    oracle.observe([{"t": 0.0, "kind": "invoke", "env": "a", "plan": "slow"}])
    early = {"t": SLOW_SECONDS / 2, "kind": "move", "env": "a", "from": "running"}
    done = {**early, "to": "succeeded", "outcome": "ok", "cause": None}
    with pytest.raises(OracleViolation, match=r"attempt \(slow\) from 0 ended at"):
        oracle.observe([done])


def test_oracle_accepts_an_attempt_that_ends_after_its_body() -> None:
    """The same attempt reported OK once its body has slept its time passes."""
    oracle = _running_oracle(EnvSpec(then=Plan.SLOW))
    oracle.observe([{"t": 0.0, "kind": "invoke", "env": "a", "plan": "slow"}])
    done = {"t": SLOW_SECONDS, "kind": "move", "env": "a", "from": "running", "to": "succeeded"}
    oracle.observe([{**done, "outcome": "ok", "cause": None}])
    assert oracle.tracks["a"].state is ES.SUCCEEDED


def test_oracle_predicts_a_batch_with_a_non_envelope() -> None:
    """send() of a batch with something that is not an envelope: rejected as invalid
    (after the state check), admitting nothing."""
    oracle = Oracle()
    oracle.define("a", EnvSpec())
    assert oracle.predict_send(["a"], valid=False) == ("bad_envelope", "invalid", [])
    assert oracle.predict_send(["a"]) == (None, "", ["a"])
    oracle.life = QS.TERMINATED
    assert oracle.predict_send(["a"], valid=False) == ("queue_terminated", "state", [])
