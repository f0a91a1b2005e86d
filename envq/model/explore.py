"""Exhaustive small-scope explorer: the runtime tables against the invariants.

An abstract queue — its lifecycle state, the stop under way, the blacklisted types,
``capacity_used`` — holds a few envelopes with abstract states. Every operation a
user, an operator or the clock can perform is an edge: ``start``, ``stop(mode,
cancel)``, ``terminate``, ``send(batch)``, ``retry(e)``, ``cancel(e)``, ``discard(e)``,
``dispatch(e)``, ``due(e)``, the end of ``e``'s attempt
with each outcome (and, for an outcome whose row asks for a failure decision, each
decision; ``EXPIRED`` too: only a store shared by several processes produces it, but
its rows are table rows like any other), and the internal ``drained`` and ``abandon``
(a worker cancelled from outside). A breadth-first search with
memoisation on the abstract state visits every state reachable within a bounded number
of operations and checks the invariants of :mod:`envq.model.invariants` at every state
and on every edge.

The explorer is not the runtime: it is a plain-Python abstract model that *drives* its
moves by the runtime tables (``envq._machine``), as the engine does — the lifecycle
action and target from ``LIFECYCLE``, the attempt's action and target from
``OUTCOMES`` with ``DECISION_TARGET``, ``SHELVE_TARGET``, ``LIMITED`` and
``PARK_INSTEAD``, what a stop parks from ``STOP_PARKS``, how an envelope is armed from
``ARMED``, a typeless envelope's outcome from ``TYPELESS`` — and
checks every move against ``ENVELOPE_MOVES`` and against the python-statemachine
models. What the explorer decides on its own, from the contract, is which queue-side
event applies to which envelope and how capacity is accounted (by action, not by
target), so a table row that contradicts its action or the contract shows up as a
violation. The live states and the ones each lifecycle state may hold (invariant I6)
are the oracle's (``envq.conform.oracle``: ``LIVE``, ``ALLOWED_LIVE``, both derived from
the tables), the stop modes envq's own.

Usage::

    python -m envq explore [--depth 12] [--show 5]

It prints the number of states explored per scope and every violation (with the
shortest trace to it), and exits non-zero if there is one (:func:`run`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Final, NamedTuple, assert_never

import attrs

from envq import _machine as machine
from envq._machine import (
    Action,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    LifeRow,
    Outcome,
    OutcomeRow,
    QueueCall,
    QueueState,
    StopMode,
)
from envq.conform.oracle import ALLOWED_LIVE, LIVE
from envq.model.lifecycle import REJECTED
from envq.model.tables import envelope_moves, lifecycle_moves

__all__ = [
    "SCOPES",
    "UNREACHABLE",
    "Config",
    "Report",
    "Tables",
    "Violation",
    "explore",
    "run",
    "uncovered",
]

_E = EnvState
ENDED: Final = frozenset({_E.SUCCEEDED, _E.FAILED, _E.STOPPED})


@attrs.frozen
class Tables:
    """The runtime tables the explorer is driven by (a broken copy can be passed in)."""

    lifecycle: Mapping[tuple[QueueState, QueueCall], LifeRow] = machine.LIFECYCLE
    outcomes: Mapping[tuple[Kind, Outcome], OutcomeRow] = machine.OUTCOMES
    moves: Mapping[tuple[EnvState, EnvEvent | Outcome], frozenset[EnvState]] = (
        machine.ENVELOPE_MOVES
    )
    decision_target: Mapping[DecisionKind, EnvState] = machine.DECISION_TARGET
    shelve_target: Mapping[CancelCause, EnvState] = machine.SHELVE_TARGET
    park_instead: Mapping[EnvState, EnvState] = machine.PARK_INSTEAD
    limited: Mapping[EnvState, EnvState] = machine.LIMITED
    armed: Mapping[bool, EnvState] = machine.ARMED
    stop_parks: Mapping[StopMode, frozenset[EnvState]] = machine.STOP_PARKS
    typeless: Mapping[Outcome, Outcome] = machine.TYPELESS


@attrs.frozen
class Config:
    """The scope: the envelopes (schedule kind and ``type`` each) and the capacity."""

    kinds: tuple[Kind, ...] = (Kind.ONE_OFF, Kind.PERIODIC)
    types: tuple[str, ...] = ("t", "t")
    capacity: int = 0
    depth: int = 12


class Env(NamedTuple):
    """One envelope's abstract state, for its current stay."""

    state: EnvState = EnvState.NEW
    #: Attempts in flight (I3: at most one, exactly when RUNNING).
    in_flight: int = 0
    #: Who asked to cancel the attempt in flight, if anyone.
    cancel: CancelCause | None = None
    #: Events into SUCCEEDED/FAILED/STOPPED during this stay.
    ended: int = 0
    #: Times included in what ``terminate()`` handed back during this stay.
    handed: int = 0
    #: An attempt ended STOP/STOP_TYPE, or the type was blacklisted (I4).
    stopped: bool = False
    #: ``send()`` buffered or admitted it: a stay is under way or over.
    admitted: bool = False
    #: An operator cancelled it while its attempt was in flight (relabelled).
    cancelled: bool = False


