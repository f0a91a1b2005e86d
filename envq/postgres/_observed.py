"""What the PostgreSQL conformance driver reports: the database's journal read back
in snapshots and merged, by time, with the observations this process made (the
envelopes' callables), as the driver's module docstring describes; and where a call
took effect among them (:func:`effect`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from envq._machine import QueueState
from envq.conform.protocol import EnvSpec, Policy
from envq.postgres._declared import SETTLE_MAX

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._queue import PgQueue

__all__ = ["Observations", "Stop", "effect", "in_order", "merge", "report"]


class Stop:
    """A stop under way, as the journal shows it: the attempts it let end, and those
    it cancelled, in the order they ended."""

    def __init__(self) -> None:
        self.completed: list[str] = []
        self.cancelled: list[str] = []


class Observations:
    """The session's observations (a part of :class:`envq.postgres.driver.Session`,
    which holds the state below): the journal's rows not yet reported, this process's
    own observations, and the driver's view of the queue they lead to."""

    scale: float
    queue_name: str | None
    nodes: list[PgQueue]
    specs: dict[str, EnvSpec]
    raised: dict[str, list[tuple[float, str]]]
    claims: dict[str, list[tuple[float, int]]]
    pending: list[tuple[float, dict[str, Any]]]
    seen: set[int]
    by_seq: dict[int, str]
    states: dict[str, str]
    admitted: dict[str, int]
    life: str
    run: Stop | None
    last_report: dict[str, Any]

    def model(self, wall: float) -> float:
        """Model time of a wall-clock time."""
        raise NotImplementedError

    def _pool(self) -> asyncpg.Pool:
        raise NotImplementedError

    async def collect(self, stats: bool = False) -> tuple[list[tuple[float, dict[str, Any]]], Any]:
        """The observations made since the last collect, by time: the journal's rows
        of one snapshot and this process's observations that precede it (see the
        module's docstring); with ``stats``, the statistics of that snapshot."""
        until = time.monotonic() + SETTLE_MAX
        while True:
            before, rows, counts = await self._snapshot(stats)
            if counts is None or time.monotonic() >= until or not self._pending(*counts):
                break
            # A READY envelope a free worker has not claimed yet, or a stop with nothing
            # left in flight: the nodes claim, and end the stop, within a poll; the
            # statistics are those of a settled queue.
            await asyncio.sleep(0.005)
        fresh = [r for r in rows if r["n"] not in self.seen]
        cutoff = max([before, *(r["at"] for r in fresh)])
        # An on_failure call that decides is reported with the end of its attempt:
        # until that end is committed, the attempt is still running as far as the
        # database says. One that only reports comes after the end committed.
        ends: dict[int, float] = {}
        for r in fresh:
            if r["seq"] is not None and r["event"].startswith("attempt_"):
                ends[r["seq"]] = max(ends.get(r["seq"], 0.0), r["at"])
        ended = {self._name_of(r): ends[r["seq"]] for r in fresh if r["seq"] in ends}
        mine: list[tuple[float, dict[str, Any]]] = []
        kept: list[tuple[float, dict[str, Any]]] = []
        for wall, ev in self.pending:
            early = wall <= cutoff
            if early and ev["kind"] == "on_failure" and not ev.get("_reports"):
                early = ended.get(ev["env"], -1.0) >= wall
            (mine if early else kept).append((wall, ev))
        self.pending = kept
        moves: list[tuple[float, float, float, float, dict[str, Any]]] = []
        for wall, tie, r in in_order(fresh, self.life):
            self.seen.add(r["n"])
            event = self._move(r)
            if event is not None:
                moves.append((wall, tie, r["at"], float(r["n"]), event))
        merged = merge(mine, moves)
        for _, ev in merged:
            self._reported(ev)
        return merged, counts

    async def _snapshot(self, stats: bool) -> tuple[float, list[Any], Any]:
        """One snapshot of the database: the wall time just before it, the journal's
        rows and (with ``stats``) the queue's state and its envelopes by state."""
        counts = None
        async with self._pool().acquire() as conn, conn.transaction(isolation="repeatable_read"):
            before = time.time()
            await conn.fetchval("SELECT 1")  # the snapshot is taken here
            rows = await conn.fetch(
                "SELECT j.n, j.seq, j.from_state, j.to_state, j.event, j.queue_state,"
                " e.id #>> '{}' AS id,"
                " extract(epoch FROM j.at)::float8 AS at FROM envq.journal AS j"
                " LEFT JOIN envq.envelopes AS e ON e.seq = j.seq"
                " WHERE j.queue = $1 ORDER BY j.n",
                self.queue_name,
            )
            if stats:
                found = await conn.fetch(
                    "SELECT state::text, count(*)::int AS n FROM envq.envelopes"
                    " WHERE queue = $1 GROUP BY state",
                    self.queue_name,
                )
                state = await conn.fetchval(
                    "SELECT state::text FROM envq.queues WHERE name = $1", self.queue_name
                )
                counts = (state, {r["state"]: r["n"] for r in found})
        return before, list(rows), counts

    def _pending(self, state: str | None, by_state: dict[str, int]) -> bool:
        """Whether the queue is in a passing state the nodes leave within a poll: a
        READY envelope and a free worker to claim it, or a stop under way with nothing
        READY or RUNNING (a node's keeper ends it: the last attempt's end does not)."""
        ready, running = by_state.get("ready", 0), by_state.get("running", 0)
        if state == QueueState.STOPPING.value and not ready and not running:
            return True
        total = sum(node.workers for node in self.nodes)
        return state in ("running", "stopping") and ready > 0 and running < total

    def _name_of(self, r: Any) -> str | None:
        """The harness's name of a journal row's envelope (its ``id``)."""
        if r["seq"] is None:
            return None
        if r["id"] is not None:
            self.by_seq.setdefault(r["seq"], r["id"])
        return self.by_seq.get(r["seq"])

    def _move(self, r: Any) -> dict[str, Any] | None:
        """The observation of one journal row (and the driver's view of the queue)."""
        t = self.model(r["at"])
        if r["seq"] is None:
            frm, to = r["from_state"], r["to_state"]
            self.life = to
            if to == QueueState.STOPPING.value:
                self.run = Stop()
            elif frm == QueueState.STOPPING.value and self.run is not None:
                self.last_report = self._report(complete=True)
                self.run = None
            return {"t": t, "kind": "queue", "from": frm, "to": to}
        name = self._name_of(r)
        if name is None or name not in self.specs:
            return None
        event: str = r["event"]
        outcome = event.removeprefix("attempt_") if event.startswith("attempt_") else None
        frm = r["from_state"] or "new"
        to = r["to_state"]
        if frm == "new":
            self.admitted[name] = r["n"]  # admission order: the journal's
        elif to == "running":
            self.claims[name].append((r["at"], r["seq"]))
        self.states[name] = to
        if outcome is not None and self.run is not None:
            (self.run.cancelled if outcome == "cancelled" else self.run.completed).append(name)
        return {
            "t": t,
            "kind": "move",
            "env": name,
            "from": frm,
            "to": to,
            "outcome": outcome,
            "cause": self._cause_of(name, outcome, to, r["at"]),
        }

    def _reported(self, ev: dict[str, Any]) -> dict[str, Any]:
        """``ev`` as it is reported, the driver's own notes dropped; an ``on_success``
        call numbered: its attempt is the last claim of the envelope before the
        attempt's invoke began, numbered among the claims of the same row (a row is a
        stay: a re-sent envelope gets a new one)."""
        ev.pop("_reports", None)
        if ev["kind"] == "on_success":
            invoked = ev.pop("_invoked", None)
            claims = [c for c in self.claims[ev["env"]] if invoked is None or c[0] <= invoked]
            row = claims[-1][1] if claims else None
            ev["attempt"] = sum(1 for _, seq in claims if seq == row)
        return ev

    def _cause_of(self, name: str, outcome: str | None, to: str, at: float) -> str | None:
        """The error behind the end of an attempt: the outcome's own (a retry policy
        used up is ``max_retries``)."""
        if outcome is None or outcome == "ok":
            return None
        spec = self.specs[name]
        if (
            outcome in ("error", "timeout")
            and spec.policy is Policy.RETRY
            and not spec.periodic
            and to == "failed"
        ):
            return "max_retries"
        if outcome in ("timeout", "cancelled"):
            return outcome
        before = [cause for wall, cause in self.raised[name] if wall <= at]
        return before[-1] if before else outcome

    def _report(self, *, complete: bool) -> dict[str, Any]:
        parked = sorted(
            (n for n, s in self.states.items() if s == "parked"), key=self.admitted.__getitem__
        )
        run = self.run or Stop()
        return report(parked, run.completed, run.cancelled, complete=complete)


