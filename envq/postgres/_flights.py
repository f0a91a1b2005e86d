"""An attempt in flight on a node, and its end: the attempt's row, lease token and
worker (:class:`Flight`); the gate that lets claims run side by side but taking back
a lost claim's attempts only alone (:class:`ClaimGate`); an end waiting for the
finisher's next statement (:class:`Ending`); and the finisher's fallback that ends
each attempt of a refused batch alone (:func:`end_each`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import attrs

from envq._attempt import Worker
from envq._machine import DecisionKind, Outcome
from envq.postgres._edges import lost
from envq.postgres._ends import Ended
from envq.postgres.schema import event_label

__all__ = ["GAVE_UP", "ClaimGate", "Ending", "Flight", "end_each"]

log = logging.getLogger("envq.postgres")

#: A row of ``envq.envelopes`` as the driver returns it.
Row = Any


#: The result of an attempt's end the node could not commit (the database stayed
#: away for longer than four leases): another node reaps the attempt.
GAVE_UP: Final = "gave up"


class ClaimGate:
    """Claims run side by side; taking back the attempts of a lost claim (adopt) runs
    alone: a claim in flight holds leases whose tokens the node does not know yet,
    which adopt would take for lost ones."""

    __slots__ = ("_alone", "_changed", "_claims")

    def __init__(self) -> None:
        self._claims = 0
        self._alone = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def claiming(self) -> AsyncIterator[None]:
        """Around a statement that claims."""
        while self._alone:
            await self._changed.wait()
        self._claims += 1
        try:
            yield
        finally:
            self._claims -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Around adopt: no claim in flight, none starts."""
        while self._alone:
            await self._changed.wait()
        self._alone = True
        try:
            while self._claims:
                await self._changed.wait()
            yield
        finally:
            self._alone = False
            self._notify()


@attrs.define(slots=True)
class Ending:
    """An attempt's end waiting for the finisher's next statement."""

    seq: int
    token: uuid.UUID
    outcome: str
    decision: str | None
    cause: str | None
    #: Seconds to the next run; None: the database computes it from the row's
    #: FIXED_DELAY / FIXED_RATE schedule.
    delay: float | None
    failures: int | None
    #: The error the attempt ended with, as JSON (``ErrorInfo``; None: none).
    error: str | None
    give_up: float
    #: The end as committed; None: refused (the lease had expired); GAVE_UP.
    done: asyncio.Future[Ended | str | None]


class Flight:
    """One attempt in flight on this node: its row, its lease, its worker."""

    __slots__ = ("claimed_at", "freed", "lost", "row", "token", "worker")

    def __init__(self, row: Row, worker: Worker) -> None:
        self.row = row
        self.token: uuid.UUID = row["lease_token"]
        self.worker = worker
        self.lost = False
        self.freed = False
        self.claimed_at = time.monotonic()


async def end_each(
    queue: str, end: Callable[[list[Ending], int], Awaitable[list[Row]]], batch: list[Ending]
) -> tuple[list[Row], list[Ending]]:
    """End each attempt of ``batch`` in a statement of its own; one the database
    still refuses ends as a dropped failure would (the tables' move for a failed
    attempt dropped by its decision), logged at ERROR. ``(ended rows, ends to try
    again)``: the ends the database was lost for are tried again."""
    import asyncpg  # noqa: PLC0415

    found: list[Row] = []
    again: list[Ending] = []
    for e in batch:
        try:
            found += await end([e], 0)
            continue
        except lost(asyncpg):
            again.append(e)
            continue
        except asyncpg.PostgresError as error:
            log.error(
                "queue %r: could not end the attempt of envelope %s (%s); it ends as "
                "a dropped failure",
                queue,
                e.seq,
                error,
            )
        dropped = Ending(
            e.seq,
            e.token,
            event_label(Outcome.ERROR),
            DecisionKind.DROP.value,
            None,
            0.0,
            None,
            e.error,
            e.give_up,
            e.done,
        )
        try:
            found += await end([dropped], 0)
        except lost(asyncpg):
            again.append(e)
        except asyncpg.PostgresError as error:
            log.error(
                "queue %r: could not end the attempt of envelope %s as a dropped "
                "failure either (%s); its lease expires and a reaper ends it",
                queue,
                e.seq,
                error,
            )
            e.done.set_result(GAVE_UP)
    return found, again