class World(NamedTuple):
    """The abstract queue: lifecycle state, stop under way, blacklist, capacity, envelopes."""

    queue: QueueState
    mode: StopMode | None
    terminating: bool
    blacklist: frozenset[str]
    used: int
    envs: tuple[Env, ...]


@attrs.frozen
class Violation:
    """An invariant broken at a state or on an edge, with the operations leading there."""

    invariant: str
    message: str
    trace: tuple[str, ...]

    def __str__(self) -> str:
        steps = " → ".join(self.trace) or "(initial state)"
        return f"[{self.invariant}] {self.message}\n    after: {steps}"


@attrs.frozen
class Report:
    """What one exploration found."""

    config: Config
    states: int
    edges: int
    max_depth: int
    frontier: int
    violations: tuple[Violation, ...]
    #: Table entries the exploration used (see :func:`uncovered`).
    covered: frozenset[tuple[object, ...]] = frozenset()


class _Step:
    """A mutable copy of a :class:`World` that one operation is applied to."""

    def __init__(self, world: World, tables: Tables, config: Config, label: str) -> None:
        self.queue = world.queue
        self.mode = world.mode
        self.terminating = world.terminating
        self.blacklist = set(world.blacklist)
        self.used = world.used
        self.envs = list(world.envs)
        self.tables = tables
        self.config = config
        self.label = label
        self.problems: list[tuple[str, str]] = []
        #: Table entries this step used: lifecycle rows, outcome rows, envelope moves.
        self.covered: set[tuple[object, ...]] = set()

    def freeze(self) -> World:
        return World(
            self.queue,
            self.mode,
            self.terminating,
            frozenset(self.blacklist),
            self.used,
            tuple(self.envs),
        )

    def problem(self, invariant: str, message: str) -> None:
        self.problems.append((invariant, message))

    # -- envelope moves ----------------------------------------------------------------

    def move(self, i: int, event: EnvEvent | Outcome, target: EnvState) -> None:
        """Move envelope ``i``; check the move against the runtime relation and the model."""
        env = self.envs[i]
        pair = (env.state, event)
        self.covered.add(("move", env.state, event, target))
        if target not in self.tables.moves.get(pair, frozenset()):
            self.problem(
                "I7",
                f"e{i}: {env.state.name} --{event.name}--> {target.name} is not in ENVELOPE_MOVES",
            )
        if target not in _MODEL_MOVES.get(pair, frozenset()):
            self.problem(
                "I7",
                f"e{i}: {env.state.name} --{event.name}--> {target.name} "
                "is not a transition of EnvelopeModel",
            )
        ended = env.ended + (target in ENDED)
        self.envs[i] = env._replace(state=target, ended=ended)

    def release(self) -> None:
        self.used -= 1

    # -- lifecycle ---------------------------------------------------------------------

    def row(self, call: QueueCall) -> LifeRow | None:
        row = self.tables.lifecycle.get((self.queue, call))
        self.covered.add(("lifecycle", self.queue, call))
        if row is None:
            self.problem("I7", f"LIFECYCLE has no row for ({self.queue.name}, {call.name})")
        return row

    def enter(self, call: QueueCall, row: LifeRow) -> None:
        """Apply a lifecycle row's target; check the step is a model transition."""
        pair = (self.queue, call)
        if row.action is LifeAction.REJECT:
            wanted = REJECTED.get(pair)
            if row.error is not wanted:
                got = row.error.__name__ if row.error is not None else None
                self.problem(
                    "I7",
                    f"{pair[0].name}.{call.name} raises {got} by the table, "
                    f"{wanted.__name__ if wanted else 'nothing'} by the contract",
                )
            return
        if row.target is None or _MODEL_LIFE.get(pair) is not row.target:
            target = row.target.name if row.target is not None else None
            self.problem(
                "I7",
                f"{pair[0].name} --{call.name}--> {target} is not a transition of LifecycleModel",
            )
            return
        self.queue = row.target

    def perform(
        self,
        call: QueueCall,
        row: LifeRow,
        choices: Sequence[EnvState] = (),
        batch: Sequence[int] = (),
        mode: StopMode = StopMode.DRAIN,
        cancel: bool = False,
    ) -> None:
        """Perform a lifecycle row's action, as ``Queue`` does (one exhaustive match)."""
        match row.action:
            case LifeAction.NOTHING | LifeAction.REJECT | LifeAction.AWAIT_STOP:
                self.enter(call, row)
            case LifeAction.BUFFER | LifeAction.ADMIT:
                self.enter(call, row)
                self.admit(batch, choices)
            case LifeAction.ARM:
                self.enter(call, row)
                self.mode = None
                armable = [i for i, e in enumerate(self.envs) if e.state in _ARMABLE]
                for i, target in zip(armable, choices, strict=True):
                    self.move(i, EnvEvent.START, target)
            case LifeAction.BEGIN_STOP:
                self.enter(call, row)
                self.begin_stop(mode, CancelCause.STOP if cancel else None)
            case LifeAction.FINISH_STOP:
                self.enter(call, row)
                self.mode = None
                if self.terminating:
                    self.terminating = False
                    hand_back = self.row(QueueCall.TERMINATE)
                    if hand_back is not None:
                        self.perform(QueueCall.TERMINATE, hand_back)
            case LifeAction.STOP_THEN_TERMINATE:
                # As stop(mode=STOP, cancel=True): the queue passes through STOPPING.
                stop = self.row(QueueCall.STOP)
                if stop is not None:
                    self.enter(QueueCall.STOP, stop)
                self.begin_stop(StopMode.STOP, CancelCause.TERMINATE)
                self.terminating = True
            case LifeAction.ESCALATE_THEN_TERMINATE:
                self.begin_stop(StopMode.STOP, CancelCause.TERMINATE)
                self.terminating = True
            case LifeAction.ESCALATE:
                self.enter(call, row)
                self.begin_stop(StopMode.STOP, CancelCause.STOP)
            case LifeAction.HAND_BACK:
                self.enter(call, row)
                for i, env in enumerate(self.envs):
                    if env.state in LIVE:
                        if env.state is EnvState.RUNNING:
                            self.problem("I5", f"e{i}: handed back while its attempt runs")
                            continue
                        self.envs[i] = env._replace(handed=env.handed + 1)
                        self.move(i, EnvEvent.TERMINATE, EnvState.RETURNED)
                        self.release()
            case _ as unreachable:
                assert_never(unreachable)

    def begin_stop(self, mode: StopMode, cause: CancelCause | None) -> None:
        """Park what the mode parks; ask in-flight attempts to cancel if ``cause``."""
        self.mode = mode
        parks = self.tables.stop_parks[mode]
        for i, env in enumerate(self.envs):
            if env.state in parks:
                self.move(i, EnvEvent.STOP, EnvState.PARKED)
            elif env.state is EnvState.RUNNING and cause is not None:
                self.envs[i] = env._replace(cancel=cause)

    def admit(self, batch: Sequence[int], choices: Sequence[EnvState]) -> None:
        """``send(*batch)`` in INIT (buffer) or RUNNING (admit): send's checks, then admission."""
        types = self.config.types
        if any(types[i] and types[i] in self.blacklist for i in batch):
            return  # TypeBlacklisted: nothing admitted
        fresh = [i for i in dict.fromkeys(batch) if self.envs[i].state not in LIVE]
        cap = self.config.capacity
        if cap and self.used + len(fresh) > cap:
            return  # CapacityExceeded: nothing admitted
        for i, target in zip(fresh, choices, strict=True):
            self.envs[i] = Env(admitted=True)  # a new stay starts at NEW
            self.used += 1
            self.move(i, EnvEvent.SEND, target)

    # -- the end of an attempt (the worker) --------------------------------------------

    def end(
        self, i: int, outcome: Outcome, decision: DecisionKind | None, limited: bool = False
    ) -> None:
        """The attempt of envelope ``i`` ended: look the row up, perform its action
        (``limited``: the failure limiter asks a retry to wait)."""
        env = self.envs[i]
        kind = self.config.kinds[i]
        type_ = self.config.types[i]
        if type_ and type_ in self.blacklist:
            kind = Kind.BLACKLISTED
        if env.cancelled:
            kind = Kind.CANCELLED
        raised = outcome
        if not type_:
            outcome = self.tables.typeless.get(outcome, outcome)
        row = self.tables.outcomes.get((kind, outcome))
        self.covered.add(("outcome", kind, outcome))
        if row is None:
            self.problem("I7", f"OUTCOMES has no row for ({kind.name}, {outcome.name})")
            return
        t = self.tables
        releases = False
        target: EnvState
        match row.action:
            case Action.SUCCEED | Action.REPORT_FAILURE | Action.END:
                target, releases = row.target, True
            case Action.RESCHEDULE:
                target = row.target
            case Action.DECIDE:
                target = row.target if decision is None else t.decision_target[decision]
                releases = decision in (None, DecisionKind.DROP)
            case Action.DECIDE_PERIODIC:
                target = row.target if decision is None else t.decision_target[decision]
                releases = decision is DecisionKind.DROP
            case Action.BLACKLIST:
                target, releases = row.target, True
            case Action.SHELVE:
                if env.cancel is None:
                    self.problem("I6", f"e{i}: CANCELLED without a cancel")
                    return
                target = t.shelve_target[env.cancel]
                releases = env.cancel is CancelCause.TERMINATE
            case _ as unreachable:
                assert_never(unreachable)
        if limited and not releases:
            target = t.limited.get(target, target)
        if not releases and self.queue is not QueueState.RUNNING:
            target = t.park_instead.get(target, target)
        if target not in {row.target, *row.redirects}:
            self.problem(
                "I7",
                f"e{i}: ({kind.name}, {outcome.name}) chose {target.name}, "
                "outside the row's target and redirects",
            )
        stopped = raised in (Outcome.STOP, Outcome.STOP_TYPE) or kind in _CUT
        self.envs[i] = env._replace(
            in_flight=env.in_flight - 1,
            cancel=None,
            stopped=env.stopped or stopped,
            cancelled=False,
        )
        self.move(i, outcome, target)
        if releases:
            self.release()
            if row.action is Action.SHELVE:
                self.envs[i] = self.envs[i]._replace(handed=self.envs[i].handed + 1)
        if row.action is Action.BLACKLIST and type_:
            self.blacklist.add(type_)
            for j, other in enumerate(self.envs):
                if (
                    j != i
                    and self.config.types[j] == type_
                    and other.state in LIVE
                    and other.state is not EnvState.RUNNING
                ):
                    self.envs[j] = other._replace(stopped=True)
                    self.move(j, EnvEvent.BLACKLIST, EnvState.STOPPED)
                    self.release()

    # -- an operator's moves ----------------------------------------------------------

    def retry(self, i: int) -> None:
        """An operator sends envelope ``i`` (ended FAILED or STOPPED) back: checked as a
        send is (the lifecycle's SEND row, the blacklist, the capacity); a new stay
        that keeps the story of the last."""
        env = self.envs[i]
        row = self.row(QueueCall.SEND)
        if row is None or row.action not in (LifeAction.BUFFER, LifeAction.ADMIT):
            return  # the lifecycle refuses it, as a send
        type_ = self.config.types[i]
        if type_ and type_ in self.blacklist:
            return  # TypeBlacklisted
        cap = self.config.capacity
        if cap and self.used + 1 > cap:
            return  # CapacityExceeded
        to = EnvState.BUFFERED if row.action is LifeAction.BUFFER else EnvState.READY
        self.envs[i] = Env(state=env.state, admitted=True)
        self.used += 1
        self.move(i, EnvEvent.RETRY, to)

    def cancel(self, i: int) -> None:
        """An operator cancels live envelope ``i``: STOPPED at once, or, running,
        relabelled (its attempt ends STOPPED whatever its outcome)."""
        env = self.envs[i]
        if env.state is EnvState.RUNNING:
            self.envs[i] = env._replace(cancelled=True)
            return
        self.envs[i] = env._replace(stopped=True)
        self.move(i, EnvEvent.CANCEL, EnvState.STOPPED)
        self.release()

    def discard(self, i: int) -> None:
        """An operator discards ended envelope ``i``: out of the queue's keeping."""
        self.move(i, EnvEvent.DISCARD, EnvState.NEW)
        self.envs[i] = Env()

    def dispatch(self, i: int) -> None:
        """A worker takes READY envelope ``i``."""
        env = self.envs[i]
        if env.stopped:
            self.problem("I4", f"e{i}: an attempt starts after STOP")
        self.envs[i] = env._replace(in_flight=env.in_flight + 1)
        self.move(i, EnvEvent.DISPATCH, EnvState.RUNNING)


