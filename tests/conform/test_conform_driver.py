"""The reference driver (``python -m envq.driver``) answers every command, however bad:
a bad command or field is a ``DriverError`` answer and the session goes on; a plan or
spec the protocol does not allow is a ``DriverError`` too, never a call error of the
queue; ``lend``/``reclaim`` need no ``queue`` first."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from typing import Any

import pytest

from envq.conform.driving import Gates, play
from envq.conform.protocol import Plan
from envq.driver import Session, answer, serve


def _session(commands: list[Any], clock: str = "virtual") -> list[dict[str, Any]]:
    """Serve ``commands`` (objects, or raw lines) to a fresh session; one answer per
    command, in order."""
    lines = [c if isinstance(c, str) else json.dumps(c) for c in commands]
    out = io.StringIO()
    serve(Session(clock), io.StringIO("\n".join(lines) + "\n"), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


HELLO = {"cmd": "hello", "protocol": 1, "time_scale": 0.05}
QUEUE = {"cmd": "queue", "workers": 1, "capacity": 0, "stop_mode": "drain", "wait": True}
DEFINE = {"cmd": "define", "env": "e1", "spec": {}}


def _refused(response: dict[str, Any], words: str) -> None:
    assert response["ok"] is False, response
    assert response["error"] == "DriverError", response
    assert words in response["message"], response


class TestSecondQueue:
    def test_lend_and_reclaim_before_any_queue(self) -> None:
        """The second queue is made when first needed: no AssertionError, an answer."""
        answers = _session([HELLO, DEFINE, {"cmd": "lend", "env": "e1"}, {"cmd": "reclaim"}])
        assert [a["ok"] for a in answers] == [True, True, True, True]
        assert answers[3]["result"] == ["e1"]

    def test_reclaim_alone(self) -> None:
        [_, reclaimed] = _session([HELLO, {"cmd": "reclaim"}])
        assert reclaimed == {**reclaimed, "ok": True, "result": []}


class TestTimeScale:
    @pytest.mark.parametrize("scale", [0, -1, "1", None])
    def test_a_bad_scale_is_refused_and_the_session_goes_on(self, scale: object) -> None:
        hello = {**HELLO, "time_scale": scale}
        answers = _session([hello, {"cmd": "stats"}, HELLO, QUEUE, {"cmd": "stats"}], "real")
        assert len(answers) == 5
        _refused(answers[0], f"time_scale must be a finite number > 0, got {scale!r}")
        _refused(answers[1], "no queue")
        assert answers[2]["ok"] is True
        assert answers[4]["result"]["state"] == "init"

    def test_the_driver_process_survives_a_zero_scale(self) -> None:
        """``--clock real`` with ``time_scale: 0``: answered, then the next command."""
        lines = [json.dumps(c) for c in ({**HELLO, "time_scale": 0}, {"cmd": "quit"})]
        done = subprocess.run(
            [sys.executable, "-m", "envq.driver", "--clock", "real"],
            input="\n".join(lines) + "\n",
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        answers = [json.loads(line) for line in done.stdout.splitlines()]
        assert [a["ok"] for a in answers] == [False, True]


class TestBadFields:
    @pytest.mark.parametrize(
        ("command", "words"),
        [
            ({"cmd": "advance", "seconds": "Infinity"}, "seconds must be finite"),
            ({"cmd": "advance", "seconds": "NaN"}, "seconds must be finite"),
            ({"cmd": "advance", "seconds": -1}, "seconds must be finite and >= 0"),
            ({"cmd": "advance", "seconds": "1"}, "seconds must be a number"),
            ({"cmd": "plan", "env": "e1", "plan": "explode"}, "plan must be one of"),
            ({"cmd": "release", "env": "e1", "plan": "explode"}, "plan must be one of"),
            ({"cmd": "release", "env": "e1", "plan": "hang"}, "released with one of"),
            ({"cmd": "define", "env": "e2", "spec": {"policy": "maybe"}}, "bad spec for 'e2'"),
            ({"cmd": "define", "env": "e2", "spec": {"then": "explode"}}, "bad spec for 'e2'"),
            ({"cmd": "define", "env": "e2", "spec": {"colour": "red"}}, "bad spec for 'e2'"),
            ({"cmd": "define", "env": "e2", "spec": {"interval": -1}}, "bad spec for 'e2'"),
            ({"cmd": "define", "env": "e2", "spec": [1]}, "spec must be an object"),
            ({"cmd": "send", "envs": "e1"}, "envs must be a list"),
            ({"cmd": "send_wait", "envs": ["e1"], "timeout": "soon"}, "timeout must be a number"),
            ({"cmd": "stop", "mode": "halt"}, "mode must be one of"),
            ({"cmd": "stop", "cancel": "yes"}, "cancel must be true or false"),
            ({"cmd": "stop", "limit": "NaN"}, "limit must be finite"),
            ({"cmd": "wait_stopped", "limit": -1}, "limit must be finite and >= 0"),
            ({"cmd": "terminate", "limit": "Infinity"}, "limit must be finite"),
            ({"cmd": "queue", "workers": 0}, "workers must be >= 1"),
            ({"cmd": "queue", "capacity": -2}, "capacity must be a whole number"),
            ({"cmd": "queue", "stop_mode": "halt"}, "stop_mode must be one of"),
        ],
    )
    def test_a_bad_field_is_a_driver_error_and_the_session_goes_on(
        self, command: dict[str, Any], words: str
    ) -> None:
        """Each bad command gets its answer; the queue then works as before."""
        # JSON has no literal for these: the raw line carries them.
        line = json.dumps(command).replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
        stats = {"cmd": "stats"}
        pre = [HELLO, DEFINE] + ([] if command["cmd"] == "queue" else [QUEUE])
        answers = _session([*pre, line, stats])
        assert len(answers) == len(pre) + 2
        _refused(answers[-2], words)
        if command["cmd"] != "queue":
            assert answers[-1]["result"]["state"] == "init"

    def test_a_stop_with_a_bad_field_does_not_stop(self) -> None:
        """The fields are checked before the call: a refused stop leaves the queue."""
        start, bad = {"cmd": "start"}, {"cmd": "stop", "limit": -1}
        answers = _session([HELLO, QUEUE, start, bad, {"cmd": "stats"}])
        _refused(answers[3], "limit")
        assert answers[4]["result"]["state"] == "running"

    def test_a_refused_cancel_is_still_the_queues_error(self) -> None:
        """A call the queue refuses is its own error, not the driver's."""
        stop = {"cmd": "stop", "mode": "drain", "cancel": True}
        answers = _session([HELLO, QUEUE, {"cmd": "start"}, stop])
        assert answers[3]["error"] == "invalid_argument"


