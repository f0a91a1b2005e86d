"""The hooks that report an attempt's end, as the oracle accounts for them.

An attempt that ends OK in a row whose action reports it (``SUCCEED``, ``RESCHEDULE``;
never the ``BLACKLISTED`` group, whose rows call no hook) calls ``on_success``, and no
other attempt does; one whose row is ``REPORT_FAILURE`` (DoNotRetry) calls
``on_failure`` to report it, its answer ignored. When, depends on the port:

* in one process (a port without ``leases``), exactly once, before the move that ends
  the attempt;
* on a store several processes share (a port that declares ``leases``), at most once,
  before or after that move: such a port runs its reporting hooks once the end has
  committed, so that a node whose end the store refused (its lease had lapsed, and
  another process reaped the attempt) reports nothing. A node that dies in between
  reports nothing either.

The driver names the attempt of an ``on_success`` call by its number in the
envelope's current stay (the dispatches since it was admitted), so that a call that
comes late is judged against the attempt it reports, even after the next attempt
began. A reporting ``on_failure`` that comes late is known by its error and number,
which the row gives. :class:`Reports` keeps one envelope's calls and the ends they
belong to; each check gives back what is wrong (a message, and the table row at
stake) for the oracle to raise as a violation of ``I7``. (An ``on_failure`` that
decides, and one before the move, the oracle matches with the attempt's end itself.)
"""

from __future__ import annotations

from typing import TypeAlias

import attrs

__all__ = ["Problem", "Reports"]

#: What is wrong: a message (the envelope's name is the oracle's to add) and the table
#: row at stake (None: no row).
Problem: TypeAlias = tuple[str, str | None]


@attrs.define(eq=False)
class _Ended:
    """An attempt that ended, as its ``on_success`` call is matched with it."""

    stay: int
    attempt: int
    #: The outcome it ended with, and the row of the outcome table it ended in.
    outcome: str
    row: str
    #: Its ``on_success`` may still come (a leased port reports after the move).
    owed: bool
    #: Its ``on_success`` came.
    reported: bool


@attrs.define(eq=False)
class _Call:
    """An ``on_success`` call not yet matched with the end of its attempt."""

    attempt: int
    #: Invariant checks that found it unmatched with no attempt of its envelope running.
    waited: int = 0


@attrs.define(eq=False)
class Reports:
    """One envelope's calls of the hooks that report an end, and the ends of its
    attempts they belong to."""

    pending: list[_Call] = attrs.Factory(list)
    ended: list[_Ended] = attrs.Factory(list)
    #: The reporting on_failure calls (error, number) owed to ends already moved.
    failures: list[tuple[str, int]] = attrs.Factory(list)

    def owe_failure(self, hook: tuple[str, int]) -> None:
        """An attempt ended in a ``REPORT_FAILURE`` row of a leased port with its
        ``on_failure`` (``hook``: its error and number) not called yet: it may come."""
        self.failures.append(hook)

    def failure(self, hook: tuple[str, int]) -> bool:
        """An ``on_failure`` call: whether it is one owed (then settled); if not, it
        belongs with the end of an attempt to come."""
        if hook in self.failures:
            self.failures.remove(hook)
            return True
        return False

    def admitted(self) -> None:
        """A new stay: the attempts are counted afresh. Only the calls still owed to an
        earlier stay's attempts are kept (a leased port may report one late)."""
        self.ended = [e for e in self.ended if e.owed]

    def success(self, attempt: int, stay: int) -> Problem | None:
        """``on_success`` reported for ``attempt``: it settles a call still owed to an
        attempt that ended (the oldest first), waits for the end of one not ended yet,
        and is wrong for an attempt that ended otherwise or was reported already."""
        owed = next((e for e in self.ended if e.owed and e.attempt == attempt), None)
        if owed is not None:
            owed.owed, owed.reported = False, True
            return None
        end = next((e for e in self.ended if (e.stay, e.attempt) == (stay, attempt)), None)
        if end is None:
            self.pending.append(_Call(attempt))
            return None
        if end.reported:
            return f"on_success called twice for attempt {attempt}", end.row
        return f"on_success called for attempt {attempt}, which ended {end.outcome}", end.row

    def end(
        self, attempt: int, stay: int, outcome: str, row: str, *, reports: bool, leases: bool
    ) -> Problem | None:
        """Attempt ``attempt`` ended with ``outcome`` in ``row``; ``reports``: the row
        reports it with ``on_success`` (and the envelope has one); ``leases``: the port
        may report it after this move. Its calls so far are judged here."""
        calls = [c for c in self.pending if c.attempt == attempt]
        self.pending = [c for c in self.pending if c.attempt != attempt]
        if len(calls) > 1:
            return f"on_success called {len(calls)} times for attempt {attempt}", row
        if calls and not reports:
            return f"on_success called for attempt {attempt}, which ended {outcome}", row
        if reports and not calls and not leases:
            return f"attempt {attempt} ended {outcome}; on_success was not called before", row
        self.ended.append(
            _Ended(stay, attempt, outcome, row, owed=reports and not calls, reported=bool(calls))
        )
        return None

    def unmatched(self, running: bool, grace: int) -> Problem | None:
        """At an invariant check: a call still unmatched while no attempt of its
        envelope runs is wrong once ``grace`` checks have found it so (a real-clock
        port may report the moves it belongs with in a later batch)."""
        if running or not self.pending:
            return None
        for call in self.pending:
            call.waited += 1
        late = [c.attempt for c in self.pending if c.waited > grace]
        if not late:
            return None
        return f"on_success called for attempt(s) {late}, and no such attempt ended", None

    def forget(self) -> None:
        """The oracle follows the port (after a violation it allows): the calls not yet
        matched are dropped with the attempt the port moved on from."""
        self.pending = []
