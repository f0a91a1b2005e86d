"""Shared Hypothesis strategies for envq's tests.

The values here are plain descriptions (frozen attrs classes and enums), not live
objects: a test turns an :class:`EnvSpec` into an ``envq.Envelope`` with its own
``invoke``, so that Hypothesis can print, replay and shrink them.

All durations are small dyadic numbers (0.5, 1, 2, 3, …): sums and differences of them
are exact in binary floating point, so a model can predict the loop times the engine
computes without tolerance games.
"""

from __future__ import annotations

import enum

import attrs
from hypothesis import strategies as st

import envq

__all__ = [
    "HANG_RELEASES",
    "LONG_SECONDS",
    "SLOW_SECONDS",
    "EnvSpec",
    "Plan",
    "Policy",
    "QueueConfig",
    "StopCall",
    "bad_items",
    "env_specs",
    "large_steps",
    "plans",
    "queue_configs",
    "releases",
    "send_wait_timeouts",
    "small_steps",
    "stop_calls",
]

#: How long a :attr:`Plan.SLOW` attempt takes; shorter than every deadline below.
SLOW_SECONDS = 3.0
#: How long a :attr:`Plan.LONG` attempt takes; longer than every deadline below.
LONG_SECONDS = 300.0


class Plan(enum.Enum):
    """What one attempt of a scripted envelope does."""

    #: Return at once (outcome OK).
    OK = "ok"
    #: Sleep :data:`SLOW_SECONDS`, then return (OK, unless cancelled meanwhile).
    SLOW = "slow"
    #: Sleep :data:`LONG_SECONDS`, then return: TIMEOUT if the envelope has a
    #: deadline, else OK (unless cancelled meanwhile). Keeps attempts in flight
    #: across stops.
    LONG = "long"
    #: Raise ``RuntimeError`` (ERROR).
    ERROR = "error"
    #: Wait until the test releases the attempt with another plan, the deadline
    #: expires (TIMEOUT) or the attempt is cancelled (CANCELLED).
    HANG = "hang"
    #: Raise ``envq.StopEnvelope`` (STOP).
    STOP = "stop"
    #: Raise ``envq.StopType`` (STOP_TYPE; STOP on an envelope without a type).
    STOP_TYPE = "stop_type"
    #: Raise ``envq.DoNotRetry`` (NO_RETRY).
    NO_RETRY = "no_retry"


#: What a released HANG attempt may do next.
HANG_RELEASES = (Plan.OK, Plan.ERROR, Plan.STOP, Plan.STOP_TYPE, Plan.NO_RETRY)


class Policy(enum.Enum):
    """How a scripted envelope reacts to a failed attempt."""

    #: No ``on_failure`` and no ``retry``: the table's default.
    NONE = "none"
    #: ``on_failure`` returns ``envq.drop()``.
    DROP = "drop"
    #: ``on_failure`` returns ``None`` (drop).
    DECIDE_NONE = "decide_none"
    #: ``on_failure`` returns ``envq.retry_now()``.
    RETRY_NOW = "retry_now"
    #: ``on_failure`` returns ``envq.retry_after(EnvSpec.retry_after)``.
    RETRY_AFTER = "retry_after"
    #: ``on_failure`` raises (counts as drop).
    CRASH = "crash"
    #: No ``on_failure``; ``retry=envq.Retry(attempts, base, cap, jitter=False)``.
    RETRY = "retry"

    @property
    def has_on_failure(self) -> bool:
        return self not in (Policy.NONE, Policy.RETRY)


@attrs.frozen
class EnvSpec:
    """The schedule and failure policy of one scripted envelope."""

    type: str = ""
    #: 0 = one-off.
    interval: float = 0.0
    deadline: float = 0.0
    delay: float = 0.0
    fixed_rate: bool = False
    policy: Policy = Policy.NONE
    #: The delay ``on_failure`` asks for with :attr:`Policy.RETRY_AFTER`.
    retry_after: float = 2.0
    #: The ``envq.Retry`` fields for :attr:`Policy.RETRY`.
    attempts: int = 3
    base: float = 1.0
    cap: float = 4.0
    #: What its first attempts do; rules may append more.
    script: tuple[Plan, ...] = ()
    #: What its attempts do once the script is used up: OK, SLOW, LONG or HANG.
    #: (Never a failure: with ``retry_now`` that would retry forever at one instant.)
    then: Plan = Plan.OK

    @property
    def periodic(self) -> bool:
        return self.interval > 0

    def retry(self) -> envq.Retry | None:
        if self.policy is not Policy.RETRY:
            return None
        return envq.Retry(attempts=self.attempts, base=self.base, cap=self.cap, jitter=False)


