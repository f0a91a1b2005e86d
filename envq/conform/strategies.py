"""Hypothesis strategies for conformance runs (and envq's own stateful tests).

The values are plain descriptions (:class:`~envq.conform.protocol.EnvSpec` and the
like): the harness turns them into protocol commands, so Hypothesis can print, replay
and shrink them. Durations are small dyadic numbers (0.5, 1, 2, 3, …): their sums and
differences are exact in binary floating point, so the oracle predicts the times a
port computes without tolerance games on a virtual clock.

A :class:`Profile` narrows the strategies to what a port declared it supports, and for
a port on the real clock keeps attempts and waits short. Nothing is generated for the
features of a store several processes share (``SHARED_STORE_FEATURES``): no plan makes
an attempt's lease expire, so an ``expired`` outcome is never asked for, only checked
when a port that declares ``leases`` reports it.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import Any, Final

import attrs
from hypothesis import strategies as st

from envq.conform.protocol import HANG_RELEASES, EnvSpec, Plan, Policy, QueueConfig, StopCall

__all__ = ["POOL_SIZE", "Profile", "spec_pool"]

#: How many distinct envelope specs a run draws from.
POOL_SIZE: Final = 400


@attrs.frozen
class Profile:
    """What to generate: the port's features, and whether its clock is real."""

    features: frozenset[str] = frozenset()
    real_clock: bool = False

    def has(self, feature: str) -> bool:
        """Whether the port declared ``feature``."""
        return feature in self.features

    # -- envelopes --------------------------------------------------------------------

    def plans(self) -> st.SearchStrategy[Plan]:
        """Scripted plans the port can carry out."""
        return st.sampled_from(self._plans())

    def _plans(self) -> list[Plan]:
        plans = [Plan.OK, Plan.SLOW, Plan.ERROR, Plan.HANG]
        if not self.real_clock:
            plans.append(Plan.LONG)
        if self.has("stop_envelope"):
            plans.append(Plan.STOP)
        if self.has("stop_type"):
            plans.append(Plan.STOP_TYPE)
        if self.has("no_retry"):
            plans.append(Plan.NO_RETRY)
        return plans

    def releases(self) -> st.SearchStrategy[Plan]:
        """What a released HANG attempt may do next."""
        allowed = set(self._plans())
        return st.sampled_from([p for p in HANG_RELEASES if p in allowed])

    def env_specs(self) -> st.SearchStrategy[EnvSpec]:
        """One-off and (if declared) periodic envelopes, with or without a deadline,
        a first delay, a type, a failure policy and a script."""
        policies = [Policy.NONE]
        if self.has("on_failure"):
            policies += [
                Policy.DROP,
                Policy.DECIDE_NONE,
                Policy.RETRY_NOW,
                Policy.RETRY_AFTER,
                Policy.CRASH,
            ]
        if self.has("retry_policy"):
            policies.append(Policy.RETRY)
        failures = [Plan.ERROR, Plan.ERROR]
        script_plans = [*self._plans(), *failures]
        thens = [Plan.OK, Plan.SLOW, Plan.HANG] + ([] if self.real_clock else [Plan.LONG])
        return _env_specs(
            periodic=self.has("periodic"),
            fixed_rate=self.has("fixed_rate"),
            cron=self.has("cron"),
            deadlines=[0.0, 5.0] if self.has("deadline") else [0.0],
            delays=[0.0, 0.0, 2.0, 15.0] if self.has("delay") else [0.0],
            types=["", "a", "b"],
            policies=policies,
            script_plans=script_plans,
            thens=thens,
            on_success=self.has("on_success"),
        )

    # -- the queue and calls ----------------------------------------------------------

    def queue_configs(self) -> st.SearchStrategy[QueueConfig]:
        """The queue under test's constructor arguments."""
        return st.builds(
            QueueConfig,
            workers=st.sampled_from([1, 1, 2, 3]),
            capacity=st.sampled_from([0, 2, 3, 5]),
            stop_mode=st.sampled_from(["drain", "stop"] if self.has("stop_modes") else ["drain"]),
            wait=st.booleans() if self.has("stop_nowait") else st.just(True),
        )

    def stop_calls(self) -> st.SearchStrategy[StopCall]:
        """Every combination the port supports, the invalid cancel-with-DRAIN included."""
        modes: list[str | None] = [None]
        if self.has("stop_modes"):
            modes += ["drain", "stop"]
        return st.builds(
            StopCall,
            mode=st.sampled_from(modes),
            cancel=st.booleans() if self.has("stop_cancel") else st.just(False),
            wait=st.sampled_from([None, True, False] if self.has("stop_nowait") else [None]),
        )

    def small_steps(self) -> st.SearchStrategy[float]:
        """Steps that end inside a deadline or a SLOW attempt, or just past one."""
        return st.sampled_from([0.5, 1.0, 3.0, 5.0])

    def large_steps(self) -> st.SearchStrategy[float]:
        """Steps past first delays, retries and intervals."""
        return st.sampled_from([7.0, 20.0] if self.real_clock else [7.0, 20.0, 100.0])

    def send_wait_timeouts(self) -> st.SearchStrategy[float]:
        """How long a producer waits for room."""
        return st.sampled_from([0.5, 4.0, 30.0])


