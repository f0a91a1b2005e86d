"""The driver protocol's vocabulary, shared by the harness and the reference driver.

A driver is a program that runs one port of envq (envq itself, the Go library, …)
and speaks JSON lines on stdin/stdout: one command per line in, one response per line
out (``specs/driver-protocol.md`` is the language-neutral definition). This module
holds what both sides agree on: the scripted attempt :class:`Plan`, the failure
:class:`Policy`, an envelope's :class:`EnvSpec`, the queue's :class:`QueueConfig`,
the optional :data:`FEATURES` a port may declare, and the JSON forms of all of them.

Durations are model seconds; a port on the real clock is given a ``time_scale`` (real
seconds per model second) in ``hello``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

import attrs

__all__ = [
    "CAUSES",
    "ERRORS",
    "EXPIRED_CAUSE",
    "FEATURES",
    "HANG_RELEASES",
    "LONG_SECONDS",
    "PROTOCOL",
    "SHARED_STORE_FEATURES",
    "SLOW_SECONDS",
    "EnvSpec",
    "Plan",
    "Policy",
    "QueueConfig",
    "StopCall",
]

#: The protocol's version, exchanged in ``hello``.
PROTOCOL: Final = 1

#: How long a :attr:`Plan.SLOW` attempt takes (model seconds); shorter than every
#: deadline the harness generates.
SLOW_SECONDS: Final = 3.0
#: How long a :attr:`Plan.LONG` attempt takes; longer than every generated deadline.
LONG_SECONDS: Final = 300.0

#: Optional features a port declares in ``hello``; the harness generates only what the
#: port declares. Everything else (queue, start, send, stop, terminate, advance,
#: stats, one-off envelopes, ok/error/slow/long/hang attempts) every port must do.
FEATURES: Final[Mapping[str, str]] = {
    "buffer": "send() before the first start() buffers (INIT)",
    "restart": "start() after a stop re-arms what was parked",
    "stop_modes": "stop(mode=...) per call, DRAIN and STOP",
    "stop_cancel": "stop(mode=STOP, cancel=True) cancels attempts in flight",
    "stop_nowait": "stop(wait=False) returns at once; the report is not final",
    "terminate_handback": "terminate() hands back what the queue still holds",
    "send_wait": "send_wait(*envs, timeout=...) waits for room",
    "periodic": "envelopes with an interval",
    "fixed_rate": "periodic envelopes on a fixed-rate grid",
    "cron": "periodic envelopes on a cron calendar (UTC, model second 0 = the Unix epoch)",
    "deadline": "a per-attempt deadline (TIMEOUT)",
    "delay": "a first delay after admission",
    "on_failure": "on_failure decisions: drop, retry_now, retry_after, a crash",
    "on_success": "an on_success hook (the spec's on_success), reported as it runs",
    "retry_policy": "an exponential-backoff Retry policy without on_failure",
    "no_retry": "DoNotRetry ends the envelope (FAILED)",
    "stop_envelope": "StopEnvelope ends the envelope (STOPPED)",
    "stop_type": "StopType blacklists the envelope's type",
    "dedup": "re-sending a live envelope is deduplicated",
    "foreign": "an envelope live in a second queue is refused",
    "leases": "an attempt holds a lease; another process reaps it when it expires (expired)",
    "late_cancel": (
        "a stop with cancel, a terminate or a type's ban reaches an attempt running in"
        " another process within `cancel_latency` model seconds (in hello's answer): an"
        " attempt whose deadline falls before the cancel reached it may end TIMEOUT"
        " rather than CANCELLED, and one ending that soon after its type's ban may have"
        " had its on_failure called"
    ),
    "late_due": (
        "a delayed envelope becomes ready up to `due_latency` model seconds (in hello's"
        " answer) after its due time: one of the port's processes moves it when it next"
        " looks (a poll and a statement)"
    ),
}

#: The features only a queue whose store several processes share can have (its
#: processes learn of a lease reaped, or of a cancel, from the store). An
#: in-process port (envq's reference driver, envq's own stateful tests) declares every
#: feature but these. The harness generates nothing for them: no plan makes a lease
#: expire, so an ``expired`` outcome is never scripted, only reported by a port that
#: declares ``leases`` (another of its processes reaped the attempt).
SHARED_STORE_FEATURES: Final[frozenset[str]] = frozenset({"leases", "late_cancel", "late_due"})


#: The protocol's names for what a call raises (language-neutral; envq's class names
#: on the left).
ERRORS: Final[Mapping[str, str]] = {
    "QueueStopping": "queue_stopping",
    "QueueNotRunning": "queue_not_running",
    "QueueTerminated": "queue_terminated",
    "CapacityExceeded": "capacity_exceeded",
    "BadEnvelope": "bad_envelope",
    "TypeBlacklisted": "type_blacklisted",
    "ValueError": "invalid_argument",
}

#: The protocol's names for the cause of an envelope's move and the error on_failure
#: sees (envq's class names on the left): the planned error, the deadline, a cancel,
#: the control signals, retries used up. A port with ``leases`` names the cause of an
#: attempt whose lease expired :data:`EXPIRED_CAUSE`.
CAUSES: Final[Mapping[str, str]] = {
    "RuntimeError": "error",
    "TimeoutError": "timeout",
    "CancelledError": "cancelled",
    "StopEnvelope": "stop",
    "StopType": "stop_type",
    "DoNotRetry": "no_retry",
    "MaxRetriesExceeded": "max_retries",
}
#: The cause of the move that ends an attempt whose lease expired, and the error
#: on_failure sees then (a port that declares ``leases``).
EXPIRED_CAUSE: Final = "expired"


class Plan(enum.Enum):
    """What one attempt of a scripted envelope does."""

    #: Return at once (outcome OK).
    OK = "ok"
    #: Sleep :data:`SLOW_SECONDS`, then return (OK, unless cancelled meanwhile).
    SLOW = "slow"
    #: Sleep :data:`LONG_SECONDS`, then return: TIMEOUT with a deadline, else OK.
    LONG = "long"
    #: Raise an error (ERROR).
    ERROR = "error"
    #: Wait until released with another plan, the deadline expires (TIMEOUT) or the
    #: attempt is cancelled (CANCELLED).
    HANG = "hang"
    #: Raise StopEnvelope (STOP).
    STOP = "stop"
    #: Raise StopType (STOP_TYPE; STOP on an envelope without a type).
    STOP_TYPE = "stop_type"
    #: Raise DoNotRetry (NO_RETRY).
    NO_RETRY = "no_retry"


#: What a released HANG attempt may do next.
HANG_RELEASES: Final = (Plan.OK, Plan.ERROR, Plan.STOP, Plan.STOP_TYPE, Plan.NO_RETRY)


class Policy(enum.Enum):
    """How a scripted envelope reacts to a failed attempt."""

    #: No on_failure and no retry: the table's default.
    NONE = "none"
    #: on_failure returns drop().
    DROP = "drop"
    #: on_failure returns None (drop).
    DECIDE_NONE = "decide_none"
    #: on_failure returns retry_now().
    RETRY_NOW = "retry_now"
    #: on_failure returns retry_after(EnvSpec.retry_after).
    RETRY_AFTER = "retry_after"
    #: on_failure raises (counts as drop).
    CRASH = "crash"
    #: No on_failure; an exponential-backoff retry policy (attempts, base, cap, no jitter).
    RETRY = "retry"

    @property
    def has_on_failure(self) -> bool:
        """Whether the envelope has an on_failure hook."""
        return self not in (Policy.NONE, Policy.RETRY)


def _plans(value: Any) -> tuple[Plan, ...]:
    return tuple(Plan(p) if not isinstance(p, Plan) else p for p in value)


@attrs.frozen
class EnvSpec:
    """The schedule, failure policy and script of one envelope (all model seconds)."""

    type: str = ""
    #: 0 = one-off.
    interval: float = 0.0
    deadline: float = 0.0
    delay: float = 0.0
    fixed_rate: bool = False
    #: A cron expression (5 or 6 fields) read in UTC over model time, model second 0
    #: being the Unix epoch; "" = none. With one, ``interval`` is 0 and it is periodic.
    cron: str = ""
    policy: Policy = Policy.NONE
    #: The delay on_failure asks for with :attr:`Policy.RETRY_AFTER`.
    retry_after: float = 2.0
    #: The retry policy's fields for :attr:`Policy.RETRY` (attempts: -1 = unlimited).
    attempts: int = 3
    base: float = 1.0
    cap: float = 4.0
    #: What its first attempts do; ``plan`` commands append more.
    script: tuple[Plan, ...] = attrs.field(default=(), converter=_plans)
    #: What its attempts do once the script is used up: OK, SLOW, LONG or HANG.
    then: Plan = Plan.OK
    #: Whether it has an on_success hook (only for a port that declares ``on_success``).
    on_success: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    @property
    def periodic(self) -> bool:
        """Whether it has an interval or a cron calendar."""
        return self.interval > 0 or bool(self.cron)

    def to_json(self) -> dict[str, Any]:
        """The spec as the protocol's JSON object (``cron`` and ``on_success`` only when
        set, so ports that do not declare them never see the fields)."""
        data = {
            "type": self.type,
            "interval": self.interval,
            "deadline": self.deadline,
            "delay": self.delay,
            "fixed_rate": self.fixed_rate,
            "policy": self.policy.value,
            "retry_after": self.retry_after,
            "attempts": self.attempts,
            "base": self.base,
            "cap": self.cap,
            "script": [p.value for p in self.script],
            "then": self.then.value,
        }
        if self.cron:
            data["cron"] = self.cron
        if self.on_success:
            data["on_success"] = True
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EnvSpec:
        """The spec of a protocol JSON object (missing fields take their defaults)."""
        fields = dict(data)
        if "policy" in fields:
            fields["policy"] = Policy(fields["policy"])
        if "then" in fields:
            fields["then"] = Plan(fields["then"])
        return cls(**fields)


@attrs.frozen
class QueueConfig:
    """The constructor arguments of the queue under test."""

    workers: int = 1
    #: 0 = unlimited.
    capacity: int = 0
    #: "drain" or "stop".
    stop_mode: str = "drain"
    wait: bool = True

    def to_json(self) -> dict[str, Any]:
        """As the ``queue`` command's fields."""
        return attrs.asdict(self)


@attrs.frozen
class StopCall:
    """The arguments of one ``stop`` call (``None`` = the queue's default)."""

    #: "drain", "stop" or None.
    mode: str | None = None
    cancel: bool = False
    wait: bool | None = None
