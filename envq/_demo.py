"""``envq demo``: a small, realistic workload on a real event loop, narrated line by line.

The demo runs one queue (``demo``, capacity 12) for ``duration`` real seconds:

* a batch of one-off **email** envelopes; a seeded plan makes some of them fail with a
  transient SMTP error that :class:`envq.Retry` retries with exponential backoff; one
  always fails and ends FAILED when its attempts are used up; one raises
  :class:`envq.DoNotRetry` (a hard bounce, reported to its ``on_failure`` hook);
* a periodic **metrics** collector (every 0.5 s, deadline 0.2 s) that samples the queue
  itself; its third run stalls and overruns its deadline (``TIMEOUT``);
* a **report** envelope that raises :class:`envq.StopType` mid-run: its type is
  blacklisted, a second report still waiting is stopped, and a later send of the type
  is refused with :class:`envq.TypeBlacklisted`;
* a send that does not fit the capacity (``CapacityExceeded``), then the same batch
  through ``send_wait`` (backpressure), and a dedup of an envelope already queued;
* at 60 % of the duration ``stop(mode=StopMode.STOP)`` parks what is waiting (the
  report is printed), a short pause, ``start()`` re-arms the parked envelopes with the
  delay they had left;
* at the end ``stop()`` (DRAIN) and ``terminate()`` (which hands back what is still
  parked), then a summary from ``Queue.statistics()`` and a check that every envelope
  is accounted for.

Everything the queue does is printed by one event listener (``Queue.subscribe``);
the driver's own actions are the lines marked ``*``. Content is deterministic for a
seed; only timestamps (and the queue samples of the collector) vary with timing.
Ctrl-C stops the queue (cancelling what is in flight), terminates it, prints the
report and returns 130.

When stdout is a terminal and ``rich`` is installed (or with ``live=True``), the
narration scrolls inside a live view that also shows the envelopes by state, the
outcomes and the throughput, refreshed a few times a second on the loop; the final stop,
the terminate and the statistics are printed plainly below it. With
``metrics_port`` the queue's Prometheus metrics (:func:`envq.prometheus_metrics`) are
served on ``http://127.0.0.1:PORT/metrics`` while the demo runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import os
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, TextIO

import envq
from envq import Envelope, EnvState, Event, Outcome, QueueState, StopMode, StopReport

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry
    from rich.console import Console, RenderableType
    from rich.live import Live

__all__ = ["DemoOptions", "run_demo"]

#: The demo queue's capacity (small, so backpressure shows).
CAPACITY: Final = 12
#: The metrics collector's interval and deadline, in seconds.
METRICS_INTERVAL: Final = 0.5
METRICS_DEADLINE: Final = 0.2
#: The collector run that stalls past its deadline.
STALLED_RUN: Final = 3
#: Exit code after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED: Final = 130
#: Exit code when stdout's reader went away (128 + SIGPIPE), as shells report it.
EXIT_BROKEN_PIPE: Final = 141
#: Exit code when an option cannot be honoured (a missing extra, a port in use).
EXIT_USAGE: Final = 2
#: Refreshes of the live view per second, and how many narration lines it shows.
LIVE_FPS: Final = 8
LIVE_LINES: Final = 12

_TRANSIENT: Final = (
    "SMTP 451 4.7.1 greylisted, try again later",
    "SMTP 421 4.3.2 too many connections",
    "SMTP 450 4.2.1 mailbox busy",
    "connection reset by mx.example.net",
)
_RECIPIENTS: Final = (
    "ada",
    "grace",
    "linus",
    "barbara",
    "ken",
    "margaret",
    "dennis",
    "radia",
    "edsger",
    "frances",
)
_ALWAYS_FAILS: Final = 1
_HARD_BOUNCE: Final = 4
_DIGEST: Final = 10


@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs (the command line's ``--duration``, ``--seed``, ``--workers``,
    ``--metrics-port`` and ``--live``/``--plain``)."""

    #: Real seconds of workload, from start to the final stop.
    duration: float = 6.0
    #: Seeds the failure plan and the collector's samples.
    seed: int = 7
    #: The queue's worker count.
    workers: int = 4
    #: Serve Prometheus metrics on 127.0.0.1:PORT while the demo runs (0: a free port).
    metrics_port: int | None = None
    #: The live view: True forces it, False forces plain text, None (the default) uses
    #: it when the output is a terminal and rich is installed.
    live: bool | None = None

    def __post_init__(self) -> None:
        if not self.duration >= 1.0:
            raise ValueError(f"duration must be at least 1 second, got {self.duration!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0..65535, got {self.metrics_port!r}")


