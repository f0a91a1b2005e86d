"""The conformance driver of :class:`envq.postgres.PgQueue`: several nodes, one database.

``python -m envq.postgres.driver --nodes 3`` speaks the driver protocol
(``specs/driver-protocol.md``) on the real clock: each ``queue`` command makes a new
queue in the database, served by ``--nodes`` :class:`PgQueue` objects of this process
(each with its own node name and connection pool) among which the harness's
``workers`` are shared out. The database is ``--dsn`` or ``$ENVQ_DSN``; without
either, a throwaway server is started here and removed at ``quit``.

What the harness is told comes from where it happens:

* every move of the queue and its envelopes is read back from the database's
  journal (``envq.journal``, turned on for the driver's queue only), in the order
  the database made them;
* ``invoke``, ``cancelled``, ``on_failure`` and ``on_success`` are recorded by the
  envelopes' own callables, :func:`invoke`, :func:`on_failure` and :func:`on_success`,
  which run in this process on whichever node claimed the attempt and find their
  script by the envelope's name (its ``id``, carried in the payload too). An
  ``on_success`` call is numbered from the journal: its attempt is the last claim of
  the envelope before the attempt's ``invoke`` began.

The observations of both sources are merged by time: a journal row's is the time it
was written, except that an envelope move that saw the queue in a state the rows
before it have left (it read the queue while a lifecycle call was under way, and
wrote its row after the call's) goes before the queue's move out of that state; the
journal records the state each move saw. A read of the journal takes
the database's snapshot first and then only the observations of this process made
before the snapshot, or before a journal row it returns: so an ``invoke`` is never
reported before the claim that started it, nor a move before the ``on_failure``
call that decided it; ``stats`` is answered from the same snapshot. A call's ``at``
splits them where the call returned. A ``send``, ``start``, ``stop`` or ``terminate``
also says where it took effect in the database (``effect``, see
:func:`envq.postgres._observed.effect`): the nodes go on between two commands, and
the call is judged by the queue as what they did before it took effect left it. A
``start`` or ``stop`` refused at once (which changed nothing) is placed where the
driver received it, so what the nodes did while it ran comes after it; a ``send``
refused at once (which made no move that would time it) gives a range, ``effect`` to
``effect_until``: from a little before the driver received it (a move is timed when
its statement starts and commits later, :data:`COMMIT_LAG_S`) to its return. The
ways this port differs from the in-process queue on purpose are declared in ``hello``
(:data:`DIVERGENCES`, explained in ``docs/postgres.md``, section "Conformance").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TextIO

import envq
from envq._machine import OUTCOMES, Action, Kind, Outcome, QueueState, StopMode
from envq.conform.driving import (
    DriverError,
    arg_choice,
    arg_count,
    arg_flag,
    arg_number,
    arg_optional,
    cause_name,
    error_name,
    play,
)
from envq.conform.protocol import (
    ERRORS,
    HANG_RELEASES,
    PROTOCOL,
    EnvSpec,
    Plan,
    Policy,
)
from envq.postgres._declared import (
    COMMIT_LAG_S,
    DIVERGENCES,
    EFFECTIVE,
    FEATURES,
    REFUSED_AT_ONCE,
    SETTLE_MAX,
    SETTLE_SHARE,
    STATEMENT_S,
    real_poll,
    share,
)
from envq.postgres._observed import Observations, Stop, effect, report
from envq.postgres._queue import PgQueue

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._server import ThrowawayServer

__all__ = [
    "DIVERGENCES",
    "FEATURES",
    "DriverError",
    "Session",
    "invoke",
    "main",
    "on_failure",
    "on_success",
]

log = logging.getLogger("envq.postgres.driver")


# -- the envelopes' callables (module level: they cross processes by name) ---------------

#: The session the callables report to (one per driver process).
_ACTIVE: list[Session] = []


def _session_of(env: envq.Envelope) -> tuple[Session, str] | None:
    payload = env.payload
    if not _ACTIVE or not isinstance(payload, dict):
        return None
    session = _ACTIVE[0]
    if payload.get("session") != session.token:
        return None  # an attempt of a session already reset
    return session, str(payload["env"])


async def invoke(env: envq.Envelope) -> None:
    """A scripted envelope's attempt: the next plan of its script, else its ``then``."""
    found = _session_of(env)
    if found is None:
        return
    session, name = found
    script = session.scripts[name]
    plan = script.popleft() if script else session.specs[name].then
    session.invoked[env] = time.time()
    session.observe("invoke", env=name, plan=plan.value)
    plan = await play(plan, name, session.gates, session.observe, session.real)
    error: BaseException | None = {
        Plan.ERROR: RuntimeError(f"{name}: planned error"),
        Plan.STOP: envq.StopEnvelope(),
        Plan.STOP_TYPE: envq.StopType(),
        Plan.NO_RETRY: envq.DoNotRetry(),
    }.get(plan)
    if error is not None:
        session.raised[name].append((time.time(), cause_name(error)))
        raise error