_ARMABLE: Final = frozenset({EnvState.BUFFERED, EnvState.PARKED})
#: The row groups of an attempt whose end is no longer its own (its type banned, or an
#: operator's cancel): it ends STOPPED whatever its outcome.
_CUT: Final = frozenset({Kind.BLACKLISTED, Kind.CANCELLED})
#: What an operator may retry, cancel and discard (docs/operating.md).
_RETRIABLE: Final = frozenset({EnvState.FAILED, EnvState.STOPPED})
_DISCARDABLE: Final = ENDED
_MODEL_MOVES: Final = envelope_moves()
_MODEL_LIFE: Final = lifecycle_moves()
_STOPS: Final = ((StopMode.DRAIN, False), (StopMode.STOP, False), (StopMode.STOP, True))
#: The failure decisions an attempt's end may take, and whether the limiter asks the
#: retry to wait (only a retry can be limited).
#: The actions that ask for a failure decision (``on_failure``, the ``Retry`` policy).
_DECIDING: Final = frozenset({Action.DECIDE, Action.DECIDE_PERIODIC})
_DECISIONS: Final = (
    *((d, False) for d in (None, *DecisionKind)),
    *((d, True) for d in (DecisionKind.RETRY_NOW, DecisionKind.RETRY_AFTER)),
)


