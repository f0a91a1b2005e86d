"""Shared Hypothesis strategies for envq's tests.

The values here are plain descriptions, not live objects: a test turns an
:class:`EnvSpec` into an ``envq.Envelope`` with its own ``invoke``, so that Hypothesis
can print, replay and shrink them. The descriptions themselves (:class:`Plan`,
:class:`Policy`, :class:`EnvSpec`, :class:`QueueConfig`, :class:`StopCall` and the
attempt durations) are the driver protocol's, re-exported from
:mod:`envq.conform.protocol`; only the strategies live here.

All durations are small dyadic numbers (0.5, 1, 2, 3, …): sums and differences of them
are exact in binary floating point, so a model can predict the loop times the engine
computes without tolerance games.

The queue, the stop calls, the steps and the waits are drawn as ``envq conform`` draws
them for a port that declares every feature (:class:`envq.conform.strategies.Profile`).
Envelope specs are not: the conformance runs draw them from a fixed pool (cheap to
draw, one choice each), while the tests draw them field by field, so that any
combination can come up and Hypothesis shrinks each field on its own.
"""

from __future__ import annotations

from hypothesis import strategies as st

from envq.conform.protocol import (
    FEATURES,
    HANG_RELEASES,
    LONG_SECONDS,
    SHARED_STORE_FEATURES,
    SLOW_SECONDS,
    EnvSpec,
    Plan,
    Policy,
    QueueConfig,
    StopCall,
)
from envq.conform.strategies import Profile

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

#: A port on a virtual clock with every optional feature an in-process queue can have:
#: what envq itself is.
_ENVQ = Profile(features=frozenset(FEATURES) - SHARED_STORE_FEATURES)

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
_PLANS = _ENVQ.plans()
#: Scripts lean to failures: retries, backoff and decisions need them in a row.
_SCRIPTS = st.lists(st.sampled_from([*Plan, Plan.ERROR, Plan.ERROR]), max_size=3).map(tuple)
_THEN = st.sampled_from([Plan.OK, Plan.SLOW, Plan.LONG, Plan.HANG])
_ON_SUCCESS = st.booleans()


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
        on_success=draw(_ON_SUCCESS),
    )


_ENV_SPECS = _env_specs()
_QUEUE_CONFIGS = _ENVQ.queue_configs()
_STOP_CALLS = _ENVQ.stop_calls()
_RELEASES = _ENVQ.releases()
_SMALL_STEPS = _ENVQ.small_steps()
_LARGE_STEPS = _ENVQ.large_steps()
_SEND_WAIT_TIMEOUTS = _ENVQ.send_wait_timeouts()


def env_specs() -> st.SearchStrategy[EnvSpec]:
    """One-off and periodic envelopes (interval > deadline), with or without a
    deadline, a first delay, a type, a failure policy, a script and an on_success
    hook."""
    return _ENV_SPECS


def queue_configs() -> st.SearchStrategy[QueueConfig]:
    """The queue under test's constructor arguments (``stop_mode`` by value)."""
    return _QUEUE_CONFIGS


def stop_calls() -> st.SearchStrategy[StopCall]:
    """Every combination, including the invalid ``cancel=True`` with DRAIN (``mode``
    by value, None = the queue's default)."""
    return _STOP_CALLS


def plans() -> st.SearchStrategy[Plan]:
    """What a later attempt does."""
    return _PLANS


def releases() -> st.SearchStrategy[Plan]:
    """What a released HANG attempt does next."""
    return _RELEASES


def small_steps() -> st.SearchStrategy[float]:
    """Steps that end inside a deadline or a SLOW attempt, or just past one."""
    return _SMALL_STEPS


def large_steps() -> st.SearchStrategy[float]:
    """Steps past first delays, retries and intervals."""
    return _LARGE_STEPS


def send_wait_timeouts() -> st.SearchStrategy[float]:
    """How long a producer waits for room."""
    return _SEND_WAIT_TIMEOUTS


def bad_items() -> st.SearchStrategy[object]:
    """Things that are not envelopes."""
    return st.sampled_from([None, 42, "not an envelope", b"bytes"])
