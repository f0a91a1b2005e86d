"""The pages' source for an in-process :class:`envq.Queue`.

The live envelopes are read with :meth:`envq.Queue.envelopes` and the counts with
:meth:`envq.Queue.statistics`; what a queue forgets — the moves of an envelope and the
envelopes that ended — is what this source hears as a listener of the queue, from the
moment the app was made, kept within bounds (the last moves of the last envelopes,
the last ended ones, ten minutes of ends).

The listener does not count as handling failures: an envelope that ends FAILED with
nothing else to handle it is still logged (``log_unhandled``). Being subscribed makes
the queue report its moves, which costs a little on every move.

An envelope's last error and its story are the queue's (:class:`envq.LiveEnvelope`),
and the operator's moves go through :meth:`envq.Queue.retry`, ``cancel`` and
``discard``: offered for the envelopes the queue holds (the live ones and the kept
ended ones), not for those only this source remembers. A retry is a new stay in the
queue, so a new key; the page of the old one names it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Final

import attrs

from envq._envelope import Envelope
from envq._errors import EnvqError, QueueStopping, QueueTerminated
from envq._machine import TERMINAL_STATES, EnvEvent, EnvState, Kind, QueueState
from envq._queue import Queue
from envq._reports import AttemptRecord, ErrorInfo, Event, LiveEnvelope
from envq.web._rows import envelope_row, event_of, operator_events
from envq.web._source import (
    STORED,
    Action,
    AttemptShown,
    Bucket,
    EnvelopeDetail,
    EnvelopePage,
    EnvelopeQuery,
    EnvelopeRow,
    ErrorShown,
    Move,
    NotFound,
    QueueSummary,
    Refused,
    not_allowed,
    refused,
)

__all__ = ["MemorySource", "error_shown", "shown"]

#: Envelopes whose moves are kept, moves kept per envelope, ended envelopes kept.
KEPT_ENVELOPES: Final = 5000
KEPT_MOVES: Final = 100
KEPT_ENDED: Final = 1000
#: The slices of the ends' chart, and how many.
SLICE: Final = 10.0
SLICES: Final = 60
#: The most characters of a payload or id shown.
SHOWN: Final = 65536


def shown(value: object, limit: int = SHOWN) -> tuple[str, bool]:
    """``value`` as text — JSON when it is, else ``repr`` — cut to ``limit`` characters;
    and whether it was cut."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        text = repr(value)
    return (text[:limit], True) if len(text) > limit else (text, False)


def _callable_name(fn: object) -> str:
    if fn is None:
        return ""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


def error_shown(error: ErrorInfo | None) -> ErrorShown | None:
    """An envelope's last error, as a page shows it."""
    if error is None:
        return None
    return ErrorShown(error.type, error.message[:SHOWN], error.traceback[-SHOWN:])


@attrs.define
class _Ended:
    envelope: Envelope
    state: EnvState
    kind: Kind
    attempts: int
    at: float
    #: Its last error and story when it ended (the queue may forget them).
    error: ErrorInfo | None = None
    history: tuple[AttemptRecord, ...] = ()


