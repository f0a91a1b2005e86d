"""A port that goes on between commands, and the ``effect`` of its answers.

A port on the real clock keeps working after it answers: an envelope falls due, starts
or ends before the next command reaches the queue. The harness predicts a call from
the queue as the observations before the call's effect left it; a port tells where
that is with ``effect``. These tests make such a port out of the reference driver: the
wrapper lets model time pass before a command (as the real clock would between two
commands), and reports the moves made meanwhile in the command's answer, before the
call's own.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from envq.conform.harness import Harness
from envq.conform.oracle import Violation
from envq.conform.protocol import SLOW_SECONDS, EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.runner import Options, run
from envq.conform.transport import InProcessDriver
from envq.driver import Session


class Lagging:
    """The reference driver, with ``lag`` model seconds passing before the next
    command; the moves made meanwhile are reported in that command's answer."""

    def __init__(self, *, report_effect: bool) -> None:
        self.inner = InProcessDriver(Session)
        self.report_effect = report_effect
        self.lag = 0.0
        #: (kind, env) of an observation made during the lag to report right after
        #: the call's first own observation instead (once, at the next lag).
        self.late: tuple[str, str] | None = None
        self.lines = 0
        self.last_line = ""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        before: list[dict[str, Any]] = []
        if self.lag:
            before = self.inner.call({"cmd": "advance", "seconds": self.lag})["events"]
            self.lag = 0.0
        response = self.inner.call(command)
        own = list(response.get("events", []))
        if self.late is not None and before:
            kind, env = self.late
            moved = [e for e in before if (e["kind"], e.get("env")) == (kind, env)]
            assert moved, f"no {kind} of {env} to move"
            before = [e for e in before if e not in moved]
            own[1:1] = moved
            self.late = None
        at = int(response.get("at", len(own)))
        response["events"] = before + own
        response["at"] = len(before) + at
        if self.report_effect:
            response["effect"] = len(before)
        return response

    def close(self) -> None:
        self.inner.close()


_OPEN: list[Harness] = []


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Every session ends (its queues terminated), whatever the test raised."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _harness(driver: Lagging, *, workers: int, capacity: int) -> Harness:
    harness = Harness(driver)
    _OPEN.append(harness)
    harness.queue(QueueConfig(workers=workers, capacity=capacity))
    return harness


def _stop_racing_a_claim(driver: Lagging) -> None:
    """e1 hangs; e2 falls due and starts between the previous answer and a stop
    with cancel, which cancels both."""
    harness = _harness(driver, workers=2, capacity=0)
    harness.define("e1", EnvSpec(then=Plan.HANG))
    harness.define("e2", EnvSpec(delay=1.0, then=Plan.HANG))
    harness.start()
    harness.send(["e1"])
    harness.send(["e2"])
    driver.lag = 1.0
    harness.stop(StopCall(mode="stop", cancel=True, wait=False))


def _send_after_an_end(driver: Lagging) -> None:
    """Capacity 1, held by e1 until it ends at model second 2; e2 is sent after."""
    harness = _harness(driver, workers=1, capacity=1)
    harness.define("e1", EnvSpec(then=Plan.SLOW))
    harness.define("e2", EnvSpec())
    harness.start()
    harness.send(["e1"])
    driver.lag = 5.0
    harness.send(["e2"])


class TestEffect:
    def test_a_stop_cancels_an_attempt_that_began_before_it_took_effect(self) -> None:
        _stop_racing_a_claim(Lagging(report_effect=True))

    def test_without_effect_the_stop_is_predicted_from_the_previous_answer(self) -> None:
        """The check that ``effect`` feeds: the same answers, predicted stale."""
        with pytest.raises(Violation, match=r"cancelled at [\d.]+ by nobody"):
            _stop_racing_a_claim(Lagging(report_effect=False))

    def test_a_cancel_reaches_an_attempt_dispatched_before_its_invoke_began(self) -> None:
        """The claim came before the stop took effect, the invoke after it."""
        driver = Lagging(report_effect=True)
        driver.late = ("invoke", "e2")
        _stop_racing_a_claim(driver)

    def test_a_send_is_admitted_into_room_made_before_it_took_effect(self) -> None:
        _send_after_an_end(Lagging(report_effect=True))

    def test_without_effect_the_send_is_predicted_refused(self) -> None:
        with pytest.raises(Violation, match="e2: admitted without a send"):
            _send_after_an_end(Lagging(report_effect=False))

    def test_a_refused_send_is_still_checked_where_it_took_effect(self) -> None:
        """The port says the send took effect before the end that made room: then
        it must have been refused."""

        class Early(Lagging):
            def call(self, command: dict[str, Any]) -> dict[str, Any]:
                response = super().call(command)
                if command["cmd"] == "send" and command["envs"] == ["e2"]:
                    response["effect"] = 0
                return response

        with pytest.raises(Violation, match="e2: admitted without a send"):
            _send_after_an_end(Early(report_effect=True))