#: The cron calendars generated (six fields, the first is seconds): every ten model
#: seconds, and twice a minute at uneven gaps.
CRON_EXPRS: Final = ("*/10 * * * * *", "5,30 * * * * *")


def _env_specs(**fields: Any) -> st.SearchStrategy[EnvSpec]:
    """The specs of :func:`spec_pool` (``fields``: its arguments), drawn with one
    choice each: a spec built field by field costs Hypothesis a dozen draws, which
    dominated a run."""
    ordered = spec_pool(**fields)

    def spec_number(index: int) -> EnvSpec:
        return ordered[index]

    # By index: sampled_from would spell out the whole pool in Hypothesis's reports.
    return st.integers(0, len(ordered) - 1).map(spec_number)


def spec_pool(
    *,
    periodic: bool,
    fixed_rate: bool,
    cron: bool,
    deadlines: Collection[float],
    delays: Collection[float],
    types: Collection[str],
    policies: Collection[Policy],
    script_plans: Collection[Plan],
    thens: Collection[Plan],
    on_success: bool = False,
) -> list[EnvSpec]:
    """The envelope specs a run draws from (at most :data:`POOL_SIZE`), simplest first
    so that shrinking moves towards plain envelopes. With ``on_success``, about half
    of them (all but the plainest) have an on_success hook."""
    rng = random.Random(20261124)
    plans = sorted(script_plans, key=lambda p: list(Plan).index(p))
    # A dict, not a set: its order (insertion) does not depend on string hashing, so
    # --derandomize gives the same run in every process.
    pool: dict[EnvSpec, None] = {EnvSpec(): None}
    for _ in range(POOL_SIZE * 4):
        policy = rng.choice(sorted(policies, key=lambda p: list(Policy).index(p)))
        is_periodic = periodic and rng.random() < 0.4
        # Drawn only for a port that declares cron: the pools of the others stay as
        # they were.
        expr = rng.choice(CRON_EXPRS) if is_periodic and cron and rng.random() < 0.3 else ""
        attempts, base, cap = rng.choice(
            [(3, 1.0, 4.0), (-1, 0.5, 2.0), (1, 1.0, 8.0), (2, 4.0, 2.0), (4, 1.0, 8.0)]
        )
        pool.setdefault(
            EnvSpec(
                type=rng.choice(sorted(types)),
                interval=rng.choice([10.0, 25.0]) if is_periodic and not expr else 0.0,
                deadline=rng.choice(sorted(deadlines)),
                delay=rng.choice(sorted(delays)),
                fixed_rate=is_periodic and fixed_rate and rng.random() < 0.5 and not expr,
                cron=expr,
                policy=policy,
                retry_after=rng.choice([0.5, 2.0, 12.0]) if policy is Policy.RETRY_AFTER else 2.0,
                attempts=attempts if policy is Policy.RETRY else 3,
                base=base if policy is Policy.RETRY else 1.0,
                cap=cap if policy is Policy.RETRY else 4.0,
                script=tuple(rng.choice(plans) for _ in range(rng.randrange(4))),
                then=rng.choice(sorted(thens, key=lambda p: list(Plan).index(p))),
            ),
            None,
        )
        if len(pool) >= POOL_SIZE:
            break
    ordered = sorted(pool, key=_complexity)
    if on_success:
        # A generator of its own: the pool's other fields, and the pools of ports that
        # do not declare the feature, stay as they were.
        hooks = random.Random(20260512)
        ordered[1:] = [attrs.evolve(s, on_success=hooks.random() < 0.5) for s in ordered[1:]]
    return ordered


def _complexity(spec: EnvSpec) -> tuple[int, ...]:
    default = EnvSpec()
    changed = sum(
        getattr(spec, name) != getattr(default, name)
        for name in (
            "type",
            "interval",
            "deadline",
            "delay",
            "fixed_rate",
            "cron",
            "policy",
            "then",
        )
    )
    return (changed, len(spec.script), int(spec.interval), int(spec.deadline), int(spec.delay))