def _successors(world: World, tables: Tables, config: Config) -> Iterator[_Step]:
    """Every operation possible in ``world``, each applied to a fresh copy."""

    def step(label: str) -> _Step:
        return _Step(world, tables, config, label)

    n = len(world.envs)
    armed = tuple(dict.fromkeys(tables.armed.values()))
    # the outcomes a failure decision settles: those with a deciding row in the tables
    # explored (ERROR, TIMEOUT and EXPIRED in the real ones)
    decided = {o for (_, o), r in tables.outcomes.items() if r.action in _DECIDING}
    # start()
    row = tables.lifecycle.get((world.queue, QueueCall.START))
    arms = sum(e.state in _ARMABLE for e in world.envs)
    if row is None or row.action is not LifeAction.ARM:
        arms = 0
    for choices in itertools.product(armed, repeat=arms):
        s = step("start" + "".join(f"[{c.name}]" for c in choices))
        if (r := s.row(QueueCall.START)) is not None:
            s.perform(QueueCall.START, r, choices=choices)
        yield s
    # send(batch)
    batches = [(i,) for i in range(n)] + [(0, 0)] + ([tuple(range(n))] if n > 1 else [])
    send_row = tables.lifecycle.get((world.queue, QueueCall.SEND))
    for batch in batches:
        fresh = [i for i in dict.fromkeys(batch) if world.envs[i].state not in LIVE]
        options: Sequence[tuple[EnvState, ...]] = [()]
        if send_row is not None and send_row.action is LifeAction.BUFFER:
            options = [(EnvState.BUFFERED,) * len(fresh)]
        elif send_row is not None and send_row.action is LifeAction.ADMIT:
            options = list(itertools.product(armed, repeat=len(fresh)))
        for choices in options:
            label = f"send({', '.join(f'e{i}' for i in batch)})"
            s = step(label + "".join(f"[{c.name}]" for c in choices))
            if (r := s.row(QueueCall.SEND)) is not None:
                if r.action in (LifeAction.BUFFER, LifeAction.ADMIT):
                    s.perform(QueueCall.SEND, r, choices=choices, batch=batch)
                else:
                    s.perform(QueueCall.SEND, r)
            yield s
    # stop(mode, cancel), terminate()
    for mode, cancel in _STOPS:
        s = step(f"stop({mode.name}{', cancel' if cancel else ''})")
        if (r := s.row(QueueCall.STOP)) is not None:
            s.perform(QueueCall.STOP, r, mode=mode, cancel=cancel)
        yield s
    s = step("terminate")
    if (r := s.row(QueueCall.TERMINATE)) is not None:
        s.perform(QueueCall.TERMINATE, r)
    yield s
    # abandon: a worker cancelled from outside (the loop closing); no workers in INIT
    if world.queue is not QueueState.INIT:
        s = step("abandon")
        if (r := s.row(QueueCall.ABANDON)) is not None:
            s.perform(QueueCall.ABANDON, r, mode=StopMode.STOP, cancel=True)
        yield s
    # drained: a stop under way has nothing left to wait for (attempts in flight, and
    # ready envelopes its mode does not park)
    parks = tables.stop_parks[world.mode] if world.mode is not None else frozenset()
    waits_for = {EnvState.RUNNING} | ({EnvState.READY} - parks)
    if world.queue is QueueState.STOPPING and not any(e.state in waits_for for e in world.envs):
        s = step("drained")
        if (r := s.row(QueueCall.DRAINED)) is not None:
            s.perform(QueueCall.DRAINED, r)
        yield s
    # the envelopes
    dispatching = world.queue in machine.DISPATCHING and EnvState.READY not in parks
    for i, env in enumerate(world.envs):
        if env.state is EnvState.READY and dispatching:
            s = step(f"dispatch(e{i})")
            s.dispatch(i)
            yield s
        if env.state is EnvState.DELAYED:
            s = step(f"due(e{i})")
            s.move(i, EnvEvent.DUE, EnvState.READY)
            yield s
        if env.state in _RETRIABLE:
            s = step(f"retry(e{i})")
            s.retry(i)
            yield s
        if env.state in LIVE and not env.cancelled:
            s = step(f"cancel(e{i})")
            s.cancel(i)
            yield s
        if env.state in _DISCARDABLE:
            s = step(f"discard(e{i})")
            s.discard(i)
            yield s
        if env.state is EnvState.RUNNING:
            for outcome in Outcome:
                if outcome is Outcome.CANCELLED and env.cancel is None:
                    continue
                for decision, limited in _DECISIONS if outcome in decided else ((None, False),):
                    how = f", {decision.name}" if decision is not None else ""
                    how += ", limited" if limited else ""
                    s = step(f"end(e{i}, {outcome.name}{how})")
                    s.end(i, outcome, decision, limited)
                    yield s