async def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision | None:
    """A scripted envelope's ``on_failure``: reports the call and answers its policy."""
    found = _session_of(env)
    if found is None:
        return None
    session, name = found
    spec = session.specs[name]
    # A hook that only reports runs after the end committed: not held for the end.
    notes = {"_reports": True} if _reports_only(exc, spec) else {}
    session.observe("on_failure", env=name, error=cause_name(exc), attempt=attempt, **notes)
    if spec.policy is Policy.DROP:
        return envq.drop()
    if spec.policy is Policy.RETRY_NOW:
        return envq.retry_now()
    if spec.policy is Policy.RETRY_AFTER:
        return envq.retry_after(session.real(spec.retry_after))
    if spec.policy is Policy.CRASH:
        raise RuntimeError("on_failure crashed (planned)")
    return None


def _reports_only(exc: BaseException, spec: EnvSpec) -> bool:
    """Whether a node calls ``on_failure`` with ``exc`` to report an end it has
    committed (a ``REPORT_FAILURE`` row: DoNotRetry), rather than to decide it."""
    try:
        outcome = Outcome(cause_name(exc))
    except ValueError:
        return False
    kind = Kind.PERIODIC if spec.periodic else Kind.ONE_OFF
    return OUTCOMES[(kind, outcome)].action is Action.REPORT_FAILURE


async def on_success(env: envq.Envelope) -> None:
    """A scripted envelope's ``on_success``: reports the call, which the node makes once
    the attempt's end has committed. Its attempt's number is found when the call is
    collected (:meth:`Session.collect`): the claim of the envelope before the
    attempt's ``invoke`` (the same object, ``env``, as this call's) began."""
    found = _session_of(env)
    if found is None:
        return
    session, name = found
    session.observe("on_success", env=name, _invoked=session.invoked.pop(env, None))


# -- the session ---------------------------------------------------------------------------