def merge(
    mine: list[tuple[float, dict[str, Any]]],
    moves: list[tuple[float, float, float, float, dict[str, Any]]],
) -> list[tuple[float, dict[str, Any]]]:
    """This process's observations (``mine``: wall time, observation) and the
    journal's moves (``moves``: the time and tie-break :func:`in_order` placed each
    at, the row's own time and ``n``, its observation) in one order. A move placed
    before the queue's move it preceded (a row written after that queue move, which
    saw the queue as it was before) takes along the observations of its envelope
    made between the two: they preceded the move (an attempt's ``invoke`` before the
    end of that attempt), and are kept in their order among the moves placed there."""
    keyed: list[tuple[tuple[float, float, float, float], dict[str, Any]]] = [
        ((wall, tie, at, n), ev) for wall, tie, at, n, ev in moves
    ]
    moved = [(wall, tie, ev.get("env"), at) for wall, tie, at, _, ev in moves if wall < at]
    for w, ev in mine:
        key = (w, 0.0, w, 0.0)
        for wall, tie, env, at in moved:
            if env is not None and ev.get("env") == env and wall <= w <= at:
                key = (wall, tie, w, 0.0)
                break
        keyed.append((key, ev))
    keyed.sort(key=lambda item: item[0])
    return [(key[0], ev) for key, ev in keyed]