def check(world: World, config: Config) -> list[tuple[str, str]]:
    """The invariants that hold at a state (I1, I3–I6); edges are checked as they run.

    What each queue state may hold is the oracle's, from the runtime tables (not from
    the copy being explored, which may be broken on purpose)."""
    problems: list[tuple[str, str]] = []
    live = [e for e in world.envs if e.state in LIVE]
    if world.used != len(live):
        problems.append(("I1", f"capacity_used={world.used} but {len(live)} live"))
    if config.capacity and world.used > config.capacity:
        problems.append(("I1", f"capacity_used={world.used} > capacity={config.capacity}"))
    allowed = ALLOWED_LIVE[world.queue]
    if world.queue is QueueState.STOPPING and world.mode is not None:
        allowed = allowed - machine.STOP_PARKS[world.mode]
    if (world.mode is not None) != (world.queue is QueueState.STOPPING):
        problems.append(("I6", f"stop mode {world.mode} while {world.queue.name}"))
    for i, e in enumerate(world.envs):
        name = f"e{i}"
        if e.in_flight > 1:
            problems.append(("I3", f"{name}: {e.in_flight} attempts in flight"))
        if (e.in_flight == 1) != (e.state is EnvState.RUNNING):
            problems.append(("I3", f"{name}: {e.in_flight} in flight while {e.state.name}"))
        if e.stopped and e.state is not EnvState.STOPPED:
            problems.append(("I4", f"{name}: stopped but {e.state.name}"))
        type_ = config.types[i]
        if (
            type_
            and type_ in world.blacklist
            and e.state in LIVE
            and e.state is not EnvState.RUNNING
        ):
            problems.append(("I4", f"{name}: blacklisted type still {e.state.name}"))
        if e.state in LIVE and world.queue is QueueState.TERMINATED:
            problems.append(
                ("I5", f"{name}: {e.state.name} in a TERMINATED queue, never handed back")
            )
        if e.state in LIVE and e.state not in allowed:
            problems.append(
                (
                    "I6",
                    f"{name}: {e.state.name} while {world.queue.name}"
                    f"{f' ({world.mode.name})' if world.mode else ''}",
                )
            )
        if config.kinds[i] is Kind.PERIODIC and e.state is EnvState.SUCCEEDED:
            problems.append(("I7", f"{name}: a periodic envelope SUCCEEDED"))
        if not e.admitted:
            if e.state is not EnvState.NEW:
                problems.append(("I5", f"{name}: {e.state.name} but never admitted"))
            continue
        if e.state in LIVE:
            ok = e.ended == 0 and e.handed == 0
        elif e.state in ENDED:
            ok = e.ended == 1 and e.handed == 0
        elif e.state is EnvState.RETURNED:
            ok = e.ended == 0 and e.handed == 1
        else:
            ok = False
        if not ok:
            problems.append(
                (
                    "I5",
                    f"{name}: {e.state.name} after {e.ended} end event(s), "
                    f"handed back {e.handed} time(s)",
                )
            )
    return problems


