"""The narrator: one event listener that tells what the queue does, line by line.

Every state change of the queue and of its envelopes reaches :meth:`Narrator.on_event`
(given to ``Queue.subscribe``); the ones worth a line are printed with what caused them
(the error, the retry delay, the time left to wait). It also keeps the tally the final
check holds against ``Queue.statistics()``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import envq
from envq import Envelope, EnvState, Event, Outcome
from envq.demo.output import Output, error_text, label
from envq.demo.workload import Collector, Mail

__all__ = ["Narrator", "Tally"]

#: The failures the Retry policy decides: their next delay is its backoff.
_FAILED = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.EXPIRED})


@dataclass
class _Track:
    """What the narrator remembers of one envelope."""

    attempts: int = 0
    started: float = 0.0
    #: Loop time a DELAYED envelope is due.
    due: float = 0.0
    #: Seconds a PARKED envelope still had to wait.
    left: float = 0.0


@dataclass
class Tally:
    """Envelopes admitted, and envelopes ended in each terminal state, as the events
    told them."""

    admitted: int = 0
    terminal: dict[EnvState, int] = field(default_factory=dict)


class Narrator:
    """Prints the queue's state changes to ``out``."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.track: dict[Envelope, _Track] = {}
        self.tally = Tally()
        #: Lines held back until the event that caused them is printed.
        self.deferred: list[str] = []
        #: Set once an attempt has blacklisted its type (StopType).
        self.blacklisted = asyncio.Event()

    def _next_delay(self, env: Envelope, outcome: Outcome | None, attempt: int) -> float:
        if outcome is Outcome.CANCELLED:
            return 0.0
        if env.periodic:
            return env.interval
        if outcome in _FAILED and env.retry is not None:
            return env.retry.delay(attempt)
        return 0.0

    def on_event(self, ev: Event) -> None:
        """Print one state change (the listener given to ``Queue.subscribe``)."""
        at = ev.time - self.out.t0
        env = ev.envelope
        if env is None:
            self.out.line(
                f"{'queue ' + ev.queue:<13} {ev.from_state.name} -> {ev.to_state.name}",
                at,
            )
            return
        assert isinstance(ev.to_state, EnvState)
        to = ev.to_state
        frm = ev.from_state
        tr = self.track.setdefault(env, _Track())
        if to in (EnvState.SUCCEEDED, EnvState.FAILED, EnvState.STOPPED, EnvState.RETURNED):
            self.tally.terminal[to] = self.tally.terminal.get(to, 0) + 1
        if frm is EnvState.NEW:  # admission (docs/decisions.md: NEW, not None)
            self.tally.admitted += 1
            tr.due = ev.time + env.delay
            return
        if frm is EnvState.RUNNING:
            self._attempt_ended(ev, env, tr, at)
        elif to is EnvState.RUNNING:
            tr.attempts += 1
            tr.started = ev.time
            return
        elif to is EnvState.PARKED:
            tr.left = max(0.0, tr.due - ev.time) if frm is EnvState.DELAYED else 0.0
            self._print(env, frm, to, f"parked with {tr.left:.2f}s left to wait", at)
        elif frm is EnvState.PARKED and to in (EnvState.READY, EnvState.DELAYED):
            tr.due = ev.time + tr.left
            self._print(
                env, frm, to, f"re-armed: due in {tr.left:.2f}s (the delay it had left)", at
            )
        elif to is EnvState.STOPPED:
            # Blacklist victims are stopped just before the culprit's own event: print
            # them after it, so the story reads in cause-and-effect order.
            self.deferred.append(
                self._fmt(env, frm, to, f"stopped: type {env.type!r} is blacklisted", at)
            )
            return
        elif to is EnvState.RETURNED:
            self._print(env, frm, to, "handed back by terminate()", at)
        else:  # DELAYED -> READY and the like: not worth a line
            return
        self.out.emit("".join(self.deferred))
        self.deferred.clear()

    def _attempt_ended(self, ev: Event, env: Envelope, tr: _Track, at: float) -> None:
        to = ev.to_state
        assert isinstance(to, EnvState)
        outcome = ev.outcome
        took = ev.time - tr.started
        after = self._next_delay(env, outcome, tr.attempts)
        if to is EnvState.DELAYED:
            tr.due = ev.time + after
        elif to is EnvState.PARKED:
            tr.left = after
        match outcome:
            case Outcome.OK if env.periodic:
                col: Collector = env.payload
                what = f"run {col.runs} ok: {col.sample}"
            case Outcome.OK:
                mail: Mail = env.payload
                what = f"delivered to {mail.to} (attempt {tr.attempts}, {took:.2f}s)"
            case Outcome.TIMEOUT if env.periodic:
                col = env.payload
                what = f"run {col.runs} TIMEOUT: overran its {env.deadline:g}s deadline"
            case _ if outcome in _FAILED and isinstance(ev.cause, envq.MaxRetriesExceeded):
                what = (
                    f"gave up after {tr.attempts} attempts: MaxRetriesExceeded"
                    f" (last error: {ev.cause.__cause__})"
                )
            case Outcome.ERROR | Outcome.TIMEOUT:
                what = f"error: {ev.cause} (attempt {tr.attempts})"
            case Outcome.EXPIRED:
                what = f"lease expired before the attempt ended (attempt {tr.attempts})"
            case Outcome.NO_RETRY:
                what = f"no retry: {error_text(ev.cause)}"
            case Outcome.STOP_TYPE:
                what = f"{error_text(ev.cause)} -> type {env.type!r} blacklisted"
                self.blacklisted.set()
            case Outcome.STOP:
                what = f"stopped: {error_text(ev.cause)}"
            case Outcome.CANCELLED:
                what = "attempt cancelled"
            case _:
                what = f"outcome {outcome}"
        if to is EnvState.DELAYED:
            what += f", {'next run' if env.periodic else 'retry'} in {after:.2f}s"
        elif to is EnvState.PARKED:
            what += f"; parked with {after:.2f}s left (the queue is not running)"
        if env.periodic and to is EnvState.DELAYED and outcome is Outcome.OK:
            self.out.line(f"{label(env):<13} {what}", at)  # the routine runs: one short line
            return
        self._print(env, ev.from_state, to, what, at)

    def _fmt(self, env: Envelope, frm: object, to: EnvState, what: str, at: float) -> str:
        name = frm.name if isinstance(frm, EnvState) else "-"
        moves = f"{name} -> {to.name}"
        return f"[{at:5.2f}s] {label(env):<13} {moves:<21} {what}\n"

    def _print(self, env: Envelope, frm: object, to: EnvState, what: str, at: float) -> None:
        self.out.emit(self._fmt(env, frm, to, what, at))