def test_an_unforeseen_failure_is_answered() -> None:
    """Whatever a command raises, the driver answers with a DriverError naming it."""

    class Breaks(Session):
        def cmd_stats(self, command: dict[str, Any]) -> dict[str, Any]:
            raise ZeroDivisionError("float division by zero")

    session = Breaks()
    response, quitting = answer(session, json.dumps({"cmd": "stats"}))
    assert not quitting
    _refused(response, "ZeroDivisionError: float division by zero")
    response, _ = answer(session, json.dumps(HELLO))
    assert response["ok"] is True
    session.close()


def test_an_attempt_ending_late_leaves_the_next_attempts_gate_in_place() -> None:
    """Two attempts of one envelope hang in turn (the first still unwinding when the
    second starts, as when a lease lapsed): the first one's end must not remove the
    second one's gate, or ``release`` answers that an attempt in flight does not hang."""

    async def go() -> bool:
        gates: Gates = {}
        seen: list[str] = []

        def observe(kind: str, **_: Any) -> None:
            seen.append(kind)

        first = asyncio.create_task(play(Plan.HANG, "e3", gates, observe, float))
        await asyncio.sleep(0)
        second = asyncio.create_task(play(Plan.HANG, "e3", gates, observe, float))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert seen == ["cancelled"]
        still = "e3" in gates
        if not still:
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            return False
        gate, holder = gates["e3"]
        holder.append(Plan.OK)
        gate.set()
        assert await second is Plan.OK
        return True

    assert asyncio.run(go()) is True