def _check_dedup(before: World, after: World, step: _Step) -> None:
    """I8: a send leaves every envelope that was live unchanged."""
    if not step.label.startswith("send("):
        return
    for i, (old, new) in enumerate(zip(before.envs, after.envs, strict=True)):
        if old.state in LIVE and old != new:
            step.problem("I8", f"e{i}: re-sent while {old.state.name} and changed")


def explore(config: Config = Config(), tables: Tables = Tables()) -> Report:
    """Breadth-first search of every state within ``config.depth`` operations."""
    start = World(QueueState.INIT, None, False, frozenset(), 0, tuple(Env() for _ in config.kinds))
    parent: dict[World, tuple[World | None, str]] = {start: (None, "")}
    depth = {start: 0}
    queue = deque([start])
    violations: list[Violation] = []
    seen_problems: set[tuple[str, str]] = set()
    edges = 0
    covered: set[tuple[object, ...]] = set()

    def trace(world: World) -> tuple[str, ...]:
        labels: list[str] = []
        node: World | None = world
        while node is not None:
            prev, label = parent[node]
            if prev is not None:
                labels.append(label)
            node = prev
        return tuple(reversed(labels))

    def report(problems: list[tuple[str, str]], world: World, extra: str = "") -> None:
        for invariant, message in problems:
            if (invariant, message) in seen_problems:
                continue
            seen_problems.add((invariant, message))
            path = trace(world) + ((extra,) if extra else ())
            violations.append(Violation(invariant, message, path))

    report(check(start, config), start)
    frontier = 0
    while queue:
        world = queue.popleft()
        if depth[world] >= config.depth:
            frontier += 1
            continue
        for step in _successors(world, tables, config):
            edges += 1
            covered |= step.covered
            nxt = step.freeze()
            _check_dedup(world, nxt, step)
            if step.problems:
                report(step.problems, world, step.label)
            if nxt in parent:
                continue
            parent[nxt] = (world, step.label)
            depth[nxt] = depth[world] + 1
            report(check(nxt, config), nxt)
            queue.append(nxt)
    return Report(
        config=config,
        states=len(parent),
        edges=edges,
        max_depth=max(depth.values()),
        frontier=frontier,
        violations=tuple(violations),
        covered=frozenset(covered),
    )


