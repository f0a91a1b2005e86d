"""The stateful conformance machine: Hypothesis generates commands for a port.

:func:`make_machine` builds a ``RuleBasedStateMachine`` whose rules are the
protocol's commands — only those the port declared it supports — each carried out by
a :class:`~envq.conform.harness.Harness`, which checks it against the oracle; after
every step the invariants are checked against the port's statistics. When a check
fails, Hypothesis shrinks the run to a short counterexample; the harness of the run
under way is kept in :attr:`Recorder.harness`, and its command log is the script that
``envq conform --replay`` plays back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, NoReturn, TypeAlias

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from envq._machine import EnvState, QueueState
from envq.conform.harness import Harness
from envq.conform.oracle import Coverage, Violation
from envq.conform.protocol import EnvSpec, Plan, QueueConfig, StopCall
from envq.conform.strategies import Profile
from envq.conform.transport import Driver, DriverCrashed

__all__ = ["DriverFailed", "Recorder", "make_machine"]

QS = QueueState

#: A rule's body: the machine, and the rule's drawn arguments by name.
_Step: TypeAlias = Callable[..., None]


class DriverFailed(BaseException):
    """Ends a generated run at once: the driver crashed, hung or answered out of the
    protocol. Not an ``Exception``, so that Hypothesis does not take it for a failing
    example to replay and shrink (a driver that crashes now and then would not crash
    the same way again, and the crash would be lost in a report of flakiness). Met
    while Hypothesis replays an earlier failure, it may still come out as a
    ``Flaky`` error: the runner reads the failure from :attr:`Recorder.failure`."""

    def __init__(self, crash: DriverCrashed, script: tuple[dict[str, Any], ...]) -> None:
        super().__init__(str(crash))
        self.crash = crash
        #: The commands sent in this run, the last one the one that failed.
        self.script = script


@attrs.define
class Recorder:
    """The harness of the run under way (its command log is the run's script), and
    the violations set aside (ignored or declared) in every run so far."""

    harness: Harness | None = None
    known: list[Violation] = attrs.Factory(list)
    #: The first violation raised in this run, with the script that led to it.
    first: tuple[Violation, tuple[dict[str, Any], ...]] | None = None
    #: The driver's first failure in this run, with the script that led to it.
    failure: tuple[DriverCrashed, tuple[dict[str, Any], ...]] | None = None

    def raised(self, violation: Violation, script: tuple[dict[str, Any], ...]) -> None:
        """Keep the run's first violation (see :attr:`first`)."""
        if self.first is None:
            self.first = (violation, script)

    def crashed(self, crash: DriverCrashed, script: tuple[dict[str, Any], ...]) -> NoReturn:
        """Keep the driver's first failure (see :attr:`failure`) and end the run (see
        :class:`DriverFailed`)."""
        if self.failure is None:
            self.failure = (crash, script)
        raise DriverFailed(crash, script) from crash


def make_machine(
    connect: Callable[[], Driver],
    profile: Profile,
    recorder: Recorder,
    *,
    hello: dict[str, Any] | None = None,
    ignore: Iterable[str] = (),
    coverage: Coverage | None = None,
) -> type[RuleBasedStateMachine]:
    """The conformance machine for one port.

    :param connect: starts a driver session (one per Hypothesis run).
    :param profile: what to generate (the port's features and clock).
    :param recorder: where each run's harness is kept.
    :param hello: extra fields of the ``hello`` command (``time_scale``).
    :param ignore: violations not to report (see :func:`envq.conform.harness.matches`).
    :param coverage: where the checks and rows exercised are counted, across runs.
    """
    has = profile.has
    ignored = frozenset(ignore)

    def only_if(condition: Callable[[Any], bool]) -> Callable[[_Step], _Step]:
        """A rule that applies only in some states of the queue. On a virtual clock,
        a precondition. On the real clock the state after a step depends on timing as
        well as on the steps, and Hypothesis requires that the same choices lead to the
        same draws (it stops a run whose draws differ on the same path: a precondition
        that held the first time and not the next changes which rules are drawn); there
        the rule is always drawn and does nothing when the state does not fit."""
        if not profile.real_clock:
            return precondition(condition)

        def checked(step: _Step) -> _Step:
            @functools.wraps(step)
            def when_it_applies(self: Any, **arguments: Any) -> None:
                if condition(self):
                    step(self, **arguments)

            return when_it_applies

        return checked

    class ConformMachine(RuleBasedStateMachine):
        """Drives one port's queue beside the oracle."""

        envelopes: ClassVar[Bundle[str]] = Bundle("envelopes")

        def __init__(self) -> None:
            super().__init__()
            try:
                driver = connect()
            except DriverCrashed as exc:
                recorder.crashed(exc, ())
            try:
                self.h = self._harness(driver)
            except BaseException:
                with contextlib.suppress(Exception):
                    driver.close()
                raise
            recorder.harness = self.h
            self.made = 0

        def _harness(self, driver: Driver) -> Harness:
            return Harness(
                driver,
                hello=hello,
                real_clock=profile.real_clock,
                ignore=ignored,
                coverage=coverage,
                features=profile.features,
                known=recorder.known,
                on_violation=recorder.raised,
                on_crash=recorder.crashed,
            )

        def _make(self, spec: EnvSpec) -> str:
            self.made += 1
            name = f"e{self.made}"
            self.h.define(name, spec)
            return name

        def teardown(self) -> None:
            self.h.close()

        @initialize(
            target=envelopes,
            config=profile.queue_configs(),
            initial=st.lists(profile.env_specs(), min_size=1, max_size=4),
            started=st.sampled_from([True, True, True, False]) if has("buffer") else st.just(True),
        )
        def make_queue(
            self, config: QueueConfig, initial: list[EnvSpec], started: bool
        ) -> MultipleResults[str]:
            """The queue under test, with a first batch (buffered if not started)."""
            self.h.queue(config)
            if started:
                self.h.start()
            names = [self._make(spec) for spec in initial]
            self.h.send(names)
            return multiple(*names)

        @rule()
        @only_if(lambda self: self.h.oracle.life is QS.TERMINATED)
        def renew(self) -> None:
            """A new queue (same configuration) replaces a terminated one."""
            self.h.queue(self.h.oracle.config)

        @rule()
        @only_if(lambda self: has("restart") or self.h.oracle.life is not QS.STOPPED)
        def start(self) -> None:
            """``start()``."""
            self.h.start()

        @rule(call=profile.stop_calls())
        def stop(self, call: StopCall) -> None:
            """``stop(mode, cancel, wait)``."""
            self.h.stop(call)

        @rule(call=profile.stop_calls())
        @only_if(
            lambda self: (
                self.h.oracle.life is QS.RUNNING and bool(self.h.oracle.in_state(EnvState.RUNNING))
            )
        )
        def stop_while_busy(self, call: StopCall) -> None:
            """``stop()`` with attempts in flight (the cells random timing rarely reaches)."""
            self.h.stop(call)

        @rule()
        @only_if(lambda self: self.h.oracle.life in (QS.STOPPING, QS.STOPPED, QS.TERMINATED))
        def wait_stopped(self) -> None:
            """``wait_stopped()``."""
            self.h.wait_stopped()

        @rule()
        @only_if(lambda self: has("terminate_handback") or not self.h.oracle.blocked())
        def terminate(self) -> None:
            """``terminate()``."""
            self.h.terminate()

        @rule(
            target=envelopes,
            specs=st.lists(profile.env_specs(), min_size=1, max_size=4),
            repeat=st.booleans() if has("dedup") else st.just(False),
        )
        def send(self, specs: list[EnvSpec], repeat: bool) -> MultipleResults[str]:
            """New envelopes in one batch, maybe naming one twice (admitted once)."""
            names = [self._make(spec) for spec in specs]
            self.h.send([*names, names[0]] if repeat else names)
            return multiple(*names)

        # Rules for optional features exist only when the port declared them (a
        # precondition would be evaluated, and cost, at every step).
        if has("dedup"):

            @rule(env=envelopes)
            def resend(self, env: str) -> None:
                """Send an envelope again: live here (dedup), terminal (a new stay), or
                live in the other queue (refused)."""
                self.h.send([env])

        if has("send_wait"):

            @rule(
                target=envelopes,
                specs=st.lists(profile.env_specs(), min_size=1, max_size=2),
                timeout=profile.send_wait_timeouts(),
            )
            def send_wait(self, specs: list[EnvSpec], timeout: float) -> MultipleResults[str]:
                """A producer waiting (at most ``timeout``) for room for its batch."""
                names = [self._make(spec) for spec in specs]
                self.h.send_wait(names, timeout)
                return multiple(*names)

        if has("foreign"):

            @rule(env=envelopes)
            def lend(self, env: str) -> None:
                """Send an envelope to the second queue."""
                self.h.lend(env)

            @rule()
            @only_if(lambda self: bool(self.h.oracle.lent))
            def reclaim(self) -> None:
                """Terminate the second queue."""
                self.h.reclaim()

        @rule(env=envelopes, plan=profile.plans())
        def plan(self, env: str, plan: Plan) -> None:
            """Choose what a later attempt of this envelope does."""
            self.h.plan(env, plan)

        @rule(index=st.integers(0, 3), then=profile.releases())
        @only_if(lambda self: bool(self.h.oracle.hanging()))
        def release(self, index: int, then: Plan) -> None:
            """Let a hanging attempt finish with the given plan."""
            hanging = self.h.oracle.hanging()
            self.h.release(hanging[index % len(hanging)], then)

        @rule(dt=profile.small_steps())
        def tick(self, dt: float) -> None:
            """Let a little time pass: inside deadlines and SLOW attempts."""
            self.h.advance(dt)

        @rule(dt=profile.large_steps())
        def advance(self, dt: float) -> None:
            """Let much time pass: past intervals, retries and delays."""
            self.h.advance(dt)

        @invariant()
        def invariants_hold(self) -> None:
            """The invariants, against the port's statistics."""
            if not self.h.closed:
                self.h.stats()

    return ConformMachine
