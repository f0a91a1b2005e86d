"""The driver's script: one run of the demo from the first send to the final check.

:class:`Scenario` owns the demo queue, sends the :mod:`workload <envq.demo.workload>`,
lets the :mod:`narrator <envq.demo.narration>` print what the queue does, and prints its
own calls (the lines marked ``*``): the sends that are refused or wait, the mid-run
stop and start, the final stop and terminate, then the statistics and a check that
every envelope is accounted for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

import envq
from envq import Envelope, EnvState, QueueState, StopMode, StopReport
from envq.demo.narration import Narrator
from envq.demo.options import DemoOptions
from envq.demo.output import Output, error_text, labels
from envq.demo.workload import CAPACITY, METRICS_DEADLINE, METRICS_INTERVAL, Workload

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["Scenario"]


class Scenario:
    """One run of the demo: the queue, the workload, the narrator and the driver.

    With ``registry``, the queue's Prometheus metrics are registered there (and served
    at ``metrics_url``, which the header names) until :meth:`close`.
    """

    def __init__(
        self,
        options: DemoOptions,
        out: Output,
        registry: CollectorRegistry | None = None,
        metrics_url: str = "",
    ) -> None:
        self.options = options
        self.out = out
        d = options.duration
        self.stop_at = 0.6 * d
        self.pause = min(0.6, max(0.2, 0.1 * d))
        self.q = envq.Queue("demo", workers=options.workers, capacity=CAPACITY)
        self.work = Workload(options, self.q, out)
        self.narrator = Narrator(out)
        self.producer: asyncio.Task[None] | None = None
        self.problems: list[str] = []
        #: Where the metrics are served ("" when they are not).
        self.metrics_url = metrics_url
        self.metrics = envq.prometheus_metrics(self.q, registry) if registry is not None else None

    def close(self) -> None:
        """End the view and unregister the metrics (whatever happened to the run)."""
        self.out.end_view()
        if self.metrics is not None:
            self.metrics.close()

    async def sleep_until(self, t: float) -> None:
        """Sleep until ``t`` seconds after the start."""
        await asyncio.sleep(max(0.0, t - self.out.now()))

    def report(self, title: str, rep: StopReport) -> None:
        """Print a StopReport."""
        self.out.say(f"{title}: complete={rep.complete}")
        self.out.more(f"parked    ({len(rep.parked)}): {labels(rep.parked)}")
        self.out.more(f"completed ({len(rep.completed)}): {labels(rep.completed)}")
        self.out.more(f"cancelled ({len(rep.cancelled)}): {labels(rep.cancelled)}")

    async def wait_for_room(self, batch: list[Envelope]) -> None:
        """A producer that waits for room instead of failing (backpressure)."""
        started = self.out.now()
        self.out.say(
            f"send_wait({labels(batch)}) waits for room ({self.q.capacity_used}/{CAPACITY} used)"
        )
        try:
            await self.q.send_wait(*batch, timeout=0.5 * self.options.duration)
        except envq.EnvqError as exc:
            self.out.say(f"send_wait({labels(batch)}) gave up: {error_text(exc)}")
            return
        self.out.say(
            f"send_wait admitted {labels(batch)} after {self.out.now() - started:.2f}s "
            f"of backpressure ({self.q.capacity_used}/{CAPACITY} used)"
        )

    async def run(self) -> int:
        """Run the whole story; return the exit code."""
        o = self.options
        q = self.q
        out = self.out
        work = self.work
        out.start_clock()
        out.plain(
            f"envq demo: queue {q.name!r}, {o.workers} workers, capacity {CAPACITY}, "
            f"seed {o.seed}, {o.duration:g}s of workload"
        )
        out.plain(
            f"plan: stop(mode=STOP) at {self.stop_at:.2f}s, start() again {self.pause:.2f}s "
            f"after it, stop() + terminate() at {o.duration:.2f}s"
        )
        out.plain(
            f"emails retry with Retry(attempts={work.retry.attempts}, base={work.retry.base:g}"
            f", jitter=False); lines marked * are the driver's own calls"
        )
        if self.metrics_url:
            out.plain(f"metrics: {self.metrics_url}")
        out.plain()
        q.subscribe(self.narrator.on_event)
        out.start_view(q)
        q.start()

        emails = work.emails()
        metrics = work.collector()
        reports = work.reports()
        first = [*emails[:7], emails[9], metrics, *reports]
        q.send(*first)
        out.say(
            f"send {len(first)}: email/1..7, email/10 (delay {emails[9].delay:.2f}s), "
            f"metrics/queue (every {METRICS_INTERVAL}s, deadline {METRICS_DEADLINE}s), "
            f"report/21 (delay {reports[0].delay:g}s), report/22 (delay {reports[1].delay:g}s)"
        )
        before = q.statistics().dedups
        q.send(emails[1])
        out.say(
            f"send(email/2) again while it is queued: deduplicated "
            f"(dedups {before} -> {q.statistics().dedups}, {q.capacity_used}/{CAPACITY} used)"
        )
        late = emails[7:9]
        try:
            q.send(*late)
        except envq.CapacityExceeded as exc:
            out.say(f"send({labels(late)}) refused: {error_text(exc)}")
        else:
            self.problems.append("a send over capacity was admitted")
        self.producer = asyncio.create_task(self.wait_for_room(late))

        try:
            await asyncio.wait_for(
                self.narrator.blacklisted.wait(), timeout=self.stop_at - out.now()
            )
        except TimeoutError:
            self.problems.append("the report type was not blacklisted in time")
            out.say("report type was not blacklisted before the stop")
        else:
            try:
                q.send(work.late_report())
            except envq.TypeBlacklisted as exc:
                out.say(f"send(report/23) refused: {error_text(exc)}")
            else:
                self.problems.append("a send of a blacklisted type was admitted")

        await self.sleep_until(self.stop_at)
        out.say("stop(mode=StopMode.STOP): waiting envelopes are parked, in-flight ones finish")
        rep = await q.stop(mode=StopMode.STOP)
        self.report("stop report", rep)
        if not rep.parked:
            self.problems.append("the stop parked nothing")
        try:
            q.send(work.ping())
        except envq.QueueNotRunning as exc:
            out.say(f"send(email/11) while stopped refused: {error_text(exc)}")

        await asyncio.sleep(self.pause)
        parked = len(rep.parked)
        out.say(f"start() again: {parked} parked envelope(s) resume with the delay they had left")
        q.start()

        await self.sleep_until(o.duration)
        await self.settle_producer()
        out.end_view()
        out.say("stop() (DRAIN): ready envelopes run first, waiting ones are parked")
        rep = await q.stop()
        self.report("final stop report", rep)
        return await self.finish(interrupted=False)

    async def settle_producer(self) -> None:
        """Cancel the send_wait producer if it is still waiting."""
        task = self.producer
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def interrupted(self) -> None:
        """Ctrl-C: stop (cancelling in-flight attempts), terminate, report."""
        self.out.end_view()
        self.out.plain()
        self.out.say(
            "interrupted (Ctrl-C): stop(mode=StopMode.STOP, cancel=True), then terminate()"
        )
        await self.settle_producer()
        if self.q.state is QueueState.RUNNING:
            rep = await self.q.stop(mode=StopMode.STOP, cancel=True)
        else:
            rep = await self.q.stop()
        self.report("stop report", rep)
        await self.finish(interrupted=True)

    async def finish(self, *, interrupted: bool) -> int:
        """Terminate, print the statistics, check that nothing was lost."""
        q = self.q
        out = self.out
        tally = self.narrator.tally
        used = q.capacity_used
        handed = await q.terminate()
        out.say(f"terminate() handed back {len(handed)}: {labels(handed)}")
        stats = q.statistics()
        if stats.capacity_used != 0:
            self.problems.append(f"capacity_used is {stats.capacity_used} after terminate")
        if used != len(handed):
            self.problems.append(f"{used} envelope(s) were live but {len(handed)} handed back")
        ended = sum(tally.terminal.values())
        if ended != tally.admitted:
            self.problems.append(f"{tally.admitted} admitted but {ended} ended")
        for state in (EnvState.SUCCEEDED, EnvState.FAILED, EnvState.STOPPED, EnvState.RETURNED):
            if stats.by_state[state] != tally.terminal.get(state, 0):
                self.problems.append(f"statistics and events disagree on {state.name}")

        def row(name: str, value: str) -> None:
            out.plain(f"  {name:<15}{value}")

        def counts(items: Iterable[tuple[str, int]]) -> str:
            shown = [f"{k}={v}" for k, v in items if v]
            return "  ".join(shown) if shown else "none"

        out.plain()
        out.plain("== final statistics ==")
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
        t = tally.terminal
        row(
            "accounted",
            f"{tally.admitted} admitted = {t.get(EnvState.SUCCEEDED, 0)} succeeded + "
            f"{t.get(EnvState.FAILED, 0)} failed + {t.get(EnvState.STOPPED, 0)} stopped + "
            f"{t.get(EnvState.RETURNED, 0)} returned",
        )
        row("delivered", ", ".join(self.work.delivered) or "-")
        row("in_flight", f"{stats.in_flight}  stuck_threads={stats.stuck_threads}")
        out.plain()
        if self.problems:
            for problem in self.problems:
                out.plain(f"PROBLEM: {problem}")
            return 1
        out.plain(
            "demo interrupted: queue stopped and terminated cleanly"
            if interrupted
            else "demo finished: every envelope accounted for"
        )
        return 0