def uncovered(reports: Sequence[Report], tables: Tables = Tables()) -> list[tuple[object, ...]]:
    """The table entries no exploration used: lifecycle rows, outcome rows, moves.

    Every row of ``LIFECYCLE`` and ``OUTCOMES`` and every (state, event, target) of
    ``ENVELOPE_MOVES`` should be exercised by the scopes, or the exploration proves
    nothing about it.
    """
    used = frozenset().union(*(r.covered for r in reports)) | UNREACHABLE
    wanted: list[tuple[object, ...]] = [("lifecycle", *pair) for pair in tables.lifecycle]
    wanted += [("outcome", *pair) for pair in tables.outcomes]
    wanted += [
        ("move", state, event, target)
        for (state, event), targets in tables.moves.items()
        for target in targets
    ]
    return [entry for entry in wanted if entry not in used]


#: Table entries no scope can reach, and why. A type is blacklisted only when an
#: attempt ends, and attempts run only after ``start()``, when nothing is BUFFERED any
#: more: the contract lists BUFFERED among the states a blacklist stops, but in one
#: queue it cannot happen (the row is kept as the contract states it). Likewise an
#: envelope ends FAILED only after an attempt, so never while its queue is INIT, where
#: a retry buffers: the RETRY row gives the FAILED one the same arrival as a STOPPED
#: one (stopped by a cancel before the first start), which is reached.
UNREACHABLE: Final[frozenset[tuple[object, ...]]] = frozenset(
    {
        ("move", EnvState.BUFFERED, EnvEvent.BLACKLIST, EnvState.STOPPED),
        ("move", EnvState.FAILED, EnvEvent.RETRY, EnvState.BUFFERED),
    }
)