# Strategies are built once: a strategy object made afresh on every draw costs
# Hypothesis a validation each time, which dominated the stateful test's run time.
_PERIODIC = st.booleans()
_INTERVALS = st.sampled_from([10.0, 25.0])
_POLICIES = st.sampled_from(Policy)
_RETRY_AFTER = st.sampled_from([0.5, 2.0, 12.0])
_RETRY = st.tuples(
    st.sampled_from([-1, 1, 2, 4]), st.sampled_from([0.5, 1.0, 4.0]), st.sampled_from([2.0, 8.0])
)
_TYPES = st.sampled_from(["", "a", "b"])
_DEADLINES = st.sampled_from([0.0, 5.0])
_DELAYS = st.sampled_from([0.0, 0.0, 2.0, 15.0])
_FIXED_RATE = st.booleans()
_PLANS = st.sampled_from(Plan)
#: Scripts lean to failures: retries, backoff and decisions need them in a row.
_SCRIPTS = st.lists(st.sampled_from([*Plan, Plan.ERROR, Plan.ERROR]), max_size=3).map(tuple)
_THEN = st.sampled_from([Plan.OK, Plan.SLOW, Plan.LONG, Plan.HANG])


@st.composite
def _env_specs(draw: st.DrawFn) -> EnvSpec:
    periodic = draw(_PERIODIC)
    policy = draw(_POLICIES)
    retry_after, (attempts, base, cap) = 2.0, (3, 1.0, 4.0)
    if policy is Policy.RETRY_AFTER:
        retry_after = draw(_RETRY_AFTER)
    elif policy is Policy.RETRY:
        attempts, base, cap = draw(_RETRY)
    return EnvSpec(
        type=draw(_TYPES),
        interval=draw(_INTERVALS) if periodic else 0.0,
        deadline=draw(_DEADLINES),
        delay=draw(_DELAYS),
        fixed_rate=periodic and draw(_FIXED_RATE),
        policy=policy,
        retry_after=retry_after,
        attempts=attempts,
        base=base,
        cap=cap,
        script=draw(_SCRIPTS),
        then=draw(_THEN),
    )


_ENV_SPECS = _env_specs()


def env_specs() -> st.SearchStrategy[EnvSpec]:
    """One-off and periodic envelopes (interval > deadline), with or without a
    deadline, a first delay, a type, a failure policy and a script."""
    return _ENV_SPECS


@attrs.frozen
class QueueConfig:
    """The constructor arguments of the queue under test."""

    workers: int = 1
    #: 0 = unlimited.
    capacity: int = 0
    stop_mode: envq.StopMode = envq.StopMode.DRAIN
    wait: bool = True


def queue_configs() -> st.SearchStrategy[QueueConfig]:
    return st.builds(
        QueueConfig,
        workers=st.sampled_from([1, 1, 2, 3]),
        capacity=st.sampled_from([0, 2, 3, 5]),
        stop_mode=st.sampled_from(envq.StopMode),
        wait=st.booleans(),
    )


@attrs.frozen
class StopCall:
    """The arguments of one ``Queue.stop`` call (``None`` = the queue's default)."""

    mode: envq.StopMode | None = None
    cancel: bool = False
    wait: bool | None = None


def stop_calls() -> st.SearchStrategy[StopCall]:
    """Every combination, including the invalid ``cancel=True`` with DRAIN."""
    return st.builds(
        StopCall,
        mode=st.sampled_from([None, envq.StopMode.DRAIN, envq.StopMode.STOP]),
        cancel=st.booleans(),
        wait=st.sampled_from([None, True, False]),
    )


def plans() -> st.SearchStrategy[Plan]:
    return _PLANS


def releases() -> st.SearchStrategy[Plan]:
    return st.sampled_from(HANG_RELEASES)


def small_steps() -> st.SearchStrategy[float]:
    """Steps that end inside a deadline or a SLOW attempt, or just past one."""
    return st.sampled_from([0.5, 1.0, 3.0, 5.0])


def large_steps() -> st.SearchStrategy[float]:
    """Steps past first delays, retries and intervals."""
    return st.sampled_from([7.0, 20.0, 100.0])


def send_wait_timeouts() -> st.SearchStrategy[float]:
    return st.sampled_from([0.5, 4.0, 30.0])


def bad_items() -> st.SearchStrategy[object]:
    """Things that are not envelopes."""
    return st.sampled_from([None, 42, "not an envelope", b"bytes"])
