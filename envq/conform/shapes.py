"""The shapes of the driver protocol's answers and script fields: what each answer must
hold (:func:`shape_problem`), how a bad one is reported (:func:`bad_answer`), and the
small predicates the saved scripts' checks share (:mod:`envq.conform.scripts`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from envq._machine import EnvState, Outcome, QueueState
from envq.conform.protocol import Plan
from envq.conform.transport import Driver

__all__ = ["MISSING", "PLANS", "bad_answer", "is_count", "is_number", "shape_problem", "to_json"]


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_QUEUE_STATES: Final = frozenset(s.value for s in QueueState)
_ENV_STATES: Final = frozenset(s.value for s in EnvState)
_OUTCOMES: Final = frozenset(o.value for o in Outcome)
PLANS: Final = frozenset(p.value for p in Plan)


def _field(value: object, field: str, want: str) -> str:
    """What is wrong with ``field``: missing, or ``value`` is not ``want``."""
    return f"field {field!r} is {to_json(value)}, not {want}"


def to_json(value: object) -> str:
    if value is MISSING:
        return "missing"
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


MISSING: Final = object()

#: The fields each kind of observation has, and what each must be.
_EVENT_FIELDS: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "queue": (("from", "queue state"), ("to", "queue state")),
    "move": (
        ("env", "name"),
        ("from", "envelope state"),
        ("to", "envelope state"),
        ("outcome", "outcome or null"),
        ("cause", "name or null"),
    ),
    "invoke": (("env", "name"), ("plan", "plan")),
    "cancelled": (("env", "name"),),
    "on_failure": (("env", "name"), ("error", "name"), ("attempt", "count")),
    "on_success": (("env", "name"), ("attempt", "count")),
}

_KINDS: Final[Mapping[str, Callable[[object], bool]]] = {
    "queue state": lambda v: v in _QUEUE_STATES,
    "envelope state": lambda v: v in _ENV_STATES,
    "outcome or null": lambda v: v is None or v in _OUTCOMES,
    "name or null": lambda v: v is None or isinstance(v, str),
    "name": lambda v: isinstance(v, str),
    "plan": lambda v: v in PLANS,
    "count": is_count,
}


def _event_problem(event: object, where: str) -> str | None:
    if not isinstance(event, dict):
        return _field(event, where, "an object")
    kind = event.get("kind", MISSING)
    if kind not in _EVENT_FIELDS:
        return _field(kind, f"{where}.kind", f"one of {sorted(_EVENT_FIELDS)}")
    t = event.get("t", MISSING)
    if not is_number(t):
        return _field(t, f"{where}.t", "a number")
    for name, want in _EVENT_FIELDS[str(kind)]:
        value = event.get(name, MISSING)
        if value is MISSING and want.endswith("or null"):
            continue
        if not _KINDS[want](value):
            return _field(value, f"{where}.{name}", f"a {want}")
    return None


def _counts_problem(value: object, field: str) -> str | None:
    if not isinstance(value, dict) or not all(is_count(n) for n in value.values()):
        return _field(value, field, "an object of counts")
    return None


def _result_problem(cmd: object, result: object) -> str | None:
    """What is wrong with the ``result`` of a successful ``cmd``, if anything."""
    if cmd == "stats":
        if not isinstance(result, dict):
            return _field(result, "result", "an object")
        state = result.get("state", MISSING)
        if state not in _QUEUE_STATES:
            return _field(state, "result.state", "a queue state")
        used = result.get("capacity_used", MISSING)
        if not is_count(used):
            return _field(used, "result.capacity_used", "a count")
        for name in ("by_state", "outcomes", "rejections"):
            if name in result and (problem := _counts_problem(result[name], f"result.{name}")):
                return problem
        for name in ("in_flight", "dedups"):
            if name in result and not is_count(result[name]):
                return _field(result[name], f"result.{name}", "a count")
    elif cmd in ("stop", "wait_stopped", "terminate", "hello"):
        if not isinstance(result, dict):
            return _field(result, "result", "an object")
        if cmd == "terminate" and not result.get("timed_out"):
            handed = result.get("handed_back", MISSING)
            if not isinstance(handed, list) or not all(isinstance(n, str) for n in handed):
                return _field(handed, "result.handed_back", "a list of names")
        if cmd == "hello":
            features = result.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                return _field(features, "result.features", "a list of names")
            if not isinstance(result.get("divergences", []), list):
                return _field(result.get("divergences"), "result.divergences", "a list")
            for name in ("cancel_latency", "due_latency"):
                latency = result.get(name, 0.0)
                if not is_number(latency) or not 0 <= float(latency) < math.inf:
                    return _field(latency, f"result.{name}", "model seconds, 0 or more")
    elif cmd == "release" and not isinstance(result, bool):
        return _field(result, "result", "true or false")
    elif cmd == "reclaim" and (
        not isinstance(result, list) or not all(isinstance(n, str) for n in result)
    ):
        return _field(result, "result", "a list of names")
    return None


def shape_problem(command: Mapping[str, Any], response: Mapping[str, Any]) -> str | None:
    """What makes ``response`` (to ``command``) break the protocol's shapes: the field
    and what is wrong with it; ``None`` if nothing. The values are not judged here,
    only their form (the oracle judges the values)."""
    ok = response.get("ok", MISSING)
    if not isinstance(ok, bool):
        return _field(ok, "ok", "true or false")
    if not ok and not isinstance(response.get("error"), str):
        return _field(response.get("error", MISSING), "error", "a name")
    events = response.get("events", [])
    if not isinstance(events, list):
        return _field(events, "events", "a list")
    for i, event in enumerate(events):
        if problem := _event_problem(event, f"events[{i}]"):
            return problem
    if "at" in response:
        at = response["at"]
        if not is_count(at) or at > len(events):
            return _field(at, "at", f"a count from 0 to {len(events)} (the events)")
    if "effect" in response:
        effect, at = response["effect"], response.get("at", len(events))
        if not is_count(effect) or effect > at:
            return _field(effect, "effect", f"a count from 0 to {at} (the events before 'at')")
    if "effect_until" in response:
        until, at = response["effect_until"], response.get("at", len(events))
        effect = response.get("effect", 0)
        if not is_count(until) or not is_count(effect) or not effect <= until <= at:
            return _field(
                until, "effect_until", f"a count from 'effect' to {at} (the events before 'at')"
            )
    if "t" in response and not is_number(response["t"]):
        return _field(response["t"], "t", "a number")
    if ok and response.get("error") != "DriverError":
        return _result_problem(command.get("cmd"), response.get("result", MISSING))
    return None


def bad_answer(driver: Driver, command: Mapping[str, Any], problem: str) -> str:
    """A protocol error's message: the command, what is wrong with which field, and
    the driver's line (numbered, when the driver counts its lines)."""
    lines = getattr(driver, "lines", None)
    line = str(getattr(driver, "last_line", ""))
    where = f"line {lines} of the driver's output" if lines else "the driver's answer"
    if len(line) > 300:
        line = line[:297] + "..."
    return f"protocol error: the answer to {command.get('cmd')!r}: {problem}\n  {where}: {line}"