class TransientError(Exception):
    """A temporary delivery failure (an SMTP 4xx reply): worth retrying."""


@dataclass
class Mail:
    """An email envelope's payload."""

    to: str
    subject: str
    #: Attempts that fail transiently before delivery; -1: every attempt fails.
    failures: int = 0
    error: str = _TRANSIENT[0]
    #: Raise DoNotRetry (a hard bounce) instead of delivering.
    bounce: bool = False
    attempts: int = 0


@dataclass
class Collector:
    """The metrics envelope's payload: its run count and its last sample."""

    runs: int = 0
    sample: str = ""


@dataclass
class _Track:
    """What the narrator remembers of one envelope."""

    attempts: int = 0
    started: float = 0.0
    #: Loop time a DELAYED envelope is due.
    due: float = 0.0
    #: Seconds a PARKED envelope still had to wait.
    left: float = 0.0


@dataclass
class _Tally:
    admitted: int = 0
    terminal: dict[EnvState, int] = field(default_factory=dict)


def label(env: Envelope) -> str:
    """``type/id`` without quotes, for the narration."""
    return f"{env.type}/{env.id}"


def _labels(envs: Iterable[Envelope]) -> str:
    names = [label(env) for env in envs]
    return ", ".join(names) if names else "-"


def _err(exc: BaseException | None) -> str:
    if exc is None:
        return "-"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Demo:
    """One run of the demo: the queue, the workload, the narrator and the driver."""

    def __init__(
        self,
        options: DemoOptions,
        out: TextIO,
        registry: CollectorRegistry | None = None,
        metrics_url: str = "",
    ) -> None:
        self.options = options
        self.out = out
        d = options.duration
        #: Email backoff shrinks with short runs so the story fits the duration.
        self.retry = envq.Retry(attempts=4, base=round(0.2 * min(1.0, d / 6.0), 3), jitter=False)
        self.stop_at = 0.6 * d
        self.pause = min(0.6, max(0.2, 0.1 * d))
        self.q = envq.Queue("demo", workers=options.workers, capacity=CAPACITY)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.t0 = 0.0
        self.track: dict[Envelope, _Track] = {}
        self.tally = _Tally()
        self.deferred: list[str] = []
        self.delivered: list[str] = []
        self.blacklisted = asyncio.Event()
        self.producer: asyncio.Task[None] | None = None
        self.problems: list[str] = []
        #: The task running the demo, and whether stdout's reader has gone.
        self.main: asyncio.Task[int] | None = None
        self.gone = False
        #: Where the metrics are served ("" when they are not).
        self.metrics_url = metrics_url
        self.metrics = envq.prometheus_metrics(self.q, registry) if registry is not None else None

    # ------------------------------------------------------------------------------
    # Output
    # ------------------------------------------------------------------------------

    def emit(self, text: str) -> None:
        """Write and flush; when the reader has gone (``envq demo | head``), stop the
        demo the way Ctrl-C does, silently."""
        if self.gone or not text:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except BrokenPipeError:
            self.gone = True
            if self.main is not None and not self.main.done():
                self.main.cancel()

    def now(self) -> float:
        """Seconds since the demo started."""
        return self.loop.time() - self.t0 if self.loop is not None else 0.0

    def line(self, text: str, at: float | None = None) -> None:
        """Print one timestamped line."""
        t = self.now() if at is None else at
        self.emit(f"[{t:5.2f}s] {text}\n")

    def say(self, text: str) -> None:
        """Print one of the driver's own actions."""
        self.line(f"* {text}")

    def more(self, text: str) -> None:
        """Print a continuation line (no timestamp)."""
        self.emit(f"          {text}\n")

    def plain(self, text: str = "") -> None:
        """Print a line as is."""
        self.emit(f"{text}\n")

    def start_view(self) -> None:
        """Called once the header is printed (the live view starts here)."""

    def end_view(self) -> None:
        """Called before the final stop or after Ctrl-C (the live view ends here)."""

    # ------------------------------------------------------------------------------
    # The workload
    # ------------------------------------------------------------------------------

    def _rng(self, *parts: object) -> random.Random:
        return random.Random(":".join(str(p) for p in (self.options.seed, *parts)))

    async def send_email(self, env: Envelope) -> None:
        """Deliver one email: a short await, then the seeded plan's verdict."""
        mail: Mail = env.payload
        mail.attempts += 1
        await asyncio.sleep(self._rng("email", env.id, mail.attempts).uniform(0.04, 0.12))
        if mail.bounce:
            raise envq.DoNotRetry(f"SMTP 550 5.1.1 <{mail.to}@nowhere.invalid>: no such user")
        if mail.failures < 0 or mail.attempts <= mail.failures:
            raise TransientError(mail.error)

    async def on_delivered(self, env: Envelope) -> None:
        """``on_success`` of the emails: remember the delivery."""
        self.delivered.append(label(env))

    async def on_bounce(self, env: Envelope, exc: BaseException, attempt: int) -> envq.Decision:
        """``on_failure`` of the bouncing email: called to report a DoNotRetry."""
        self.line(f"{label(env):<13} on_failure hook: bounce recorded (attempt {attempt})")
        return envq.drop()

    async def collect(self, env: Envelope) -> None:
        """The periodic collector: samples the queue; one run stalls past its deadline."""
        col: Collector = env.payload
        col.runs += 1
        rng = self._rng("metrics", col.runs)
        await asyncio.sleep(0.35 if col.runs == STALLED_RUN else rng.uniform(0.02, 0.06))
        stats = self.q.statistics()
        col.sample = (
            f"load={rng.uniform(0.1, 0.9):.2f} used={stats.capacity_used}/{CAPACITY} "
            f"in_flight={stats.in_flight}"
        )

    async def render_report(self, env: Envelope) -> None:
        """The report job: its backend is gone, so it retires the whole type."""
        await asyncio.sleep(0.1)
        raise envq.StopType("report backend retired (HTTP 410 Gone)")

    def emails(self) -> list[Envelope]:
        """The email envelopes, ids 1..10, with the seeded failure plan."""
        plan = random.Random(self.options.seed)
        mails: list[Mail] = []
        for n, who in enumerate(_RECIPIENTS, start=1):
            mail = Mail(
                to=who,
                subject="daily digest" if n == _DIGEST else f"order #{1000 + n} shipped",
                failures=plan.choice((0, 0, 0, 1, 1, 2)),
                error=plan.choice(_TRANSIENT),
            )
            if n == _ALWAYS_FAILS:
                mail.failures, mail.error = -1, "SMTP 452 4.2.2 mailbox full"
            elif n == _HARD_BOUNCE:
                mail.failures, mail.bounce = 0, True
            elif n == _DIGEST:
                mail.failures = 0
            mails.append(mail)
        if not any(m.failures > 0 for m in mails):
            mails[1].failures = 1  # every seed shows at least one retry that works out
        return [
            Envelope(
                invoke=self.send_email,
                id=n,
                type="email",
                deadline=3,
                retry=self.retry,
                on_success=self.on_delivered,
                on_failure=self.on_bounce if mail.bounce else None,
                delay=0.7 * self.options.duration if n == _DIGEST else 0,
                payload=mail,
            )
            for n, mail in enumerate(mails, start=1)
        ]

    # ------------------------------------------------------------------------------
    # The narrator: one listener prints what the queue does
    # ------------------------------------------------------------------------------

    def _next_delay(self, env: Envelope, outcome: Outcome | None, attempt: int) -> float:
        if outcome is Outcome.CANCELLED:
            return 0.0
        if env.periodic:
            return env.interval
        if outcome in (Outcome.ERROR, Outcome.TIMEOUT) and env.retry is not None:
            return env.retry.delay(attempt)
        return 0.0

    def on_event(self, ev: Event) -> None:
        """Print one state change (the listener given to ``Queue.subscribe``)."""
        at = ev.time - self.t0
        env = ev.envelope
        if env is None:
            self.line(
                f"{'queue ' + ev.queue:<13} {ev.from_state.name} -> {ev.to_state.name}",
                at,
            )
            return
        assert isinstance(ev.to_state, EnvState)
        to = ev.to_state
        frm = ev.from_state
        tr = self.track.setdefault(env, _Track())
        if to in (EnvState.SUCCEEDED, EnvState.FAILED, EnvState.STOPPED, EnvState.RETURNED):
            self.tally.terminal[to] = self.tally.terminal.get(to, 0) + 1
        if frm is EnvState.NEW:  # admission (docs/decisions.md: NEW, not None)
            self.tally.admitted += 1
            tr.due = ev.time + env.delay
            return
        if frm is EnvState.RUNNING:
            self._attempt_ended(ev, env, tr, at)
        elif to is EnvState.RUNNING:
            tr.attempts += 1
            tr.started = ev.time
            return
        elif to is EnvState.PARKED:
            tr.left = max(0.0, tr.due - ev.time) if frm is EnvState.DELAYED else 0.0
            self._print(env, frm, to, f"parked with {tr.left:.2f}s left to wait", at)
        elif frm is EnvState.PARKED and to in (EnvState.READY, EnvState.DELAYED):
            tr.due = ev.time + tr.left
            self._print(
                env, frm, to, f"re-armed: due in {tr.left:.2f}s (the delay it had left)", at
            )
        elif to is EnvState.STOPPED:
            # Blacklist victims are stopped just before the culprit's own event: print
            # them after it, so the story reads in cause-and-effect order.
            self.deferred.append(
                self._fmt(env, frm, to, f"stopped: type {env.type!r} is blacklisted", at)
            )
            return
        elif to is EnvState.RETURNED:
            self._print(env, frm, to, "handed back by terminate()", at)
        else:  # DELAYED -> READY and the like: not worth a line
            return
        self.emit("".join(self.deferred))
        self.deferred.clear()

    def _attempt_ended(self, ev: Event, env: Envelope, tr: _Track, at: float) -> None:
        to = ev.to_state
        assert isinstance(to, EnvState)
        outcome = ev.outcome
        took = ev.time - tr.started
        after = self._next_delay(env, outcome, tr.attempts)
        if to is EnvState.DELAYED:
            tr.due = ev.time + after
        elif to is EnvState.PARKED:
            tr.left = after
        match outcome:
            case Outcome.OK if env.periodic:
                col: Collector = env.payload
                what = f"run {col.runs} ok: {col.sample}"
            case Outcome.OK:
                mail: Mail = env.payload
                what = f"delivered to {mail.to} (attempt {tr.attempts}, {took:.2f}s)"
            case Outcome.TIMEOUT if env.periodic:
                col = env.payload
                what = f"run {col.runs} TIMEOUT: overran its {env.deadline:g}s deadline"
            case Outcome.ERROR | Outcome.TIMEOUT if isinstance(ev.cause, envq.MaxRetriesExceeded):
                what = (
                    f"gave up after {tr.attempts} attempts: MaxRetriesExceeded"
                    f" (last error: {ev.cause.__cause__})"
                )
            case Outcome.ERROR | Outcome.TIMEOUT:
                what = f"error: {ev.cause} (attempt {tr.attempts})"
            case Outcome.NO_RETRY:
                what = f"no retry: {_err(ev.cause)}"
            case Outcome.STOP_TYPE:
                what = f"{_err(ev.cause)} -> type {env.type!r} blacklisted"
                self.blacklisted.set()
            case Outcome.STOP:
                what = f"stopped: {_err(ev.cause)}"
            case Outcome.CANCELLED:
                what = "attempt cancelled"
            case _:
                what = f"outcome {outcome}"
        if to is EnvState.DELAYED:
            what += f", {'next run' if env.periodic else 'retry'} in {after:.2f}s"
        elif to is EnvState.PARKED:
            what += f"; parked with {after:.2f}s left (the queue is not running)"
        if env.periodic and to is EnvState.DELAYED and outcome is Outcome.OK:
            self.line(f"{label(env):<13} {what}", at)  # the routine runs: one short line
            return
        self._print(env, ev.from_state, to, what, at)

    def _fmt(self, env: Envelope, frm: object, to: EnvState, what: str, at: float) -> str:
        name = frm.name if isinstance(frm, EnvState) else "-"
        moves = f"{name} -> {to.name}"
        return f"[{at:5.2f}s] {label(env):<13} {moves:<21} {what}\n"

    def _print(self, env: Envelope, frm: object, to: EnvState, what: str, at: float) -> None:
        self.emit(self._fmt(env, frm, to, what, at))

    # ------------------------------------------------------------------------------
    # The driver
    # ------------------------------------------------------------------------------

    async def sleep_until(self, t: float) -> None:
        """Sleep until ``t`` seconds after the start."""
        await asyncio.sleep(max(0.0, t - self.now()))

    def report(self, title: str, rep: StopReport) -> None:
        """Print a StopReport."""
        self.say(f"{title}: complete={rep.complete}")
        self.more(f"parked    ({len(rep.parked)}): {_labels(rep.parked)}")
        self.more(f"completed ({len(rep.completed)}): {_labels(rep.completed)}")
        self.more(f"cancelled ({len(rep.cancelled)}): {_labels(rep.cancelled)}")

    async def wait_for_room(self, batch: list[Envelope]) -> None:
        """A producer that waits for room instead of failing (backpressure)."""
        started = self.now()
        self.say(
            f"send_wait({_labels(batch)}) waits for room ({self.q.capacity_used}/{CAPACITY} used)"
        )
        try:
            await self.q.send_wait(*batch, timeout=0.5 * self.options.duration)
        except envq.EnvqError as exc:
            self.say(f"send_wait({_labels(batch)}) gave up: {_err(exc)}")
            return
        self.say(
            f"send_wait admitted {_labels(batch)} after {self.now() - started:.2f}s "
            f"of backpressure ({self.q.capacity_used}/{CAPACITY} used)"
        )

    async def scenario(self) -> int:
        """Run the whole story; return the exit code."""
        o = self.options
        q = self.q
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.plain(
            f"envq demo: queue {q.name!r}, {o.workers} workers, capacity {CAPACITY}, "
            f"seed {o.seed}, {o.duration:g}s of workload"
        )
        self.plain(
            f"plan: stop(mode=STOP) at {self.stop_at:.2f}s, start() again {self.pause:.2f}s "
            f"after it, stop() + terminate() at {o.duration:.2f}s"
        )
        self.plain(
            f"emails retry with Retry(attempts={self.retry.attempts}, base={self.retry.base:g}"
            f", jitter=False); lines marked * are the driver's own calls"
        )
        if self.metrics_url:
            self.plain(f"metrics: {self.metrics_url}")
        self.plain()
        q.subscribe(self.on_event)
        self.start_view()
        q.start()

        emails = self.emails()
        metrics = Envelope(
            invoke=self.collect,
            id="queue",
            type="metrics",
            interval=METRICS_INTERVAL,
            deadline=METRICS_DEADLINE,
            payload=Collector(),
        )
        reports = [
            Envelope(invoke=self.render_report, id=n, type="report", deadline=2, delay=delay)
            for n, delay in ((1, round(0.2 * o.duration, 2)), (2, round(0.5 * o.duration, 2)))
        ]
        first = [*emails[:7], emails[9], metrics, *reports]
        q.send(*first)
        self.say(
            f"send {len(first)}: email/1..7, email/10 (delay {emails[9].delay:.2f}s), "
            f"metrics/queue (every {METRICS_INTERVAL}s, deadline {METRICS_DEADLINE}s), "
            f"report/1 (delay {reports[0].delay:g}s), report/2 (delay {reports[1].delay:g}s)"
        )
        before = q.statistics().dedups
        q.send(emails[1])
        self.say(
            f"send(email/2) again while it is queued: deduplicated "
            f"(dedups {before} -> {q.statistics().dedups}, {q.capacity_used}/{CAPACITY} used)"
        )
        late = emails[7:9]
        try:
            q.send(*late)
        except envq.CapacityExceeded as exc:
            self.say(f"send({_labels(late)}) refused: {_err(exc)}")
        else:
            self.problems.append("a send over capacity was admitted")
        self.producer = asyncio.create_task(self.wait_for_room(late))

        try:
            await asyncio.wait_for(self.blacklisted.wait(), timeout=self.stop_at - self.now())
        except TimeoutError:
            self.problems.append("the report type was not blacklisted in time")
            self.say("report type was not blacklisted before the stop")
        else:
            extra = Envelope(invoke=self.render_report, id=3, type="report")
            try:
                q.send(extra)
            except envq.TypeBlacklisted as exc:
                self.say(f"send(report/3) refused: {_err(exc)}")
            else:
                self.problems.append("a send of a blacklisted type was admitted")

        await self.sleep_until(self.stop_at)
        self.say("stop(mode=StopMode.STOP): waiting envelopes are parked, in-flight ones finish")
        rep = await q.stop(mode=StopMode.STOP)
        self.report("stop report", rep)
        if not rep.parked:
            self.problems.append("the stop parked nothing")
        probe = Envelope(invoke=self.send_email, id=11, type="email", payload=Mail("ops", "ping"))
        try:
            q.send(probe)
        except envq.QueueNotRunning as exc:
            self.say(f"send(email/11) while stopped refused: {_err(exc)}")

        await asyncio.sleep(self.pause)
        parked = len(rep.parked)
        self.say(f"start() again: {parked} parked envelope(s) resume with the delay they had left")
        q.start()

        await self.sleep_until(o.duration)
        await self.settle_producer()
        self.end_view()
        self.say("stop() (DRAIN): ready envelopes run first, waiting ones are parked")
        rep = await q.stop()
        self.report("final stop report", rep)
        return await self.finish(interrupted=False)

    async def settle_producer(self) -> None:
        """Cancel the send_wait producer if it is still waiting."""
        task = self.producer
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def interrupted(self) -> int:
        """Ctrl-C: stop (cancelling in-flight attempts), terminate, report; 130."""
        self.end_view()
        self.plain()
        self.say("interrupted (Ctrl-C): stop(mode=StopMode.STOP, cancel=True), then terminate()")
        await self.settle_producer()
        if self.q.state is QueueState.RUNNING:
            rep = await self.q.stop(mode=StopMode.STOP, cancel=True)
        else:
            rep = await self.q.stop()
        self.report("stop report", rep)
        await self.finish(interrupted=True)
        return EXIT_INTERRUPTED

    async def finish(self, *, interrupted: bool) -> int:
        """Terminate, print the statistics, check that nothing was lost."""
        q = self.q
        used = q.capacity_used
        handed = await q.terminate()
        self.say(f"terminate() handed back {len(handed)}: {_labels(handed)}")
        stats = q.statistics()
        if stats.capacity_used != 0:
            self.problems.append(f"capacity_used is {stats.capacity_used} after terminate")
        if used != len(handed):
            self.problems.append(f"{used} envelope(s) were live but {len(handed)} handed back")
        ended = sum(self.tally.terminal.values())
        if ended != self.tally.admitted:
            self.problems.append(f"{self.tally.admitted} admitted but {ended} ended")
        for state in (EnvState.SUCCEEDED, EnvState.FAILED, EnvState.STOPPED, EnvState.RETURNED):
            if stats.by_state[state] != self.tally.terminal.get(state, 0):
                self.problems.append(f"statistics and events disagree on {state.name}")

        def row(name: str, value: str) -> None:
            self.plain(f"  {name:<15}{value}")

        def counts(items: Iterable[tuple[str, int]]) -> str:
            shown = [f"{k}={v}" for k, v in items if v]
            return "  ".join(shown) if shown else "none"

        self.plain()
        self.plain("== final statistics ==")
        row("state", stats.state.name)
        row("outcomes", counts((o.name, n) for o, n in stats.outcomes.items()))
        row(
            "by_state",
            counts((s.name, stats.by_state[s]) for s in EnvState if s in stats.by_state),
        )
        row("dedups", str(stats.dedups))
        row("rejections", counts(stats.rejections.items()))
        row(
            "capacity_used",
            f"{stats.capacity_used} of {stats.capacity_limit} after terminate "
            f"({used} before it = {len(handed)} handed back)",
        )
        t = self.tally.terminal
        row(
            "accounted",
            f"{self.tally.admitted} admitted = {t.get(EnvState.SUCCEEDED, 0)} succeeded + "
            f"{t.get(EnvState.FAILED, 0)} failed + {t.get(EnvState.STOPPED, 0)} stopped + "
            f"{t.get(EnvState.RETURNED, 0)} returned",
        )
        row("delivered", ", ".join(self.delivered) or "-")
        row("in_flight", f"{stats.in_flight}  stuck_threads={stats.stuck_threads}")
        self.plain()
        if self.problems:
            for problem in self.problems:
                self.plain(f"PROBLEM: {problem}")
            return 1
        self.plain(
            "demo interrupted: queue stopped and terminated cleanly"
            if interrupted
            else "demo finished: every envelope accounted for"
        )
        return 0


