"""The decisions both stores make, once: pure functions of an attempt's facts.

The tables (:mod:`envq._machine`) say which row an attempt's outcome selects; the
functions here decide what a row leaves open — for a one-off failure that no
``on_failure`` hook decides, whether the envelope's :class:`~envq.Retry` policy puts
it back and after how long, and the error its end reports when the policy allows no
more attempts; for a periodic one, its count of failures in a row; for either, the
number its ``on_failure`` hook is given (:func:`failure` says all of it for one failed
attempt); and whether a batch's new envelopes fit a queue's capacity, with the words
of a refusal. The in-process engine
(:mod:`envq._outcomes`, :mod:`envq._admission`) and the PostgreSQL store
(:mod:`envq.postgres._ends`, :mod:`envq.postgres._edges`) both call them; neither
decides a retry, counts a periodic failure or words a capacity refusal by itself.

No I/O, no clock, no store: the inputs are the policy and the attempt's number, so a
store may call them before it commits the end under the attempt's lease.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from envq._errors import MaxRetriesExceeded
from envq._machine import DecisionKind
from envq._values import Retry

__all__ = [
    "RETRY",
    "Failure",
    "Room",
    "by_policy",
    "exhausted",
    "failure",
    "failures_in_a_row",
    "hook_number",
    "refusal",
    "room",
]

#: The decision of a retry the policy allows.
RETRY: Final = DecisionKind.RETRY_AFTER


def by_policy(retry: Retry | None, attempt: int) -> tuple[DecisionKind | None, float]:
    """A one-off envelope's failed ``attempt`` (numbered from 1), decided by its retry
    policy: ``(RETRY_AFTER, delay)`` while the policy allows another attempt, else
    ``(None, 0.0)`` — the row's own target (FAILED)."""
    if retry is not None and retry.allows(attempt):
        return RETRY, retry.delay(attempt)
    return None, 0.0


def exhausted(
    where: str, label: str, retry: Retry | None, attempt: int, cause: BaseException | None
) -> BaseException | None:
    """The error a one-off envelope's failed ``attempt`` ends with when its policy
    decided: ``MaxRetriesExceeded`` chained to the attempt's own error once the policy
    allows no more, else the attempt's error (``cause``). ``where`` names the queue in
    the message (``"queue 'mail'"``); ``label`` the envelope."""
    if retry is None or retry.allows(attempt):
        return cause
    error = MaxRetriesExceeded(f"{where}: {label} failed {attempt} of {retry.attempts} attempts")
    error.__cause__ = cause
    return error


def failures_in_a_row(failures: int) -> int:
    """A periodic envelope's failures in a row once this run failed, from the count
    before it (a run that succeeds sets the count back to 0)."""
    return failures + 1


def hook_number(periodic: bool, failures: int, attempt: int) -> int:
    """The number ``on_failure`` is given for a failed run: a periodic envelope's
    failures in a row including this run (``failures``: the count before it), a
    one-off envelope's attempt number (``attempt``, from 1)."""
    return failures_in_a_row(failures) if periodic else attempt


@attrs.frozen
class Failure:
    """How a failed attempt is decided (:func:`failure`), before a store writes its end.

    Exactly one of three decides: the envelope's ``on_failure`` hook (``hook`` is the
    number to call it with, and its :class:`~envq.Decision` decides), else for a
    periodic envelope its schedule (``next_run``: the next run, by the store's clock),
    else a one-off envelope's :class:`~envq.Retry` policy (``decision`` and ``delay``;
    ``decision`` None: the row's own target, FAILED, and ``spent`` says the policy
    allowed no more attempts).
    """

    #: The number ``on_failure`` is called with (None: no hook decides).
    hook: int | None
    #: The policy's decision when nothing else decides (None: the row's own target).
    decision: DecisionKind | None = None
    #: Its delay, in seconds.
    delay: float = 0.0
    #: A periodic run that no hook decides: it waits for its schedule's next run.
    next_run: bool = False
    #: A periodic envelope's failures in a row once this run failed (None: one-off).
    failures: int | None = None
    #: A one-off envelope's policy allowed no more attempts: its end reports
    #: ``MaxRetriesExceeded`` (:func:`exhausted`).
    spent: bool = False


def failure(
    *, periodic: bool, hooked: bool, retry: Retry | None, attempt: int, failures: int
) -> Failure:
    """How a failed ``attempt`` (numbered from 1) is decided: ``periodic`` whether the
    envelope runs on a schedule (``failures``: its failures in a row before this run),
    ``hooked`` whether it has an ``on_failure`` hook (which then decides; a store that
    cannot call it, not having the envelope's code, passes False), ``retry`` its
    policy."""
    if periodic:
        in_a_row = failures_in_a_row(failures)
        if hooked:
            return Failure(hook_number(True, failures, attempt), failures=in_a_row)
        return Failure(None, next_run=True, failures=in_a_row)
    if hooked:
        return Failure(hook_number(False, failures, attempt))
    decision, delay = by_policy(retry, attempt)
    return Failure(None, decision, delay, spent=decision is None and retry is not None)


class Room(enum.Enum):
    """Whether a batch's new envelopes fit a queue's capacity."""

    #: They fit now (or the queue has no capacity).
    FITS = "fits"
    #: Not now: the live envelopes leave too little room; an end may free it.
    FULL = "full"
    #: Never: more new envelopes than the capacity itself.
    NEVER = "never"
    #: They would fit, but producers wait for room ahead of them (``send_wait``): a
    #: plain send does not overtake them. Only a store with such a line of waiting
    #: producers (the in-process queue) gives it.
    BEHIND = "behind"


def room(live: int, fresh: int, capacity: int, *, waiting: bool = False) -> Room:
    """Whether ``fresh`` new envelopes (dedups not counted) fit beside ``live`` live ones
    in ``capacity`` (0: no capacity); ``waiting``: producers wait for room ahead of
    them."""
    if not capacity or not fresh:
        return Room.FITS
    if live + fresh <= capacity:
        return Room.BEHIND if waiting else Room.FITS
    return Room.NEVER if fresh > capacity else Room.FULL


def refusal(verdict: Room, live: int, fresh: int, capacity: int, *, doing: str = "") -> str:
    """The words of a capacity refusal (``verdict`` FULL, NEVER or BEHIND), after the
    queue's name: ``doing`` names what was refused when it is not a send (``"retry"``)."""
    if verdict is Room.BEHIND:
        return (
            f"producers are waiting in send_wait for {fresh} envelope(s): {live} of {capacity} used"
        )
    if verdict is Room.NEVER:
        to = f" to {doing}" if doing else ""
        return f"a batch of {fresh} new envelope(s){to} can never fit the capacity of {capacity}"
    what = f"to {doing}" if doing else "for"
    return f"no room {what} {fresh} envelope(s): {live} of {capacity} used"
