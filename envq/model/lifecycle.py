"""The queue lifecycle as a python-statemachine model.

This is the auditor's copy of the lifecycle table, written from the contract, not
generated from ``envq._machine``. ``tests/model/test_models.py`` proves it equal to the
runtime table ``envq._machine.LIFECYCLE`` over every (state, call) pair.

Reading rules:

* one event per call of the contract's table (``start()``, ``send(...)``,
  ``await stop()``, ``await terminate()``) plus the internal ``drained`` (a stop under
  way has nothing left to wait for) and ``abandon`` (a worker was cancelled from
  outside, e.g. by the event loop closing); :data:`CALL_EVENTS` names the event of each
  :class:`~envq._machine.QueueCall`;
* a no-op call is a self-transition (``RUNNING --start--> RUNNING``);
* a call the contract answers with an error is *not* a transition; the error class is
  written down in :data:`REJECTED`, also from the contract's table;
* ``drained`` exists only from STOPPING; every other (state, ``drained``) pair is
  neither a transition nor a rejection — it cannot happen;
* ``terminate()`` from RUNNING or STOPPING is one transition to TERMINATED: the queue
  passes through STOPPING and STOPPED on the way (it stops with ``mode=STOP,
  cancel=True`` first), but the call's effect on the lifecycle is that row.

TERMINATED is not declared ``final``: ``stop()`` and ``terminate()`` are no-ops there,
which python-statemachine models as self-transitions, and a final state may have none.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from statemachine import StateMachine
from statemachine.states import States

from envq._errors import EnvqError, QueueNotRunning, QueueStopping, QueueTerminated
from envq._machine import QueueCall, QueueState

__all__ = ["CALL_EVENTS", "REJECTED", "LifecycleModel"]


class LifecycleModel(StateMachine):
    """The queue's lifecycle: INIT → RUNNING ⇄ STOPPING → STOPPED … → TERMINATED."""

    s = States.from_enum(QueueState, initial=QueueState.INIT)

    #: ``start()``: INIT and STOPPED → RUNNING (buffered / parked envelopes armed);
    #: a no-op while RUNNING. Rejected while STOPPING and TERMINATED.
    start = s.INIT.to(s.RUNNING) | s.RUNNING.to.itself() | s.STOPPED.to(s.RUNNING)

    #: ``send(...)``: buffered in INIT, admitted in RUNNING; the state does not change.
    #: Rejected while STOPPING, STOPPED and TERMINATED. (Not named ``send``: that is
    #: python-statemachine's own method.)
    send_envelopes = s.INIT.to.itself() | s.RUNNING.to.itself()

    #: ``await stop()``: RUNNING → STOPPING; waits for a stop under way; a no-op in
    #: INIT, STOPPED and TERMINATED.
    stop = (
        s.INIT.to.itself()
        | s.RUNNING.to(s.STOPPING)
        | s.STOPPING.to.itself()
        | s.STOPPED.to.itself()
        | s.TERMINATED.to.itself()
    )

    #: Internal: the stop under way has nothing left to wait for → STOPPED.
    drained = s.STOPPING.to(s.STOPPED)

    #: Internal: a worker task was cancelled by someone other than envq (the event
    #: loop closing under a running queue): RUNNING → STOPPING as a cancelling STOP; a
    #: stop under way becomes one; nothing to do once STOPPED or TERMINATED. A queue
    #: never started has no workers, so INIT has no such event.
    abandon = (
        s.RUNNING.to(s.STOPPING)
        | s.STOPPING.to.itself()
        | s.STOPPED.to.itself()
        | s.TERMINATED.to.itself()
    )

    #: ``await terminate()``: from every live state → TERMINATED (from RUNNING as
    #: ``stop(mode=STOP, cancel=True)`` first; from STOPPING after cancelling what is in
    #: flight); a no-op once TERMINATED.
    terminate = (
        s.INIT.to(s.TERMINATED)
        | s.RUNNING.to(s.TERMINATED)
        | s.STOPPING.to(s.TERMINATED)
        | s.STOPPED.to(s.TERMINATED)
        | s.TERMINATED.to.itself()
    )


#: The model's event name for each lifecycle call.
CALL_EVENTS: Final[Mapping[QueueCall, str]] = MappingProxyType(
    {
        QueueCall.START: "start",
        QueueCall.SEND: "send_envelopes",
        QueueCall.STOP: "stop",
        QueueCall.TERMINATE: "terminate",
        QueueCall.DRAINED: "drained",
        QueueCall.ABANDON: "abandon",
    }
)

#: The calls the contract's lifecycle table answers with an error, and the error.
#: These pairs have no transition in :class:`LifecycleModel`; the state does not change.
REJECTED: Final[Mapping[tuple[QueueState, QueueCall], type[EnvqError]]] = MappingProxyType(
    {
        (QueueState.STOPPING, QueueCall.START): QueueStopping,
        (QueueState.STOPPING, QueueCall.SEND): QueueStopping,
        (QueueState.STOPPED, QueueCall.SEND): QueueNotRunning,
        (QueueState.TERMINATED, QueueCall.START): QueueTerminated,
        (QueueState.TERMINATED, QueueCall.SEND): QueueTerminated,
    }
)