class LiveDemo(Demo):
    """The demo with a live terminal view (rich): the narration scrolls in a panel
    under tables of the envelopes by state, the outcomes and the throughput.

    The view is refreshed by a task on the demo's loop, so it reads the queue on the
    loop's thread. When it ends (before the final stop, or on Ctrl-C) its last frame
    stays on screen and the rest of the story is printed plainly below it.
    """

    def __init__(
        self,
        options: DemoOptions,
        out: TextIO,
        console: Console,
        registry: CollectorRegistry | None = None,
        metrics_url: str = "",
    ) -> None:
        super().__init__(options, out, registry, metrics_url)
        self.console = console
        self.live: Live | None = None
        self.recent: collections.deque[str] = collections.deque(maxlen=LIVE_LINES)
        #: Loop times at which attempts ended, for the attempts-per-second rate.
        self.ended: collections.deque[float] = collections.deque()
        self.attempts = 0
        self.refresher: asyncio.Task[None] | None = None

    def emit(self, text: str) -> None:
        """Into the view's narration panel while it is shown, else as the plain demo."""
        if self.live is None:
            super().emit(text)
        elif text:
            self.recent.extend(text.rstrip("\n").split("\n"))

    def on_event(self, ev: Event) -> None:
        """Count ended attempts for the throughput, then narrate."""
        if ev.from_state is EnvState.RUNNING:
            self.attempts += 1
            self.ended.append(ev.time)
        super().on_event(ev)

    def start_view(self) -> None:
        """Start the live view and its refresher task."""
        from rich.live import Live  # noqa: PLC0415 - rich is optional

        self.live = Live(
            self.render(),
            console=self.console,
            auto_refresh=False,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start(refresh=True)
        self.refresher = asyncio.create_task(self.refresh())

    def end_view(self) -> None:
        """Stop refreshing; leave the last frame on screen."""
        task = self.refresher
        self.refresher = None
        if task is not None:
            task.cancel()
        live = self.live
        if live is None:
            return
        with contextlib.suppress(Exception):
            live.update(self.render(), refresh=True)
        self.live = None
        live.stop()

    async def refresh(self) -> None:
        """Redraw the view :data:`LIVE_FPS` times a second."""
        while self.live is not None:
            self.live.update(self.render(), refresh=True)
            await asyncio.sleep(1 / LIVE_FPS)

    def rate(self) -> float:
        """Attempts ended per second over the last two seconds."""
        horizon = (self.loop.time() if self.loop is not None else 0.0) - 2.0
        while self.ended and self.ended[0] < horizon:
            self.ended.popleft()
        return len(self.ended) / 2.0

    def render(self) -> RenderableType:
        """One frame of the view."""
        from rich.console import Group  # noqa: PLC0415 - rich is optional
        from rich.panel import Panel  # noqa: PLC0415
        from rich.table import Table  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415

        stats = self.q.statistics()

        def table(title: str, head: str) -> Table:
            t = Table(
                title=title, title_justify="left", box=None, pad_edge=False, show_header=False
            )
            t.add_column(head)
            t.add_column("", justify="right")
            return t

        states = table("envelopes", "state")
        for state in EnvState:
            if state in stats.by_state:
                count = stats.by_state[state]
                states.add_row(state.name.lower(), Text(str(count), style="bold" if count else ""))
        outcomes = table("outcomes", "outcome")
        for outcome, count in stats.outcomes.items():
            colour = {Outcome.OK: "green", Outcome.ERROR: "red", Outcome.TIMEOUT: "yellow"}
            outcomes.add_row(outcome.value, Text(str(count), style=colour.get(outcome, "")))
        flow = table("throughput", "")
        flow.add_row("attempts/s", f"{self.rate():.1f}")
        flow.add_row("attempts", str(self.attempts))
        flow.add_row("in flight", f"{stats.in_flight} of {self.options.workers} workers")
        flow.add_row("capacity", f"{stats.capacity_used} of {CAPACITY}")
        flow.add_row("dedups", str(stats.dedups))
        flow.add_row("rejections", str(sum(stats.rejections.values())))
        flow.add_row("stuck threads", str(stats.stuck_threads))
        grid = Table.grid(padding=(0, 4))
        grid.add_row(states, outcomes, flow)
        title = (
            f"envq demo - queue {self.q.name!r} {stats.state.name} - "
            f"{self.now():.1f}s of {self.options.duration:g}s"
        )
        lines = Text("\n".join(self.recent) or "...", no_wrap=True, overflow="ellipsis")
        return Panel(
            Group(grid, Text(""), Panel(lines, title="events", title_align="left")),
            title=title,
            title_align="left",
        )


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


async def _run(
    options: DemoOptions,
    out: TextIO,
    *,
    console: Console | None = None,
    registry: CollectorRegistry | None = None,
    metrics_url: str = "",
) -> tuple[int, bool]:
    demo = (
        Demo(options, out, registry, metrics_url)
        if console is None
        else LiveDemo(options, out, console, registry, metrics_url)
    )
    task = demo.main = asyncio.current_task()
    try:
        try:
            return await demo.scenario(), demo.gone
        except asyncio.CancelledError:
            # asyncio.run turns the first Ctrl-C into a cancel of this task; a closed
            # stdout does the same (see Demo.emit).
            if task is None or not task.cancelling():
                raise
            task.uncancel()
            code = await demo.interrupted()
            return (EXIT_BROKEN_PIPE if demo.gone else code), demo.gone
    finally:
        demo.end_view()
        if demo.metrics is not None:
            demo.metrics.close()


def _fail(message: str) -> int:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"envq demo: {message}\n")
    return EXIT_USAGE