class MemorySource:
    """A :class:`envq.web._source.Source` for one in-process queue."""

    kind = "in-process"

    def __init__(self, queue: Queue) -> None:
        self.q = queue
        self._moves: OrderedDict[int, deque[Move]] = OrderedDict()
        self._ended: OrderedDict[int, _Ended] = OrderedDict()
        #: The key of each envelope's stay in ``_ended`` (a retry moves it on).
        self._ended_key: dict[Envelope, int] = {}
        #: The keys of stays a retry ended, and the key of the stay it began.
        self._retried: OrderedDict[int, int] = OrderedDict()
        self._slices: deque[list[float]] = deque(maxlen=SLICES)
        self._unsubscribe: Callable[[], None] | None = queue._listen(
            self._heard, handles_failures=False
        )

    # -- what the listener keeps ----------------------------------------------------

    def _heard(self, event: Event) -> None:
        env = event.envelope
        if env is None:
            return
        now = time.time()
        rec = env._rec
        source, to = event.from_state, event.to_state
        assert isinstance(source, EnvState)
        assert isinstance(to, EnvState)
        found = None if event.outcome is not None else event_of(source, to)
        if found is EnvEvent.RETRY or found is EnvEvent.DISCARD:
            self._forget(env, rec.seq if found is EnvEvent.RETRY else None)
        moves = self._moves.get(rec.seq)
        if moves is None:
            moves = self._moves[rec.seq] = deque(maxlen=KEPT_MOVES)
            if len(self._moves) > KEPT_ENVELOPES:
                self._moves.popitem(last=False)
        if event.outcome is not None:
            label = event.outcome.name
        else:
            label = found.name if found is not None else "-"
        row = envelope_row(source, to, outcome=event.outcome, kind=rec.kind)
        moves.append(Move(now, source.name, to.name, label, row))
        if to in TERMINAL_STATES:
            story = tuple(rec.story) if rec.story else ()
            self._ended[rec.seq] = _Ended(env, to, rec.kind, rec.attempts, now, rec.error, story)
            self._ended_key[env] = rec.seq
            if len(self._ended) > KEPT_ENDED:
                key, oldest = self._ended.popitem(last=False)
                if self._ended_key.get(oldest.envelope) == key:
                    del self._ended_key[oldest.envelope]
            if to is EnvState.SUCCEEDED or to is EnvState.FAILED:
                self._count(now, to is EnvState.SUCCEEDED)

    def _forget(self, env: Envelope, new_key: int | None) -> None:
        """``env``'s ended stay leaves the list: discarded (``new_key`` None), or sent
        back by a retry as the stay ``new_key``, which takes over its moves."""
        key = self._ended_key.pop(env, None)
        if key is None:
            return
        self._ended.pop(key, None)
        if new_key is None:
            return
        self._retried[key] = new_key
        if len(self._retried) > KEPT_ENDED:
            self._retried.popitem(last=False)
        old = self._moves.pop(key, None)
        if old is not None:
            self._moves[new_key] = deque(old, maxlen=KEPT_MOVES)

    def _count(self, now: float, ok: bool) -> None:
        start = now - now % SLICE
        if not self._slices or self._slices[-1][0] != start:
            self._slices.append([start, 0, 0])
        self._slices[-1][1 if ok else 2] += 1

    def _series(self) -> list[Bucket]:
        now = time.time()
        first = now - now % SLICE - (SLICES - 1) * SLICE
        seen = {int(s[0]): s for s in self._slices}
        out = []
        for i in range(SLICES):
            start = first + i * SLICE
            got = seen.get(int(start))
            out.append(Bucket(start, int(got[1]), int(got[2])) if got else Bucket(start, 0, 0))
        return out

    # -- Source ---------------------------------------------------------------------

    def _check(self, name: str) -> None:
        if name != self.q.name:
            raise NotFound(f"there is no queue named {name!r}")

    async def queues(self) -> list[QueueSummary]:
        return [await self.queue(self.q.name)]

    async def queue(self, name: str) -> QueueSummary:
        self._check(name)
        stats = self.q.statistics()
        counts = {s: stats.by_state.get(s, 0) for s in STORED}
        return QueueSummary(
            name=name,
            state=stats.state,
            counts=counts,
            capacity=stats.capacity_limit,
            series=self._series(),
            blacklist=tuple(sorted(self.q._blacklist)),
        )

    def _wall(self, due: float | None) -> float | None:
        loop = self.q.loop
        if due is None or loop is None:
            return None
        return time.time() + (due - loop.time())

    def _row(
        self, env: Envelope, key: int, state: EnvState, kind: Kind, attempts: int, due: float | None
    ) -> EnvelopeRow:
        if env._calendar:
            schedule = f"on {env.schedule!r}"
        elif env.interval > 0:
            schedule = f"every {env.interval:g}s ({getattr(env.schedule, 'name', env.schedule)})"
        else:
            schedule = ""
        note = {
            EnvState.READY: "ready now",
            EnvState.RUNNING: "running",
            EnvState.PARKED: "when the queue starts again",
            EnvState.BUFFERED: "when the queue starts",
        }.get(state, "")
        return EnvelopeRow(
            key=key,
            id="" if env.id is None else shown(env.id, 200)[0],
            type=env.type,
            state=state,
            kind=kind.name,
            attempts=attempts,
            schedule=schedule,
            due=self._wall(due),
            due_note=note,
        )

    def _all(self, state: EnvState | None) -> list[LiveEnvelope]:
        """Live and remembered ended envelopes (in ``state``: any when None), newest
        first: one walk of the queue (a page of it per request would walk it from the
        start each time); a row is made only for the envelopes a page shows."""
        live = self.q.envelopes(state, limit=sys.maxsize)
        held = {snap.seq for snap in live}
        # The ended ones the app heard of and the queue no longer holds, as snapshots.
        heard = [
            LiveEnvelope(e.envelope, key, e.state, e.kind, e.attempts)
            for key, e in self._ended.items()
            if key not in held and (state is None or e.state is state)
        ]
        found = [*live, *heard]
        found.sort(key=attrgetter("seq"), reverse=True)
        return found

    async def envelopes(self, name: str, query: EnvelopeQuery) -> EnvelopePage:
        self._check(name)
        ids = None if query.id is None else {query.id, shown(query.id, 200)[0]}
        rows = self._all(query.state)
        if query.type is not None or ids is not None or query.scheduled:
            rows = [
                r
                for r in rows
                if (query.type is None or r.envelope.type == query.type)
                and (
                    ids is None
                    or (r.envelope.id is not None and shown(r.envelope.id, 200)[0] in ids)
                )
                and (
                    not query.scheduled
                    or (
                        (r.envelope._calendar or r.envelope.interval > 0)
                        and r.state not in TERMINAL_STATES
                    )
                )
            ]
        keys = [r.seq for r in rows]
        older: int | None
        newer: int | None
        if query.after is not None:
            newer_side = [r for r in rows if r.seq > query.after]
            page = newer_side[-query.limit :]
            more_newer = len(newer_side) > query.limit
            older = page[-1].seq if page and any(k < page[-1].seq for k in keys) else None
            newer = page[0].seq if page and more_newer else None
        elif query.before is not None:
            rows_before = [r for r in rows if r.seq < query.before]
            page = rows_before[: query.limit]
            more = len(rows_before) > query.limit
            older = page[-1].seq if more and page else None
            newer = page[0].seq if page else None
        else:
            page = rows[: query.limit]
            older, newer = (page[-1].seq if len(rows) > query.limit else None), None
        rows_shown = [
            self._row(r.envelope, r.seq, r.state, r.kind, r.attempts, r.due) for r in page
        ]
        return EnvelopePage(rows_shown, older, newer)

    def _gone(self, name: str, key: int) -> NotFound:
        later = self._retried.get(key)
        if later is not None:
            return NotFound(
                f"queue {name!r} holds no envelope {key} now: a retry sent it back as "
                f"envelope {later}"
            )
        return NotFound(f"queue {name!r} has no envelope {key} (live, or ended lately)")

    def _held(self, key: int) -> LiveEnvelope | None:
        """The queue's snapshot of stay ``key``, if the queue holds it (live, or ended
        and kept)."""
        found = self.q.envelopes(after=key - 1, limit=1) if key > 0 else []
        return found[0] if found and found[0].seq == key else None

    async def state_of(self, name: str, key: int) -> EnvState:
        self._check(name)
        one = self._held(key)
        if one is not None:
            return one.state
        ended = self._ended.get(key)
        if ended is None:
            raise self._gone(name, key)
        return ended.state

    async def envelope(self, name: str, key: int) -> EnvelopeDetail:
        self._check(name)
        one = self._held(key)
        held = one is not None
        if one is not None:
            env, state, kind, attempts, due = (
                one.envelope,
                one.state,
                one.kind,
                one.attempts,
                one.due,
            )
            error, history = one.error, one.history
        elif key in self._ended:
            ended = self._ended[key]
            env, state, kind, attempts, due = (
                ended.envelope,
                ended.state,
                ended.kind,
                ended.attempts,
                None,
            )
            error, history = ended.error, ended.history
        else:
            raise self._gone(name, key)
        row = self._row(env, key, state, kind, attempts, due)
        payload, cut = shown(env.payload)
        retry = env.retry
        fields: list[tuple[str, str]] = [
            ("id", row.id or "(none)"),
            ("type", env.type or "(none)"),
            ("state", state.name),
            ("kind", kind.name),
            ("attempts", str(attempts)),
            ("schedule", row.schedule or "one-off"),
            ("deadline", f"{env.deadline:g} s" if env.deadline else "none"),
            ("delay", f"{env.delay:g} s" if env.delay else "none"),
            ("not_before", env.not_before.isoformat() if env.not_before else "none"),
            ("retry", repr(retry) if retry is not None else "none"),
            ("invoke", _callable_name(env.invoke)),
        ]
        for hook in ("before", "after", "on_success", "on_failure"):
            fn: Any = getattr(env, hook)
            if fn is not None:
                fields.append((hook, _callable_name(fn)))
        allowed = operator_events(state)
        return EnvelopeDetail(
            row=row,
            fields=fields,
            payload=payload,
            payload_cut=cut,
            moves=list(self._moves.get(key, ())),
            moves_note=(
                "The moves this page heard since it was mounted (the last "
                f"{KEPT_MOVES} of each envelope)."
            ),
            error=error_shown(error),
            history=[self._attempt(a) for a in history],
            actions=allowed if held else (),
            actions_note=""
            if held or not allowed
            else (
                "The queue no longer holds this envelope (it keeps the latest "
                "keep_ended that ended FAILED or STOPPED, none that succeeded): "
                "no operator's move applies to it."
            ),
        )

    def _attempt(self, a: AttemptRecord) -> AttemptShown:
        error = "" if a.error is None else f"{a.error.type}: {a.error.message}"
        return AttemptShown(
            attempt=a.attempt,
            outcome=a.outcome.name,
            started=self._wall(a.started),
            ended=self._wall(a.ended),
            node=a.node or "",
            error=error[:SHOWN],
        )

    async def operate(self, name: str, key: int, event: EnvEvent) -> int | None:
        self._check(name)
        loop = self.q.loop
        if loop is None or loop is asyncio.get_running_loop() or not loop.is_running():
            return self._operate(name, key, event)

        # On the queue's loop, the look-up and the call are one step of it.
        async def there() -> int | None:
            return self._operate(name, key, event)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(there(), loop))

    def _operate(self, name: str, key: int, event: EnvEvent) -> int | None:
        q = self.q
        one = self._held(key)
        if one is None:
            if key in self._ended:
                raise Refused(
                    f"queue {name!r} no longer holds envelope {key}: no operator's move "
                    "applies to it"
                )
            raise self._gone(name, key)
        if event not in operator_events(one.state):
            raise not_allowed(key, one.state, event)
        call = {EnvEvent.RETRY: q.retry, EnvEvent.CANCEL: q.cancel, EnvEvent.DISCARD: q.discard}
        try:
            done = call[event](one.envelope)
        except EnvqError as error:
            raise refused(key, event, error) from None
        if not done:
            raise Refused(
                f"the {event.value} of envelope {key} moved nothing (its state changed, "
                "or an envelope with its id is live in the queue)"
            )
        if event is EnvEvent.DISCARD:
            return None
        return one.envelope._rec.seq  # a retry begins a new stay

    async def act(self, name: str, action: Action) -> None:
        self._check(name)
        q = self.q
        loop = q.loop
        try:
            if action is Action.START:
                q.start()
            elif loop is None or loop is asyncio.get_running_loop():
                await q.stop(wait=False)
            else:
                done = asyncio.run_coroutine_threadsafe(q.stop(wait=False), loop)
                await asyncio.wrap_future(done)
        except (QueueStopping, QueueTerminated) as error:
            raise Refused(str(error)) from None
        except RuntimeError as error:  # never started: no loop to start it on
            raise Refused(str(error)) from None

    async def aclose(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @property
    def state(self) -> QueueState:
        """The queue's lifecycle state."""
        return self.q.state