class Session(Observations):
    """One conformance session: the queue's nodes, the scripted envelopes, and what
    was observed and not yet reported. Every method runs on the session's loop.

    :param dsn: the database, holding envq's schema or not (it is installed).
    :param nodes: how many :class:`PgQueue` nodes serve each queue.
    """

    def __init__(self, dsn: str, nodes: int) -> None:
        self.dsn = dsn
        self.node_count = nodes
        self.scale = 0.05
        self.token = uuid.uuid4().hex
        self._t0 = time.time()
        self.nodes: list[PgQueue] = []
        self.queue_name: str | None = None
        self.wait_default = True
        self.sender = 0
        self.db: asyncpg.Pool | None = None
        self.envs: dict[str, envq.Envelope] = {}
        self.specs: dict[str, EnvSpec] = {}
        self.scripts: dict[str, collections.deque[Plan]] = {}
        self.gates: dict[str, tuple[asyncio.Event, list[Plan]]] = {}
        #: What the attempts of each envelope raised: (wall time, cause name).
        self.raised: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        #: When each attempt's invoke began (by its envelope object, one per attempt),
        #: and the claims of each envelope in the journal: (time, its row's ``seq``).
        self.invoked: weakref.WeakKeyDictionary[envq.Envelope, float] = weakref.WeakKeyDictionary()
        self.claims: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        #: In-process observations not yet reported: (wall time, observation).
        self.pending: list[tuple[float, dict[str, Any]]] = []
        #: Journal rows already reported (their ``n``).
        self.seen: set[int] = set()
        #: envelope row (seq) → harness name.
        self.by_seq: dict[int, str] = {}
        #: The driver's view of the queue as reported: names → envelope state; the
        #: admission order; the lifecycle state; the stop under way; the last report.
        self.states: dict[str, str] = {}
        self.admitted: dict[str, int] = {}
        self.life = QueueState.INIT.value
        self.run: Stop | None = None
        self.last_report: dict[str, Any] = report([], [], [], complete=False)
        self.background: set[asyncio.Task[Any]] = set()

    # -- plumbing ---------------------------------------------------------------------

    def model(self, wall: float) -> float:
        """Model time of a wall-clock time."""
        return (wall - self._t0) / self.scale

    def real(self, seconds: float) -> float:
        """Model seconds as real seconds."""
        return seconds * self.scale

    def observe(self, kind: str, **fields: Any) -> None:
        """Record one observation of this process."""
        now = time.time()
        self.pending.append((now, {"t": self.model(now), "kind": kind, **fields}))

    def _queue(self) -> PgQueue:
        if not self.nodes:
            raise DriverError("no queue: send a 'queue' command first")
        return self.nodes[0]

    def _pool(self) -> asyncpg.Pool:
        assert self.db is not None
        return self.db

    def _names(self, command: dict[str, Any]) -> list[str]:
        names = command.get("envs", [])
        if not isinstance(names, list):
            raise DriverError(f"envs must be a list of names, got {names!r}")
        for name in names:
            if not isinstance(name, str) or name not in self.envs:
                raise DriverError(f"unknown envelope {name!r}")
        return names

    async def open(self) -> None:
        """Connect, and install envq's schema unless the database has it."""
        import asyncpg  # noqa: PLC0415

        await PgQueue(self.dsn, "conform-install", workers=0).install()
        self.db = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2)

    async def close(self) -> None:
        """End the session: terminate and leave the queue, close the connections."""
        await self._drop_queue()
        if self.db is not None:
            await self.db.close()
            self.db = None

    async def _drop_queue(self) -> None:
        """Terminate the current queue (if it is not), close its nodes, delete its rows."""
        import asyncpg  # noqa: PLC0415

        for gate, holder in list(self.gates.values()):
            holder.append(Plan.OK)
            gate.set()
        if not self.nodes:
            return
        name = self.queue_name
        failed = ""
        try:
            if await self.nodes[0].state() is not QueueState.TERMINATED:
                await self.nodes[0].terminate()
        except Exception as exc:
            log.exception("terminating queue %r", name)
            failed = f"terminating queue {name!r} failed ({type(exc).__name__}: {exc}); "
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        self.background.clear()
        await asyncio.gather(*(node.close() for node in self.nodes), return_exceptions=True)
        self.nodes = []
        db = self._pool()
        try:
            async with db.acquire() as conn, conn.transaction():
                await conn.execute("DELETE FROM envq.journal WHERE queue = $1", name)
                await conn.execute("DELETE FROM envq.envelopes WHERE queue = $1", name)
                await conn.execute("DELETE FROM envq.queues WHERE name = $1", name)
        except asyncpg.PostgresError as exc:
            # A row the terminate left live refuses the clean-up: say what the rows
            # were, and why the terminate failed if it did (the clean-up's error alone
            # would hide it).
            left = await db.fetch(
                "SELECT seq, state::text AS state, kind::text AS kind, event::text AS event,"
                " due_at, updated_at FROM envq.envelopes WHERE queue = $1"
                " AND state NOT IN ('succeeded', 'failed', 'stopped', 'returned')",
                name,
            )
            queue = await db.fetchval("SELECT state::text FROM envq.queues WHERE name = $1", name)
            rows = "; ".join(str(dict(row)) for row in left[:5])
            raise DriverError(
                f"{failed}cleaning up queue {name!r} ({queue}) failed: {exc}; live rows: {rows}"
            ) from exc

    # -- the observations ---------------------------------------------------------------

    async def settle(self) -> None:
        """Let the nodes catch up: a short pause, then (a bounded while) until the queue
        is in no passing state (:meth:`_pending`)."""
        await asyncio.sleep(self.real(SETTLE_SHARE))
        if not self.nodes:
            return
        until = time.monotonic() + SETTLE_MAX
        while time.monotonic() < until:
            found = await self._pool().fetchrow(
                "SELECT q.state::text AS state,"
                " count(*) FILTER (WHERE e.state = 'ready') AS ready,"
                " count(*) FILTER (WHERE e.state = 'running') AS running"
                " FROM envq.queues AS q LEFT JOIN envq.envelopes AS e ON e.queue = q.name"
                " WHERE q.name = $1 GROUP BY q.state",
                self.queue_name,
            )
            if found is None:
                return
            counts = {"ready": found["ready"], "running": found["running"]}
            if not self._pending(found["state"], counts):
                return
            await asyncio.sleep(0.005)

    # -- commands -----------------------------------------------------------------------

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        """Carry out one command; the response with the observations it caused."""
        cmd = command.get("cmd")
        method: Callable[[dict[str, Any]], Coroutine[Any, Any, Any]] | None = getattr(
            self, f"cmd_{cmd}", None
        )
        if not isinstance(cmd, str) or method is None:
            raise DriverError(f"unknown command {cmd!r}")
        response: dict[str, Any]
        received = time.time()
        try:
            result = await method(command)
        except envq.EnvqError as exc:
            response = {"ok": False, "error": error_name(exc), "message": str(exc)}
        except ValueError as exc:
            response = {"ok": False, "error": ERRORS["ValueError"], "message": str(exc)}
        else:
            response = {"ok": True, "result": result}
        # A call refused at once changed nothing: it is placed where the driver received
        # it, so the moves the nodes made while it ran come after it (placed where it
        # returned, an envelope that ended meanwhile changed the live envelopes across
        # it). A send refused at once read the queue as the moves committed before its
        # statement's snapshot left it, somewhere between a little before the driver
        # received it (a move is timed when its statement starts, and commits later)
        # and its return: it is judged at the first point of that range where the model
        # explains it (``effect`` to ``effect_until``). A call that waits (send_wait,
        # ...) is refused for what happened meanwhile.
        refused_at_once = cmd in REFUSED_AT_ONCE and not response["ok"]
        ranged = refused_at_once and cmd == "send"
        placed = received if refused_at_once and not ranged else time.time()
        if cmd in ("quit", "reset", "hello") or self.queue_name is None:
            events: list[dict[str, Any]] = [self._reported(ev) for _, ev in self.pending]
            self.pending = []
            at = len(events)
        else:
            await self.settle()
            stats = cmd == "stats" and response["ok"]
            timed, counts = await self.collect(stats=stats)
            events = [ev for _, ev in timed]
            at = sum(1 for w, _ in timed if w <= placed)
            if ranged:
                response["effect"] = sum(1 for w, _ in timed if w <= received - COMMIT_LAG_S)
                response["effect_until"] = at
            elif cmd in EFFECTIVE:
                response["effect"] = min(at, effect(cmd, response["ok"], timed, received))
            if stats:
                at = len(events)
                response["result"] = self._stats(counts)
            elif cmd in ("stop", "wait_stopped") and response["ok"]:
                response["result"] = self._stop_result(response["result"])
        response["events"] = events
        response["at"] = at
        response["t"] = self.model(time.time())
        return response

    def _stats(self, counts: Any) -> dict[str, Any]:
        state, by_state = counts
        live = ("buffered", "ready", "delayed", "running", "parked")
        return {
            "state": state,
            "capacity_used": sum(n for s, n in by_state.items() if s in live),
            "by_state": {s: n for s, n in by_state.items() if s in live},
            "in_flight": by_state.get("running", 0),
        }

    def _stop_result(self, result: Any) -> Any:
        if isinstance(result, dict) and result.get("timed_out"):
            return result
        if self.life in ("stopped", "terminated") or self.run is None:
            return self.last_report
        return self._report(complete=False)

    async def cmd_hello(self, command: dict[str, Any]) -> dict[str, Any]:
        """Agree on the protocol and take the time scale."""
        if command.get("protocol", PROTOCOL) != PROTOCOL:
            raise DriverError(f"protocol {command.get('protocol')!r} unknown (speaks {PROTOCOL})")
        if "time_scale" in command:
            value = command["time_scale"]
            try:
                scale = arg_number(command, "time_scale")
            except DriverError:
                scale = 0.0
            if scale <= 0:
                raise DriverError(f"time_scale must be a finite number > 0, got {value!r}")
            self.scale = scale
        self._t0 = time.time()
        return {
            "driver": "envq.postgres",
            "version": envq.__version__,
            "protocol": PROTOCOL,
            "clock": "real",
            "features": list(FEATURES),
            "divergences": [dict(d) for d in DIVERGENCES],
            # A keeper reads a committed cancel (a stop's, a terminate's, a ban) at its
            # next round, and moves a due envelope at its next round (within a poll of
            # the due time), each in a statement of its own.
            "cancel_latency": (2 * real_poll(self.scale) + STATEMENT_S) / self.scale,
            "due_latency": (2 * real_poll(self.scale) + STATEMENT_S) / self.scale,
        }

    async def cmd_queue(self, command: dict[str, Any]) -> None:
        """A new queue in the database, served by the nodes."""
        if self.nodes and self.life != QueueState.TERMINATED.value:
            raise DriverError("the previous queue was not terminated")
        workers = arg_count(command, "workers", 1)
        if workers < 1:
            raise DriverError(f"workers must be >= 1, got {workers}")
        capacity = arg_count(command, "capacity", 0)
        stop_mode = arg_choice(StopMode, command.get("stop_mode", "drain"), "stop_mode")
        wait = arg_flag(command, "wait", True)
        await self._drop_queue()
        self.queue_name = f"conform-{uuid.uuid4().hex[:12]}"
        self.wait_default = bool(wait)
        self.life = QueueState.INIT.value
        self.run = None
        self.last_report = report([], [], [], complete=False)
        self.states.clear()
        self.by_seq.clear()
        poll = real_poll(self.scale)
        self.nodes = [
            PgQueue(
                self.dsn,
                self.queue_name,
                workers=n,
                capacity=capacity,
                lease=30.0,
                node=f"conform-node-{i}",
                poll=poll,
                stop_mode=stop_mode,
            )
            for i, n in enumerate(share(workers, self.node_count))
        ]
        for node in self.nodes:
            await node.connect()
        await self._pool().execute(
            "UPDATE envq.queues SET journal = true WHERE name = $1", self.queue_name
        )

    async def cmd_define(self, command: dict[str, Any]) -> None:
        """A scripted envelope, under the name the later commands use (its ``id``)."""
        name = command.get("env")
        if not isinstance(name, str) or name in self.envs:
            raise DriverError(f"bad or duplicate envelope name {name!r}")
        data = command.get("spec", {})
        if not isinstance(data, dict):
            raise DriverError(f"spec must be an object, got {data!r}")
        try:
            spec = EnvSpec.from_json(data)
            if spec.cron:
                raise ValueError("cron is not supported by this driver")
            retry = None
            # RETRY on a periodic spec means no decision (envq refuses a policy there).
            if spec.policy is Policy.RETRY and not (spec.interval > 0 or spec.cron):
                retry = envq.Retry(
                    attempts=spec.attempts,
                    base=self.real(spec.base),
                    cap=self.real(spec.cap),
                    jitter=False,
                )
            env = envq.Envelope(
                invoke=invoke,
                id=name,
                type=spec.type,
                interval=self.real(spec.interval),
                deadline=self.real(spec.deadline),
                delay=self.real(spec.delay),
                schedule=envq.FIXED_RATE if spec.fixed_rate else envq.FIXED_DELAY,
                on_failure=on_failure if spec.policy.has_on_failure else None,
                on_success=on_success if spec.on_success else None,
                retry=retry,
                payload={"env": name, "session": self.token},
            )
        except (TypeError, ValueError) as exc:
            raise DriverError(f"bad spec for {name!r}: {exc}") from exc
        self.envs[name] = env
        self.specs[name] = spec
        self.scripts[name] = collections.deque(spec.script)

    async def cmd_plan(self, command: dict[str, Any]) -> None:
        """Append a plan to an envelope's script."""
        name = command.get("env")
        if not isinstance(name, str) or name not in self.envs:
            raise DriverError(f"unknown envelope {name!r}")
        self.scripts[name].append(arg_choice(Plan, command.get("plan"), "plan"))

    async def cmd_release(self, command: dict[str, Any]) -> bool:
        """Let a hanging attempt go on with a plan; False if it does not hang."""
        name = command.get("env")
        plan = arg_choice(Plan, command.get("plan"), "plan")
        if plan not in HANG_RELEASES:
            raise DriverError(f"a hanging attempt is released with one of {HANG_RELEASES}")
        gate = self.gates.get(name) if isinstance(name, str) else None
        if gate is None:
            return False
        gate[1].append(plan)
        gate[0].set()
        return True

    async def cmd_start(self, command: dict[str, Any]) -> None:
        """``start()`` on the first node; the others then serve too (a no-op call)."""
        first = self._queue()
        await first.start()
        for node in self.nodes[1:]:
            if node.workers:
                await node.start()

    def _sender(self) -> PgQueue:
        """The node a send goes through: each in turn."""
        node = self.nodes[self.sender % len(self.nodes)]
        self.sender += 1
        return node

    async def cmd_send(self, command: dict[str, Any]) -> None:
        """``send(*envs)`` through one of the nodes."""
        self._queue()
        names = self._names(command)
        await self._sender().send(*(self.envs[n] for n in names))

    async def _blocking(self, coro: Coroutine[Any, Any, Any], command: dict[str, Any]) -> Any:
        """Await ``coro`` for at most the command's ``limit`` (model seconds); on time
        out it goes on, and the answer is ``{"timed_out": true}``."""
        try:
            limit = arg_optional(command, "limit")
        except DriverError:
            coro.close()
            raise
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        if limit is None:
            return await task
        done, _ = await asyncio.wait({task}, timeout=self.real(limit))
        if not done:
            return {"timed_out": True}
        return task.result()

    async def cmd_send_wait(self, command: dict[str, Any]) -> Any:
        """``send_wait(*envs, timeout)``; blocks for at most ``limit``."""
        self._queue()
        names = self._names(command)
        timeout = arg_optional(command, "timeout")
        node = self._sender()

        async def go() -> None:
            await node.send_wait(
                *(self.envs[n] for n in names),
                timeout=None if timeout is None else self.real(timeout),
            )

        return await self._blocking(go(), command)

    async def cmd_stop(self, command: dict[str, Any]) -> Any:
        """``stop(mode, cancel, wait)`` on the first node; the report, from the journal."""
        q = self._queue()
        mode = command.get("mode")
        arg_optional(command, "limit")
        chosen = None if mode is None else arg_choice(StopMode, mode, "mode")
        cancel = bool(arg_flag(command, "cancel", False))
        wait = arg_flag(command, "wait", None)
        if wait is None:
            wait = self.wait_default
        if cancel and (chosen or q.stop_mode) is StopMode.DRAIN:
            raise ValueError("stop(): cancel=True needs mode=stop, the mode is drain")
        state = await q.state()
        if state in (QueueState.INIT, QueueState.STOPPED, QueueState.TERMINATED):
            return None  # a no-op: the last report
        return await self._blocking(q.stop(chosen, cancel=cancel, wait=wait), command)

    async def cmd_wait_stopped(self, command: dict[str, Any]) -> Any:
        """``wait_stopped()``; the final report."""
        q = self._queue()
        return await self._blocking(q.wait_stopped(), command)

    async def cmd_terminate(self, command: dict[str, Any]) -> Any:
        """``terminate()`` on the first node; the names of the envelopes handed back."""
        q = self._queue()

        async def handed() -> Any:
            envelopes = await q.terminate()
            return {"handed_back": [str(env.id) for env in envelopes]}

        return await self._blocking(handed(), command)

    async def cmd_advance(self, command: dict[str, Any]) -> None:
        """Let ``seconds`` of model time pass."""
        await asyncio.sleep(self.real(arg_number(command, "seconds", 0)))

    async def cmd_stats(self, command: dict[str, Any]) -> None:
        """The statistics, answered from the snapshot the observations come from."""
        self._queue()

    async def cmd_reset(self, command: dict[str, Any]) -> None:
        """Start over as a fresh session (same database and time scale)."""
        await self._drop_queue()
        scale, db = self.scale, self.db
        self.__init__(self.dsn, self.node_count)  # type: ignore[misc]
        self.scale, self.db = scale, db
        _ACTIVE[:] = [self]

    async def cmd_quit(self, command: dict[str, Any]) -> None:
        """End the session."""
        await self.close()


