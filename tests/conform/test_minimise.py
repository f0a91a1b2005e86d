"""What the harness makes of a finding and of a real-clock port.

``minimise`` shortens a finding's script without trading its failure for another:
deleting a command the protocol needs (the ``queue`` before everything else) makes the
driver refuse the script, and that refusal is not the finding. A real-clock port goes
on between commands: its answers are believed where the harness's picture may lag (a
``release`` of an attempt already ending, a ``send_wait`` refused for a ban that came
meanwhile), and are violations where nothing could have happened in between."""

from __future__ import annotations

from typing import Any

from envq.conform.harness import Harness
from envq.conform.oracle import Violation
from envq.conform.runner import Finding, Options, minimise, same_failure
from envq.conform.scripts import replay
from envq.conform.transport import InProcessDriver
from envq.driver import Session


class ForgetsHangs(Session):
    """Answers every ``release`` with "not hanging" and leaves the attempt hanging (a
    port that loses its gates)."""

    def cmd_release(self, command: dict[str, Any]) -> bool:
        return False


SCRIPT: tuple[dict[str, Any], ...] = (
    {"cmd": "hello", "protocol": 1, "time_scale": 0.05},
    {"cmd": "queue", "workers": 2, "capacity": 0, "stop_mode": "drain", "wait": True},
    {"cmd": "define", "env": "e1", "spec": {"script": ["ok"]}},
    {"cmd": "define", "env": "e2", "spec": {"script": ["hang"]}},
    {"cmd": "start"},
    {"cmd": "send", "envs": ["e1"]},
    {"cmd": "stats"},
    {"cmd": "send", "envs": ["e2"]},
    {"cmd": "advance", "seconds": 1},
    {"cmd": "stats"},
    {"cmd": "release", "env": "e2", "plan": "ok"},
    {"cmd": "stats"},
)


def test_a_protocol_finding_shrinks_to_itself_keeping_the_queue() -> None:
    finding = Finding("protocol", None, "e2 was not hanging", SCRIPT)
    short = minimise(lambda: InProcessDriver(ForgetsHangs), finding, Options())
    assert short.message == "e2 was not hanging"
    commands = [c["cmd"] for c in short.script]
    # What the failure needs stays (a queue, a hanging e2 started and released); what
    # it does not (e1, the checks between steps, the release's aftermath) goes.
    assert commands[:2] == ["hello", "queue"]
    assert "release" in commands
    assert "start" in commands
    assert "e1" not in str(short.script)
    assert len(short.script) < len(SCRIPT) - 3


def test_a_protocol_refusal_is_not_the_same_failure_as_another() -> None:
    finding = Finding("protocol", None, "e2 was not hanging", SCRIPT)
    assert same_failure(Violation("protocol", "e14 was not hanging"), finding)
    assert not same_failure(Violation("protocol", "stats: no queue"), finding)
    assert not same_failure(Violation("I7", "e2 was not hanging"), finding)
    row = Finding("I7", "OUTCOMES[ONE_OFF,OK]", "e2: ok twice", SCRIPT)
    # A table row names the failure: its message may change as the script shortens.
    assert same_failure(Violation("I7", "e5: other words", "OUTCOMES[ONE_OFF,OK]"), row)
    assert not same_failure(Violation("I7", "e2: ok twice", "OUTCOMES[ONE_OFF,STOP]"), row)


QUEUE: dict[str, Any] = {"cmd": "queue", "workers": 1, "capacity": 0, "stop_mode": "drain"}


def _violation(
    driver: Any, commands: list[dict[str, Any]], *, real_clock: bool
) -> Violation | None:
    """Replay ``commands`` through a harness on ``driver``; the violation raised, if any."""
    harness = Harness(driver, real_clock=real_clock)
    try:
        replay(harness, [{**QUEUE, "wait": True}, *commands])
    except Violation as exc:
        return exc
    finally:
        harness.close()
    return None


def _released(deadline: float, *, real_clock: bool) -> Violation | None:
    """Release a hanging attempt of ``ForgetsHangs`` (the envelope has ``deadline``),
    then let the deadline pass; the violation raised, if any."""
    return _violation(
        InProcessDriver(ForgetsHangs),
        [
            {"cmd": "define", "env": "e1", "spec": {"script": ["hang"], "deadline": deadline}},
            {"cmd": "start"},
            {"cmd": "send", "envs": ["e1"]},
            {"cmd": "advance", "seconds": 1},
            {"cmd": "release", "env": "e1", "plan": "ok"},
            {"cmd": "advance", "seconds": deadline + 1},
            {"cmd": "stats"},
        ],
        real_clock=real_clock,
    )


def test_on_the_real_clock_not_hanging_is_believed_where_the_attempt_may_be_ending() -> None:
    # Its deadline may have cut the attempt before the release reached the port: the
    # answer is believed, and the attempt's end by its deadline is what follows.
    assert _released(3, real_clock=True) is None
    # Nothing but a release ends an attempt without a deadline: a port that says it
    # does not hang is wrong, on either clock.
    found = _released(0, real_clock=True)
    assert found is not None
    assert (found.check, found.message) == ("protocol", "e1 was not hanging")
    # On the virtual clock the harness's picture is the port's: always a violation.
    found = _released(3, real_clock=False)
    assert found is not None
    assert found.message == "e1 was not hanging"


class GoesOnBetweenCommands:
    """The reference driver (virtual clock) as a real-clock port looks to the harness:
    before a ``send_wait`` takes effect, ``ahead`` model seconds pass that the harness
    has not asked for; their observations come first in the answer."""

    def __init__(self, ahead: float) -> None:
        self.inner = InProcessDriver(Session)
        self.ahead = ahead

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if command.get("cmd") != "send_wait":
            return self.inner.call(command)
        went_on = self.inner.call({"cmd": "advance", "seconds": self.ahead})
        response = self.inner.call(command)
        early = went_on.get("events", [])
        response["events"] = early + response.get("events", [])
        response["at"] = len(early) + int(response.get("at", 0))
        return response

    def close(self) -> None:
        self.inner.close()


def _banned_meanwhile(*, real_clock: bool) -> Violation | None:
    """e1 of type t raises StopType one second after it is sent; e2 of type t is then
    sent with send_wait before the harness has asked for that second."""
    return _violation(
        GoesOnBetweenCommands(1.5),
        [
            {
                "cmd": "define",
                "env": "e1",
                "spec": {"type": "t", "delay": 1, "script": ["stop_type"]},
            },
            {"cmd": "define", "env": "e2", "spec": {"type": "t", "script": ["ok"]}},
            {"cmd": "start"},
            {"cmd": "send", "envs": ["e1"]},
            {"cmd": "send_wait", "envs": ["e2"], "timeout": 1},
            {"cmd": "stats"},
        ],
        real_clock=real_clock,
    )


def test_on_the_real_clock_a_ban_that_came_before_a_send_wait_refuses_it() -> None:
    # The port saw the ban before the call took effect; the model, a step behind,
    # predicted the batch admitted at once. The ban is in the call's observations.
    assert _banned_meanwhile(real_clock=True) is None
    # On the virtual clock nothing happens between two commands: a refusal of a batch
    # the model admits at once is a violation.
    found = _banned_meanwhile(real_clock=False)
    assert found is not None
    assert (found.check, found.message) == ("I7", "send_wait() answered 'type_blacklisted'")