def run_demo(options: DemoOptions | None = None, out: TextIO | None = None) -> int:
    """Run the demo on a fresh event loop; return the process exit code.

    0 on success, 1 if a check failed (printed as ``PROBLEM:``), 2 if an option cannot
    be honoured (``rich`` or ``prometheus_client`` missing, the metrics port taken),
    130 after Ctrl-C, 141 when the reader of the output went away
    (``envq demo | head``).
    """
    options = options or DemoOptions()
    stream = sys.stdout if out is None else out
    live = options.live
    if live is None:
        live = _isatty(stream) and _has("rich")
    elif live and not _has("rich"):
        return _fail("the live view needs rich: pip install rich (or use --plain)")
    console: Console | None = None
    if live:
        from rich.console import Console  # noqa: PLC0415 - rich is optional

        console = Console(file=stream, force_terminal=True if options.live else None)
    server: envq.MetricsServer | None = None
    registry: CollectorRegistry | None = None
    if options.metrics_port is not None:
        if not _has("prometheus_client"):
            return _fail("--metrics-port needs prometheus_client: pip install 'envq[prometheus]'")
        from prometheus_client import CollectorRegistry  # noqa: PLC0415 - optional

        registry = CollectorRegistry()
        try:
            server = envq.serve_metrics(options.metrics_port, registry=registry)
        except OSError as exc:
            return _fail(f"cannot serve metrics on 127.0.0.1:{options.metrics_port}: {exc}")
    try:
        code, gone = asyncio.run(
            _run(
                options,
                stream,
                console=console,
                registry=registry,
                metrics_url=server.url if server is not None else "",
            )
        )
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the loop
        with contextlib.suppress(OSError):
            stream.write("interrupted\n")
            stream.flush()
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:  # stdout went away while the demo was ending
        code, gone = EXIT_BROKEN_PIPE, True
    finally:
        if server is not None:
            server.close()
    if gone and stream is sys.stdout:
        # Keep the interpreter's final flush of stdout from complaining about the pipe.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
    return code


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