def in_order(rows: list[Any], life: str) -> list[tuple[float, float, Any]]:
    """Journal rows in the order the database made their moves (``life``: the queue's
    state before the first of them), each with the time and tie-break it is sorted
    by: by the time its row was written, except that an envelope move that saw the
    queue in a state the rows before it have left (it read the queue while a lifecycle
    call was under way, then wrote its row after the call's) goes just before the
    queue's move out of that state."""
    placed: list[tuple[float, float, Any]] = []
    for r in sorted(rows, key=lambda r: (r["at"], r["n"])):
        seen = r["queue_state"]
        if r["seq"] is None:
            life = r["to_state"]
        elif seen is not None and seen != life:
            left = next(
                (
                    i
                    for i in range(len(placed) - 1, -1, -1)
                    if placed[i][2]["seq"] is None and placed[i][2]["from_state"] == seen
                ),
                None,
            )
            if left is not None:
                wall, tie, _ = placed[left]
                placed.insert(left, (wall, tie - 0.5, r))
                continue
        placed.append((r["at"], float(r["n"]), r))
    return placed


def effect(cmd: str, ok: bool, timed: list[tuple[float, dict[str, Any]]], received: float) -> int:
    """How many of ``events`` came before the call ``cmd`` took effect in the database:
    before its first move where it has one (an admitted send's first admission; the
    queue's move of a start, of a stop of a running queue, of a terminate); for a
    terminate of a stopping queue, before the first move it caused (a park, a
    cancelled attempt) or the queue's next move; otherwise (a call refused, or one that
    moved nothing) where the driver ``received`` it (wall time): after the observations
    made before that."""
    early = sum(1 for wall, _ in timed if wall <= received)
    for i, (_, ev) in enumerate(timed[early:], early) if ok else ():
        if ev["kind"] == "queue":
            mine = {
                "start": ev["to"] == "running",
                "stop": ev["from"] == "running",
                "terminate": True,
            }
            if mine.get(cmd, False):
                return i
        elif ev["kind"] == "move":
            if cmd == "send" and ev["from"] == "new":
                return i
            caused = ev["outcome"] == "cancelled" or (
                ev["outcome"] is None and ev["to"] in ("parked", "returned")
            )
            if cmd == "terminate" and caused:
                return i
    return early


def report(
    parked: list[str], completed: list[str], cancelled: list[str], *, complete: bool
) -> dict[str, Any]:
    return {
        "parked": list(parked),
        "completed": list(completed),
        "cancelled": list(cancelled),
        "complete": complete,
    }
