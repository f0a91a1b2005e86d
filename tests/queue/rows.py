"""The harness of the row tests (``test_lifecycle_rows.py``, ``test_table_rows.py``):
a ``World`` (a queue, its events and the hooks it called) running scripted attempts,
with a virtual-time bound on every wait."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import envq
import envq._attempt
from envq import EnvState, Outcome, QueueState, StopMode
from tests.support import Recorder, now

T = TypeVar("T")
ES = EnvState
QS = QueueState
STOP, DRAIN = StopMode.STOP, StopMode.DRAIN
#: Virtual seconds a test waits for something before failing (fast: virtual time).
PATIENCE = 1_000.0

#: No test here runs an envelope more often than this.
MAX_RUNS = 20

#: What an attempt does: a name, or ("sleep", seconds, then) / ("wait", event, then).
Step = Any


class LeaseExpired(Exception):
    """The ``"expired"`` step: told EXPIRED under :func:`tell_expired`."""


def tell_expired(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine tell a :class:`LeaseExpired` attempt EXPIRED, as a store shared
    by several processes tells an attempt whose lease expired. One process has no
    lease, so nothing else makes the outcome; with this stand-in the rows of EXPIRED
    are run by the same outcome interpreter as every other row."""
    signals = (*envq._attempt._SIGNALS, (LeaseExpired, Outcome.EXPIRED))
    monkeypatch.setattr(envq._attempt, "_SIGNALS", signals)


async def within(aw: Awaitable[T], seconds: float = PATIENCE) -> T:
    """Await with a virtual-time bound: a mutant that hangs fails at once."""
    async with asyncio.timeout(seconds):
        return await aw


async def advance(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def perform(step: Step) -> None:
    """Do one scripted attempt step."""
    if isinstance(step, tuple):
        how, arg, then = step
        if how == "sleep":
            await asyncio.sleep(arg)
        else:
            await arg.wait()
        await perform(then)
        return
    match step:
        case "ok":
            return
        case "error":
            raise ValueError("scripted error")
        case "hang":  # until the deadline or a cancel
            await asyncio.sleep(1e9)
        case "stop":
            raise envq.StopEnvelope()
        case "stop_type":
            raise envq.StopType()
        case "no_retry":
            raise envq.DoNotRetry()
        case "expired":  # EXPIRED under tell_expired
            raise LeaseExpired()
        case _:
            raise AssertionError(f"unknown step {step!r}")


class World(Recorder):
    """A queue with a log of its events (a ``Recorder`` of it, waiting at most
    ``PATIENCE`` virtual seconds) and of the hooks it called."""

    patience = PATIENCE

    def __init__(self, **options: Any) -> None:
        options.setdefault("workers", 1)
        self.q = envq.Queue("rows", **options)
        self.hooks: list[tuple[Any, ...]] = []
        super().__init__(self.q)

    def env(
        self,
        name: str,
        *steps: Step,
        decisions: Iterator[envq.Decision | None] | None = None,
        hooks: bool = True,
        **fields: Any,
    ) -> envq.Envelope:
        """An envelope whose n-th attempt does ``steps[n]`` ("ok" once they run out).

        With ``hooks``, on_success / on_failure are recorded; on_failure answers the
        next of ``decisions`` (drop when they run out).
        """
        script = list(steps)
        answers = iter(decisions or ())

        async def invoke(env: envq.Envelope) -> None:
            self.hooks.append(("run", name, now()))
            if len(self.runs(name)) > MAX_RUNS:
                # A wrong row can re-run an envelope forever at one instant, which no
                # virtual-time bound ends: hang instead, so the test's bound fails it.
                await asyncio.sleep(1e9)
            await perform(script.pop(0) if script else "ok")

        async def on_success(env: envq.Envelope) -> None:
            self.hooks.append(("success", name))

        async def on_failure(
            env: envq.Envelope, exc: BaseException | None, attempt: int
        ) -> envq.Decision | None:
            self.hooks.append(("failure", name, type(exc).__name__, attempt))
            return next(answers, None)

        if hooks:
            fields.setdefault("on_success", on_success)
            fields.setdefault("on_failure", on_failure)
        return envq.Envelope(invoke=invoke, id=name, **fields)

    def path(self, env: envq.Envelope) -> list[str]:
        """The envelope's moves as ``FROM>TO`` or ``FROM>TO/OUTCOME``."""
        return [
            f"{e.from_state.name}>{e.to_state.name}" + (f"/{e.outcome.name}" if e.outcome else "")
            for e in self.events
            if e.envelope is env
        ]

    def timed(self, env: envq.Envelope) -> list[tuple[str, float]]:
        return [
            (f"{e.from_state.name}>{e.to_state.name}", e.time)
            for e in self.events
            if e.envelope is env
        ]

    def queue_path(self) -> list[str]:
        return [f"{e.from_state.name}>{e.to_state.name}" for e in self.events if e.envelope is None]

    def runs(self, name: str) -> list[float]:
        return [h[2] for h in self.hooks if h[0] == "run" and h[1] == name]

    def called(self) -> list[tuple[Any, ...]]:
        """The hook calls (not the runs)."""
        return [h for h in self.hooks if h[0] != "run"]

    def cause(self, env: envq.Envelope) -> BaseException | None:
        return [e for e in self.events if e.envelope is env][-1].cause

    def by_state(self) -> dict[EnvState, int]:
        return {s: n for s, n in self.q.statistics().by_state.items() if n}

    def outcomes(self) -> dict[Outcome, int]:
        """How many attempts ended with each outcome (statistics)."""
        return {o: n for o, n in self.q.statistics().outcomes.items() if n}

    def attempt_ends(self, env: envq.Envelope) -> list[envq.Event]:
        """The events that ended an attempt of ``env`` (they carry an outcome)."""
        return [e for e in self.events if e.envelope is env and e.outcome is not None]


def reject_type(call: Callable[[], object], error: type[Exception]) -> None:
    """``call()`` raises exactly ``error`` (not a subclass or a sibling)."""
    with pytest.raises(envq.EnvqError) as info:
        call()
    assert type(info.value) is error, info.value


async def areject_type(aw: Awaitable[object], error: type[Exception]) -> None:
    with pytest.raises(envq.EnvqError) as info:
        await aw
    assert type(info.value) is error, info.value