#: The scopes ``main`` explores: one-off + periodic of one type; unlimited and capacity 1;
#: two envelopes of different types (one empty); two periodic ones; three envelopes,
#: two of one type, under capacity 2.
SCOPES: Final[tuple[Config, ...]] = (
    Config(),
    Config(capacity=1),
    Config(types=("a", "")),
    Config(kinds=(Kind.PERIODIC, Kind.PERIODIC)),
    Config(kinds=(Kind.ONE_OFF, Kind.PERIODIC, Kind.ONE_OFF), types=("t", "t", "u"), capacity=2),
)


def run(depth: int = 12, show: int = 10) -> int:
    """Explore every scope of :data:`SCOPES` to ``depth`` operations; print the counts,
    up to ``show`` violations per scope and the table entries no scope exercised.
    Return the exit status: 1 on a violation or an entry not exercised, else 0."""
    total = 0
    failed = False
    results: list[Report] = []
    for scope in SCOPES:
        config = attrs.evolve(scope, depth=depth)
        result = explore(config)
        results.append(result)
        total += result.states
        kinds = "+".join(k.name.lower() for k in config.kinds)
        print(
            f"scope kinds={kinds} types={config.types} capacity={config.capacity} "
            f"depth={config.depth}: {result.states} states, {result.edges} edges, "
            f"{result.frontier} at the depth bound, {len(result.violations)} violations"
        )
        for violation in result.violations[:show]:
            print(f"  {violation}")
        failed = failed or bool(result.violations)
    missing = uncovered(results)
    for entry in missing:
        print(f"  not exercised: {' '.join(getattr(x, 'name', str(x)) for x in entry)}")
    print(
        f"total: {total} states explored; {len(missing)} table entries not exercised; "
        f"{'VIOLATIONS FOUND' if failed else 'no violations'}"
    )
    return 1 if failed or missing else 0
