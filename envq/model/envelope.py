"""The envelope state machine as a python-statemachine model, with the outcome table.

One instance is one envelope's stay in one queue. ``NEW`` is the pseudo-state "not in
the queue yet"; SUCCEEDED, FAILED, STOPPED and RETURNED are terminal: no event of the
queue or of an attempt leaves them, only an operator's (so python-statemachine's
``final`` is not declared for the first three, which an operator may retry or discard:
a final state may have no transition out). The model is
written from the contract, not generated from ``envq._machine``;
``tests/model/test_models.py`` proves it equal to ``ENVELOPE_MOVES`` (every state × event)
and to the outcome table ``OUTCOMES`` (every kind × outcome).

Events:

* queue-side: ``sent`` (``send()`` admitted or buffered it), ``start`` (``start()``
  arms buffered and parked envelopes), ``due`` (its wait is over), ``dispatch`` (a
  worker takes it), ``stop`` (the stop under way parks it: READY under
  ``StopMode.STOP``, DELAYED under any mode), ``terminate`` (``terminate()`` hands it
  back), ``blacklist`` (its ``type`` was blacklisted by a ``StopType``);
* an operator's moves: ``retry`` (an envelope that ended FAILED or STOPPED is sent
  back: as a sent one, buffered before the first start, and it never waits), ``cancel``
  (a live envelope not running ends STOPPED; a running one is relabelled, see the
  ``CANCELLED`` row group), ``discard`` (an ended envelope leaves the queue's keeping:
  back to NEW);
* ``attempt_<outcome>``: the attempt in flight ended with that :class:`Outcome`
  (the outcome table, one row group per :class:`Kind`).

The guards read the context of the move, set on the instance (:data:`Context`, the
runtime's ``Situation``): the row group (``kind``), the queue's lifecycle state,
whether the envelope must wait before its run (``wait``: ``delay``, ``not_before``, the
time left when parked), the failure decision, who cancelled the attempt, the mode of
the stop under way and whether the failure limiter makes a retry wait. For every context exactly one
transition of an event is enabled (proven in the tests), so the model is deterministic
given its context; the set of targets over all contexts is the runtime relation.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from statemachine import StateMachine
from statemachine.states import States

from envq._machine import (
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueState,
    Situation,
    StopMode,
)

__all__ = ["EVENTS", "Context", "EnvelopeModel"]


#: The guard valuation a model instance reads (``envq._machine.Situation``: the same
#: inputs the runtime tables are looked up with).
Context = Situation


class EnvelopeModel(StateMachine):
    """One envelope's states inside one queue, and the outcome table."""

    s = States.from_enum(EnvState, initial=EnvState.NEW, final={EnvState.RETURNED})

    # -- queue-side events (docs/lifecycle.md, docs/outcomes.md) ----------------------

    #: ``send()``: buffered before the first start (capacity reserved); admitted to a
    #: running queue: READY, or DELAYED when it must wait (``delay``, ``not_before``).
    sent = (
        s.NEW.to(s.BUFFERED, cond="before_start")
        | s.NEW.to(s.READY, unless=["before_start", "must_wait"])
        | s.NEW.to(s.DELAYED, cond="must_wait", unless="before_start")
    )
    #: ``start()`` arms buffered envelopes (docs/concepts.md, first run) and re-arms
    #: parked ones with the time they still had to wait (docs/lifecycle.md, Parking).
    start = (
        s.BUFFERED.to(s.READY, unless="must_wait")
        | s.BUFFERED.to(s.DELAYED, cond="must_wait")
        | s.PARKED.to(s.READY, unless="must_wait")
        | s.PARKED.to(s.DELAYED, cond="must_wait")
    )
    #: The wait is over.
    due = s.DELAYED.to(s.READY)
    #: A worker takes it: one attempt in flight.
    dispatch = s.READY.to(s.RUNNING)
    #: The stop under way parks it (docs/lifecycle.md, Stop modes): READY under STOP,
    #: DELAYED always.
    stop = s.READY.to(s.PARKED, cond="stop_mode_stop") | s.DELAYED.to(s.PARKED)
    #: ``terminate()`` hands back what is still held: buffered or parked (the stop that
    #: terminate begins with has parked the READY and DELAYED ones).
    terminate = s.BUFFERED.to(s.RETURNED) | s.PARKED.to(s.RETURNED)
    #: Its ``type`` was blacklisted (docs/outcomes.md, Blacklisting): every live one not
    #: RUNNING ends at once.
    blacklist = (
        s.BUFFERED.to(s.STOPPED)
        | s.READY.to(s.STOPPED)
        | s.DELAYED.to(s.STOPPED)
        | s.PARKED.to(s.STOPPED)
    )

    # -- an operator's moves (docs/operating.md) --------------------------------------

    #: Send an envelope that ended FAILED or STOPPED back: buffered before the first
    #: start, else READY (it ran before: it does not wait again).
    retry = (
        s.FAILED.to(s.BUFFERED, cond="before_start")
        | s.FAILED.to(s.READY, unless="before_start")
        | s.STOPPED.to(s.BUFFERED, cond="before_start")
        | s.STOPPED.to(s.READY, unless="before_start")
    )
    #: Cancel a live envelope: one not running ends STOPPED at once (a running one is
    #: relabelled CANCELLED: its attempt ends STOPPED whatever its outcome).
    cancel = (
        s.BUFFERED.to(s.STOPPED)
        | s.READY.to(s.STOPPED)
        | s.DELAYED.to(s.STOPPED)
        | s.PARKED.to(s.STOPPED)
    )
    #: An ended envelope leaves the queue's keeping (a RETURNED one was handed back:
    #: it is its sender's again).
    discard = s.SUCCEEDED.to(s.NEW) | s.FAILED.to(s.NEW) | s.STOPPED.to(s.NEW)

    # -- the outcome table (docs/outcomes.md): the attempt in flight ended -------------

    #: OK — one-off: ``on_success``, SUCCEEDED; periodic: next run after ``interval``
    #: (parked while the queue is not RUNNING).
    attempt_ok = (
        s.RUNNING.to(s.SUCCEEDED, cond="is_one_off")
        | s.RUNNING.to(s.DELAYED, cond=["is_periodic", "queue_running"])
        | s.RUNNING.to(s.PARKED, cond="is_periodic", unless="queue_running")
        | s.RUNNING.to(s.STOPPED, cond="is_blacklisted")
    )
    #: ERROR — decide: drop → FAILED, retry now → READY (DELAYED when the failure
    #: limiter makes it wait), retry after / periodic default → DELAYED; whatever puts it
    #: back parks it while the queue is not RUNNING.
    attempt_error = (
        s.RUNNING.to(s.FAILED, cond="drops")
        | s.RUNNING.to(s.READY, cond=["retries_now", "queue_running"], unless="limiter_waits")
        | s.RUNNING.to(s.DELAYED, cond=["waits_to_retry", "queue_running"])
        | s.RUNNING.to(s.PARKED, cond="requeues", unless="queue_running")
        | s.RUNNING.to(s.STOPPED, cond="is_blacklisted")
    )
    #: TIMEOUT — as ERROR.
    attempt_timeout = (
        s.RUNNING.to(s.FAILED, cond="drops")
        | s.RUNNING.to(s.READY, cond=["retries_now", "queue_running"], unless="limiter_waits")
        | s.RUNNING.to(s.DELAYED, cond=["waits_to_retry", "queue_running"])
        | s.RUNNING.to(s.PARKED, cond="requeues", unless="queue_running")
        | s.RUNNING.to(s.STOPPED, cond="is_blacklisted")
    )
    #: EXPIRED — as TIMEOUT: the attempt's lease expired before it ended (only a store
    #: shared by several processes produces it; another node reaps the attempt).
    attempt_expired = (
        s.RUNNING.to(s.FAILED, cond="drops")
        | s.RUNNING.to(s.READY, cond=["retries_now", "queue_running"], unless="limiter_waits")
        | s.RUNNING.to(s.DELAYED, cond=["waits_to_retry", "queue_running"])
        | s.RUNNING.to(s.PARKED, cond="requeues", unless="queue_running")
        | s.RUNNING.to(s.STOPPED, cond="is_blacklisted")
    )
    #: STOP — no reschedule, ever.
    attempt_stop = s.RUNNING.to(s.STOPPED)
    #: STOP_TYPE — as STOP (and the type is blacklisted: the ``blacklist`` event).
    attempt_stop_type = s.RUNNING.to(s.STOPPED)
    #: NO_RETRY — ``on_failure`` reports, FAILED.
    attempt_no_retry = s.RUNNING.to(s.FAILED, unless="is_blacklisted") | s.RUNNING.to(
        s.STOPPED, cond="is_blacklisted"
    )
    #: CANCELLED — by ``stop(cancel=True)``: parked; by ``terminate()``: handed back.
    attempt_cancelled = (
        s.RUNNING.to(s.PARKED, cond="cancelled_by_stop", unless="is_blacklisted")
        | s.RUNNING.to(s.RETURNED, cond="cancelled_by_terminate", unless="is_blacklisted")
        | s.RUNNING.to(s.STOPPED, cond="is_blacklisted")
    )

    def __init__(self, context: Context | None = None, start_value: EnvState | None = None) -> None:
        """Start in ``start_value`` (default NEW) with the guards reading ``context``."""
        self.context = context if context is not None else Context()
        super().__init__(start_value=start_value)

    # -- guards ------------------------------------------------------------------------

    def is_one_off(self) -> bool:
        """The attempt is looked up in the one-off rows (``interval == 0``, no calendar)."""
        return self.context.kind is Kind.ONE_OFF

    def is_periodic(self) -> bool:
        """The attempt is looked up in the periodic rows (``interval > 0`` or a calendar)."""
        return self.context.kind is Kind.PERIODIC

    def is_blacklisted(self) -> bool:
        """The type was blacklisted, or an operator cancelled the envelope, while the
        attempt ran: every outcome ends STOPPED, with no hook (the contract gives both
        the same rows)."""
        return self.context.kind in (Kind.BLACKLISTED, Kind.CANCELLED)

    def queue_running(self) -> bool:
        """The queue is RUNNING (else a move back into the queue parks instead)."""
        return self.context.queue is QueueState.RUNNING

    def before_start(self) -> bool:
        """The queue is still INIT: a sent envelope is buffered."""
        return self.context.queue is QueueState.INIT

    def must_wait(self) -> bool:
        """The envelope's first (or parked) run is in the future."""
        return self.context.wait

    def drops(self) -> bool:
        """A failure ends it: decision drop, or no decision on a one-off envelope."""
        decision = self.context.decision
        if self.is_blacklisted():
            return False
        return decision is DecisionKind.DROP or (decision is None and self.is_one_off())

    def retries_now(self) -> bool:
        """A failure puts it back at once (``retry_now()``)."""
        return self.context.decision is DecisionKind.RETRY_NOW and not self.is_blacklisted()

    def retries_later(self) -> bool:
        """A failure puts it back after a wait: ``retry_after()`` or the periodic default."""
        decision = self.context.decision
        if self.is_blacklisted():
            return False
        return decision is DecisionKind.RETRY_AFTER or (decision is None and self.is_periodic())

    def waits_to_retry(self) -> bool:
        """A failure puts it back after a wait: it retries later, or retries now but
        the failure limiter makes it wait."""
        return self.retries_later() or (self.retries_now() and self.limiter_waits())

    def requeues(self) -> bool:
        """A failure puts it back, now or later."""
        return self.retries_now() or self.retries_later()

    def limiter_waits(self) -> bool:
        """The failure limiter (``Queue(limiter=...)``) makes this retry wait."""
        return self.context.limited

    def stop_mode_stop(self) -> bool:
        """The stop under way is a STOP-mode stop (ready envelopes are parked)."""
        return self.context.mode is StopMode.STOP

    def cancelled_by_stop(self) -> bool:
        """``stop(cancel=True)`` cancelled the attempt."""
        return self.context.cause is CancelCause.STOP

    def cancelled_by_terminate(self) -> bool:
        """``terminate()`` cancelled the attempt."""
        return self.context.cause is CancelCause.TERMINATE


#: The model's event name for each envelope event and each attempt outcome.
EVENTS: Final[Mapping[EnvEvent | Outcome, str]] = MappingProxyType(
    {
        EnvEvent.SEND: "sent",
        EnvEvent.START: "start",
        EnvEvent.DUE: "due",
        EnvEvent.DISPATCH: "dispatch",
        EnvEvent.STOP: "stop",
        EnvEvent.TERMINATE: "terminate",
        EnvEvent.BLACKLIST: "blacklist",
        EnvEvent.RETRY: "retry",
        EnvEvent.CANCEL: "cancel",
        EnvEvent.DISCARD: "discard",
        **{outcome: f"attempt_{outcome.value}" for outcome in Outcome},
    }
)
