"""Saved scripts: a counterexample as JSON lines, checked before it is played
(:func:`load_script`), and played through a :class:`~envq.conform.harness.Harness`
command by command, each checked as when it was first generated (:func:`replay`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from envq.conform.harness import Harness
from envq.conform.oracle import Violation
from envq.conform.protocol import EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.shapes import MISSING, PLANS, is_count, is_number, to_json

__all__ = ["ScriptError", "load_script", "replay"]


class ScriptError(ValueError):
    """A saved script that cannot be replayed: not JSON lines, an unknown command, a
    field missing or of the wrong type, an envelope used before it is defined."""


#: Each script command's fields: the field, what it must be, and whether it may be
#: missing.
_SCRIPT_FIELDS: Final[Mapping[str, tuple[tuple[str, str, bool], ...]]] = {
    "hello": (("protocol", "count", True), ("time_scale", "scale", True)),
    "queue": (
        ("workers", "count", True),
        ("capacity", "count", True),
        ("stop_mode", "mode", True),
        ("wait", "bool", True),
    ),
    "define": (("env", "name", False), ("spec", "spec", False)),
    "plan": (("env", "defined", False), ("plan", "plan", False)),
    "start": (),
    "send": (("envs", "defined list", False),),
    "send_wait": (("envs", "defined list", False), ("timeout", "seconds", False)),
    "stop": (
        ("mode", "mode or null", True),
        ("cancel", "bool", True),
        ("wait", "bool or null", True),
    ),
    "wait_stopped": (),
    "terminate": (),
    "lend": (("env", "defined", False),),
    "reclaim": (),
    "release": (("env", "defined", False), ("plan", "plan", False)),
    "advance": (("seconds", "seconds", False),),
    "stats": (),
}


def _script_field_problem(value: object, want: str, defined: set[str]) -> str | None:
    """What is wrong with one field of a script command (``None``: nothing)."""
    names = value if isinstance(value, list) else [value]
    checks: dict[str, Callable[[], bool]] = {
        "count": lambda: is_count(value),
        "scale": lambda: is_number(value) and float(value) > 0,  # type: ignore[arg-type]
        "mode": lambda: value in ("drain", "stop"),
        "mode or null": lambda: value is None or value in ("drain", "stop"),
        "bool": lambda: isinstance(value, bool),
        "bool or null": lambda: value is None or isinstance(value, bool),
        "name": lambda: isinstance(value, str),
        "plan": lambda: value in PLANS,
        "seconds": lambda: is_number(value) and float(value) >= 0,  # type: ignore[arg-type]
        "spec": lambda: isinstance(value, dict),
        "defined": lambda: isinstance(value, str),
        "defined list": lambda: isinstance(value, list) and all(isinstance(n, str) for n in names),
    }
    descriptions = {
        "count": "a whole number >= 0",
        "scale": "a number > 0",
        "mode": '"drain" or "stop"',
        "mode or null": '"drain", "stop" or null',
        "bool": "true or false",
        "bool or null": "true, false or null",
        "name": "a name",
        "plan": f"one of {sorted(PLANS)}",
        "seconds": "a finite number >= 0",
        "spec": "an object",
        "defined": "a name",
        "defined list": "a list of names",
    }
    if not checks[want]():
        return f"is {to_json(value)}, not {descriptions[want]}"
    if want.startswith("defined"):
        unknown = [n for n in names if n not in defined]
        if unknown:
            return f"names {unknown[0]!r}, which no earlier 'define' defines"
    return None


def load_script(text: str, source: str = "script") -> list[dict[str, Any]]:
    """The commands of a saved script (JSON lines, as ``envq conform`` saves them),
    each checked before anything is sent: a :class:`ScriptError` names the line and
    what is wrong with it. Blank lines are skipped."""
    commands: list[dict[str, Any]] = []
    defined: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            command = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"{where}: not JSON ({exc.msg}): {line[:120]!r}") from None
        if not isinstance(command, dict):
            raise ScriptError(f"{where}: a command is a JSON object, got {to_json(command)}")
        cmd = command.get("cmd", MISSING)
        if cmd not in _SCRIPT_FIELDS:
            raise ScriptError(f"{where}: unknown command {to_json(cmd)}")
        for field, want, optional in _SCRIPT_FIELDS[str(cmd)]:
            if field not in command:
                if optional:
                    continue
                raise ScriptError(f"{where}: {cmd!r} has no field {field!r}")
            problem = _script_field_problem(command[field], want, defined)
            if problem is not None:
                raise ScriptError(f"{where}: {cmd!r}: field {field!r} {problem}")
        if cmd == "define":
            try:
                EnvSpec.from_json(command["spec"])
            except (TypeError, ValueError) as exc:
                raise ScriptError(f"{where}: 'define': field 'spec': {exc}") from None
            defined.add(command["env"])
        commands.append(command)
    if not any(c["cmd"] != "hello" for c in commands):
        raise ScriptError(f"{source}: no command to replay")
    return commands


def replay(harness: Harness, commands: Iterable[Mapping[str, Any]]) -> None:
    """Play a saved script (a counterexample) through ``harness``: each command is
    checked as when it was first generated. Raises the first violation; a command
    that cannot be played in the state the model is in (a ``release`` of an
    envelope that does not hang) raises :class:`ScriptError`."""
    for number, command in enumerate(commands, 1):
        try:
            _replay_one(harness, command)
        except (Violation, ScriptError):
            raise
        except (KeyError, TypeError, AssertionError, ValueError) as exc:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise ScriptError(f"command {number} ({command.get('cmd')!r}): {what}") from exc


def _replay_one(harness: Harness, command: Mapping[str, Any]) -> None:
    cmd = command.get("cmd")
    if cmd == "hello":
        return
    if cmd == "queue":
        fields = {k: v for k, v in command.items() if k != "cmd"}
        harness.queue(QueueConfig(**fields))
    elif cmd == "define":
        harness.define(str(command["env"]), EnvSpec.from_json(command["spec"]))
    elif cmd == "plan":
        harness.plan(str(command["env"]), Plan(command["plan"]))
    elif cmd == "start":
        harness.start()
    elif cmd == "send":
        harness.send(list(command["envs"]))
    elif cmd == "send_wait":
        harness.send_wait(list(command["envs"]), float(command["timeout"]))
    elif cmd == "stop":
        mode, cancel, wait = (
            command.get("mode"),
            command.get("cancel", False),
            command.get("wait"),
        )
        harness.stop(StopCall(mode=mode, cancel=bool(cancel), wait=wait))
    elif cmd == "wait_stopped":
        harness.wait_stopped()
    elif cmd == "terminate":
        harness.terminate()
    elif cmd == "lend":
        harness.lend(str(command["env"]))
    elif cmd == "reclaim":
        harness.reclaim()
    elif cmd == "release":
        name = str(command["env"])
        if name not in harness.oracle.hanging():
            raise ScriptError(f"release: {name!r} has no hanging attempt in the model")
        harness.release(name, Plan(command["plan"]))
    elif cmd == "advance":
        harness.advance(float(command["seconds"]))
    elif cmd == "stats":
        harness.stats()
    else:
        raise ScriptError(f"a script command envq conform does not know: {cmd!r}")
