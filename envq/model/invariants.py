"""The invariants envq keeps, stated precisely: lifecycle, outcomes, capacity, events.

Each :class:`Invariant` has a stable id (``I1`` …) used by the checkers:
:mod:`envq.model.explore` (``python -m envq explore``) checks every one of them on an
abstract model driven by the runtime tables, over every reachable state of a small
scope; the runtime property tests check them on the real queue after every step.
``python -m envq spec --write`` renders this list into ``specs/invariants.md``.

Terms: an envelope is *admitted* from the moment ``send()`` buffers or admits it; one
*stay* runs from that moment to the terminal state (a terminal envelope may be sent
again: a new stay). *Live* states: BUFFERED, READY, DELAYED, RUNNING, PARKED
(``envq._machine.LIVE_STATES``); *terminal*: SUCCEEDED, FAILED, STOPPED, RETURNED.
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["INVARIANTS", "Invariant"]


@attrs.frozen
class Invariant:
    """One invariant: a stable id, a short title and its precise definition."""

    id: str
    title: str
    definition: str


INVARIANTS: Final[tuple[Invariant, ...]] = (
    Invariant(
        "I1",
        "Capacity counts exactly the live envelopes",
        "At every moment `capacity_used` equals the number of envelopes of the queue whose "
        "state is live (BUFFERED, READY, DELAYED, RUNNING or PARKED), and with `capacity > 0` "
        "it never exceeds `capacity`. Admission takes one slot per envelope; the slot is "
        "released only when the envelope's action ends it (succeed, drop, report failure, "
        "end, blacklist, hand back). A `send()` batch that does not fit admits none.",
    ),
    Invariant(
        "I2",
        "No envelope is in two states",
        "An admitted envelope has exactly one `EnvState` at a time, is held in the one "
        "queue structure of that state (pre-start buffer, ready queue, delay timers, "
        "in-flight set, parked list) and in no other, and is live in at most one queue.",
    ),
    Invariant(
        "I3",
        "Never two concurrent attempts of one envelope",
        "An envelope has at most one attempt in flight, and it has one exactly when its "
        "state is RUNNING. An attempt starts only by DISPATCH from READY.",
    ),
    Invariant(
        "I4",
        "No attempt after STOP or STOP_TYPE",
        "Once an attempt of a stay ends with STOP or STOP_TYPE, or the envelope's `type` "
        "is blacklisted, the envelope is STOPPED for the rest of the stay and no attempt "
        "of it starts. After a STOP_TYPE on a non-empty `type`, no envelope of that type "
        "is live except RUNNING ones, whose attempt ends STOPPED whatever its outcome, "
        "and no envelope of that type is admitted again.",
    ),
    Invariant(
        "I5",
        "Nothing is lost",
        "Every admitted envelope is, at every moment, exactly one of: live; terminal in "
        "SUCCEEDED, FAILED or STOPPED with exactly one event announcing that state; or "
        "RETURNED and included exactly once in what `terminate()` handed back. "
        "A TERMINATED queue holds no live envelope.",
    ),
    Invariant(
        "I6",
        "Stop modes and parking",
        "Live states allowed per queue state: INIT — BUFFERED only; RUNNING — READY, "
        "DELAYED, RUNNING; STOPPING — RUNNING, PARKED, and READY only under `StopMode.DRAIN`; "
        "STOPPED — PARKED only; TERMINATED — none. A stop parks every DELAYED envelope, "
        "and every READY one under `StopMode.STOP`; an attempt that would put its "
        "envelope back (reschedule, retry) while the queue is not RUNNING parks it; a "
        "cancelled attempt is parked by `stop(cancel=True)` and handed back by "
        "`terminate()`. DRAINED occurs only when nothing is RUNNING and, under DRAIN, "
        "nothing is READY.",
    ),
    Invariant(
        "I7",
        "The event stream is a path through the model",
        "Every queue event (from_state, to_state) is a transition of `LifecycleModel` on "
        "the call that caused it; the events of one envelope's stay start at NEW and "
        "each (from_state, to_state) is a transition of `EnvelopeModel` on its event, "
        "allowed by `ENVELOPE_MOVES`; the target of an attempt's end is `{row.target} | "
        "row.redirects` of its outcome row. A periodic envelope never becomes SUCCEEDED.",
    ),
    Invariant(
        "I8",
        "Exactly-once dedup",
        "Sending an envelope object that is live in this queue changes nothing (no state "
        "change, no capacity) and counts one dedup; `send(e, e)` admits `e` once; an "
        "envelope that is terminal may be sent again and starts a new stay at NEW.",
    ),
)