class _Loop:
    """The session's event loop, running in a thread of its own so that the nodes go
    on between commands."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def answer(loop: _Loop, session: Session, line: str) -> tuple[dict[str, Any], bool]:
    """The response to one command line, and whether it was ``quit``."""
    try:
        command = json.loads(line)
        if not isinstance(command, dict):
            raise DriverError(f"a command is a JSON object, got {command!r}")
        return loop.run(session.handle(command)), command.get("cmd") == "quit"
    except (DriverError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        return {"ok": False, "error": "DriverError", "message": str(exc), "events": []}, False
    except (Exception, concurrent.futures.CancelledError) as exc:
        log.exception("the driver failed")
        message = f"the driver failed: {type(exc).__name__}: {exc}"
        return {"ok": False, "error": "DriverError", "message": message, "events": []}, False


def serve(dsn: str, nodes: int, stdin: TextIO, stdout: TextIO) -> None:
    """Answer one JSON command per line until ``quit`` or the end of input."""
    loop = _Loop()
    session = Session(dsn, nodes)
    _ACTIVE[:] = [session]
    try:
        loop.run(session.open())
        for line in stdin:
            if not line.strip():
                continue
            response, quitting = answer(loop, _ACTIVE[0], line)
            stdout.write(json.dumps(response) + "\n")
            stdout.flush()
            if quitting:
                return
        loop.run(_ACTIVE[0].close())
    finally:
        loop.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m envq.postgres.driver [--nodes N] [--dsn DSN]``."""
    parser = argparse.ArgumentParser(prog="python -m envq.postgres.driver", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3, help="PgQueue nodes per queue (3)")
    parser.add_argument("--dsn", help="the database (default: $ENVQ_DSN, else a throwaway one)")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error(f"--nodes must be >= 1, got {args.nodes}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # A planned on_failure crash is logged by the queue; that is not the protocol's.
    logging.getLogger("envq").setLevel(logging.CRITICAL)
    dsn = args.dsn or os.environ.get("ENVQ_DSN")
    server: ThrowawayServer | None = None
    if not dsn:
        from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

        server = ThrowawayServer()
        server.start()
        dsn = server.dsn()
    try:
        serve(dsn, args.nodes, sys.stdin, sys.stdout)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    # The envelopes name their callables by import path: run the module's own copy,
    # not this __main__ one, so that the nodes resolve them to the same objects.
    from envq.postgres.driver import main as _main

    sys.exit(_main())