def _send_after_a_ban(driver: Lagging) -> None:
    """e1 falls due and bans its type (StopType) while model time passes before e2,
    of that type, is sent: refused."""
    harness = _harness(driver, workers=1, capacity=0)
    harness.define("e1", EnvSpec(type="t", delay=0.5, script=(Plan.STOP_TYPE,)))
    harness.define("e2", EnvSpec(type="t"))
    harness.start()
    harness.send(["e1"])
    driver.lag = 1.0
    harness.send(["e2"])


class Unsure(Lagging):
    """Says a refused call took effect somewhere from before everything the lag made
    to after it (``effect`` 0, ``effect_until``: all of it), as a port whose moves
    commit on several sessions may; or (``ranged`` False) only the range's start."""

    def __init__(self, *, ranged: bool) -> None:
        super().__init__(report_effect=True)
        self.ranged = ranged

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        response = super().call(command)
        if not response["ok"] and command["cmd"] == "send":
            if self.ranged:
                response["effect_until"] = response["effect"]
            response["effect"] = 0
        return response


class TestEffectUntil:
    def test_a_refusal_is_judged_where_the_model_explains_it(self) -> None:
        """The ban came before the send in the range the port gave: explained."""
        _send_after_a_ban(Unsure(ranged=True))

    def test_a_refusal_the_range_does_not_explain_is_a_violation(self) -> None:
        """Placed before the ban only, the refusal is unexplained: the check bites."""
        with pytest.raises(Violation, match="expected success, got 'type_blacklisted'"):
            _send_after_a_ban(Unsure(ranged=False))

    def test_the_port_refused_as_predicted(self) -> None:
        """The reference driver's own answer, placed after the ban."""
        _send_after_a_ban(Lagging(report_effect=True))


class Settling(Lagging):
    """Lets model time pass after a ``plan`` command, reporting the moves
    made meanwhile after the call's ``at`` (as a real-clock port settling after it)."""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        response = super().call(command)
        if command["cmd"] == "plan":
            after = self.inner.call({"cmd": "advance", "seconds": SLOW_SECONDS + 1})["events"]
            response["at"] = len(response["events"])
            response["events"] = response["events"] + after
        return response


def test_a_plan_takes_effect_where_its_call_returned() -> None:
    """e2 waits for the one worker (e1 runs SLOW_SECONDS); a plan appended to e2's
    script, and e2 starts while the port settles after the call: it runs the new plan.
    (The model appended it after every observation of the answer: "e2: ran plan
    error, not ok".)"""
    driver = Settling(report_effect=True)
    harness = _harness(driver, workers=1, capacity=0)
    harness.define("e1", EnvSpec(then=Plan.SLOW))
    harness.define("e2", EnvSpec())
    harness.start()
    harness.send(["e1", "e2"])
    harness.plan("e2", Plan.ERROR)


class Jittery(Lagging):
    """A port on the "real clock": before some commands a random stretch of model time
    passes (as between two answers on a real clock), differently every time the same
    commands are sent, so the same steps leave the queue in different states."""

    COMMANDS = frozenset({"start", "send", "send_wait", "stop", "terminate", "stats", "advance"})

    def __init__(self) -> None:
        super().__init__(report_effect=True)
        self.jitter = random.SystemRandom()

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if command["cmd"] in self.COMMANDS and self.jitter.random() < 0.3:
            self.lag = self.jitter.choice((0.5, 1.0, 2.5))
        response = super().call(command)
        if command["cmd"] == "hello":
            response["result"]["clock"] = "real"
        return response


def test_a_port_whose_timing_varies_is_checked_for_every_example() -> None:
    """Hypothesis stops a run whose draws differ along the same choices; on the real
    clock the rules that apply only in some states must not change what is drawn."""
    result = run(Jittery, Options(examples=60, steps=30))
    assert result.error is None, result.error
    assert not [f for f in result.findings if not f.declared], result.findings
    assert result.steps >= 60 * 10
