"""Hypothesis strategies for conformance runs (and envq's own stateful tests).

The values are plain descriptions (:class:`~envq.conform.protocol.EnvSpec` and the
like): the harness turns them into protocol commands, so Hypothesis can print, replay
and shrink them. Durations are small dyadic numbers (0.5, 1, 2, 3, …): their sums and
differences are exact in binary floating point, so the oracle predicts the times a
port computes without tolerance games on a virtual clock.

A :class:`Profile` narrows the strategies to what a port declared it supports, and for
a port on the real clock keeps attempts and waits short.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs
from hypothesis import strategies as st

from envq.conform.protocol import HANG_RELEASES, EnvSpec, Plan, Policy, QueueConfig, StopCall

__all__ = ["Profile"]


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
            deadlines=[0.0, 5.0] if self.has("deadline") else [0.0],
            delays=[0.0, 0.0, 2.0, 15.0] if self.has("delay") else [0.0],
            types=["", "a", "b"],
            policies=policies,
            script_plans=script_plans,
            thens=thens,
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


def _env_specs(
    *,
    periodic: bool,
    fixed_rate: bool,
    deadlines: Collection[float],
    delays: Collection[float],
    types: Collection[str],
    policies: Collection[Policy],
    script_plans: Collection[Plan],
    thens: Collection[Plan],
) -> st.SearchStrategy[EnvSpec]:
    intervals = st.sampled_from([10.0, 25.0])
    retry = st.tuples(
        st.sampled_from([-1, 1, 2, 4]),
        st.sampled_from([0.5, 1.0, 4.0]),
        st.sampled_from([2.0, 8.0]),
    )
    scripts = st.lists(st.sampled_from(list(script_plans)), max_size=3).map(tuple)

    @st.composite
    def build(draw: st.DrawFn) -> EnvSpec:
        is_periodic = periodic and draw(st.booleans())
        policy = draw(st.sampled_from(list(policies)))
        retry_after, (attempts, base, cap) = 2.0, (3, 1.0, 4.0)
        if policy is Policy.RETRY_AFTER:
            retry_after = draw(st.sampled_from([0.5, 2.0, 12.0]))
        elif policy is Policy.RETRY:
            attempts, base, cap = draw(retry)
        return EnvSpec(
            type=draw(st.sampled_from(list(types))),
            interval=draw(intervals) if is_periodic else 0.0,
            deadline=draw(st.sampled_from(list(deadlines))),
            delay=draw(st.sampled_from(list(delays))),
            fixed_rate=is_periodic and fixed_rate and draw(st.booleans()),
            policy=policy,
            retry_after=retry_after,
            attempts=attempts,
            base=base,
            cap=cap,
            script=draw(scripts),
            then=draw(st.sampled_from(list(thens))),
        )

    return build()
