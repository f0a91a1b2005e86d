"""Shared machinery: sizes per mode, cases, the interleaved runner, statistics, pools.

A *case* is one thing measured; calling it runs one repetition (its own event loop,
its own ``gc.collect()`` before the timed region) and returns named metrics. The
runner interleaves: every repetition runs every section, and within a section every
case once, starting one case later than the repetition before, so drift and
background load hit all cases alike.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import envq

WORKERS = 4
INTERVAL = 1.0  # periodic interval, seconds
DEADLINE = 10.0

T = TypeVar("T")
Metrics = dict[str, float]
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Sizes of one mode (``full``, ``quick`` or ``smoke``)."""

    mode: str
    reps: int
    n: int  # one-off throughput: envelopes per run
    n_aps: int  # one-off throughput: APScheduler jobs per run
    latency_samples: int
    periodic: int  # periodic envelopes / timers / jobs
    periodic_aps: int
    window: float  # seconds of periodic running that are measured
    memory_n: int
    memory_aps: int
    sizes: tuple[int, ...]  # scaling: queued envelopes
    budget: float = 60.0  # a case whose repetition takes longer is skipped
    #: one-off structure counters (collections, timers, timeouts): envelopes per run
    n_structure: int = 100_000


MODES: dict[str, Config] = {
    "full": Config(
        mode="full",
        reps=5,
        n=100_000,
        n_aps=10_000,
        latency_samples=2_000,
        periodic=10_000,
        periodic_aps=10_000,
        window=5.0,
        memory_n=100_000,
        memory_aps=10_000,
        sizes=(1_000, 10_000, 100_000, 1_000_000),
    ),
    "quick": Config(
        mode="quick",
        reps=3,
        n=10_000,
        n_aps=2_000,
        latency_samples=300,
        periodic=2_000,
        periodic_aps=1_000,
        window=1.5,
        memory_n=10_000,
        memory_aps=2_000,
        sizes=(1_000, 10_000),
    ),
    "smoke": Config(
        mode="smoke",
        reps=2,
        n=1_000,
        n_aps=200,
        latency_samples=50,
        periodic=200,
        periodic_aps=100,
        window=1.0,
        memory_n=1_000,
        memory_aps=200,
        sizes=(500, 2_000),
        n_structure=2_000,
    ),
}


def missing(module: str) -> str | None:
    """Why an optional peer cannot be used (None: it can). On a new CPython a peer
    may be missing, or installed without a working build: either way its cases are
    not run."""
    if importlib.util.find_spec(module) is None:
        return "is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken build of a peer must not stop the suite
        return f"does not import ({type(exc).__name__}: {exc})"
    return None


def have(module: str) -> bool:
    """Whether an optional peer is installed and imports."""
    return missing(module) is None


def uvloop_factory() -> LoopFactory | None:
    if not have("uvloop"):
        return None
    import uvloop  # noqa: PLC0415 - optional peer, on demand

    return uvloop.new_event_loop


# --------------------------------------------------------------------------------------
# Running one repetition
# --------------------------------------------------------------------------------------


def run_async(main: Callable[[], Coroutine[Any, Any, T]], loop: LoopFactory | None = None) -> T:
    """Run ``main()`` on a fresh event loop (the default one, or ``loop()``)."""
    with asyncio.Runner(loop_factory=loop) as runner:
        return runner.run(main())


def collect() -> None:
    """Right before a timed region: a full collection, so no old garbage is timed."""
    gc.collect()


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    delay = when - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


# --------------------------------------------------------------------------------------
# Work items
# --------------------------------------------------------------------------------------


async def noop(env: envq.Envelope) -> None:
    """The one-off no-op work."""


def sync_noop(item: object) -> None:
    """The thread pool's no-op."""


async def hook(env: envq.Envelope) -> None:
    """A no-op async before/after hook."""


def passthrough(next_: envq.Invoker) -> envq.Invoker:
    """A queue-level stamp that only forwards (one extra coroutine frame per attempt)."""

    async def invoker(env: envq.Envelope) -> None:
        await next_(env)

    return invoker


async def busy_queue() -> tuple[envq.Queue, asyncio.Event]:
    """A RUNNING queue, ``workers=1``, its one worker busy until the event is set: what
    is sent to it stays READY."""
    started = asyncio.Event()
    release = asyncio.Event()

    async def block(env: envq.Envelope) -> None:
        started.set()
        await release.wait()

    q = envq.Queue("bench_busy", workers=1)
    q.start()
    q.send(envq.Envelope(invoke=block))
    await started.wait()
    return q, release


#: The one-off envelopes' fields by kind: no deadline, no hooks (``plain``);
#: ``deadline=10``; before and after hooks (deadline 0). ``benchmarks.ab`` builds the
#: same kinds from another revision's ``Envelope``.
ONEOFF_FIELDS: dict[str, dict[str, Any]] = {
    "plain": {"invoke": noop},
    "deadline": {"invoke": noop, "deadline": DEADLINE},
    "hooked": {"invoke": noop, "before": hook, "after": hook},
}


class Pools:
    """Envelopes built once and reused: constructing one costs far more than sending it
    (and construction is never timed), and an envelope that has ended (or was handed
    back) can be sent again. Every case takes a prefix of the pool it needs."""

    def __init__(self) -> None:
        self._pools: dict[str, list[envq.Envelope]] = {}
        self._rng = random.Random(20_240_601)

    def _get(self, kind: str, n: int, make: Callable[[], envq.Envelope]) -> list[envq.Envelope]:
        pool = self._pools.setdefault(kind, [])
        if len(pool) < n:
            pool.extend(make() for _ in range(n - len(pool)))
        return pool[:n]

    def oneoff(self, kind: str, n: int) -> list[envq.Envelope]:
        """``n`` one-off no-op envelopes of a kind of :data:`ONEOFF_FIELDS`."""
        fields = ONEOFF_FIELDS[kind]
        return self._get(kind, n, lambda: envq.Envelope(**fields))

    def plain(self, n: int) -> list[envq.Envelope]:
        return self.oneoff("plain", n)

    def delayed(self, n: int) -> list[envq.Envelope]:
        """One-off envelopes with delays spread uniformly over [100, 200) s (a busy
        timer heap whose entries are not pushed in order)."""
        rng = self._rng
        return self._get(
            "delayed", n, lambda: envq.Envelope(invoke=noop, delay=100.0 + 100.0 * rng.random())
        )

    def drop(self) -> None:
        self._pools.clear()


POOLS = Pools()


# --------------------------------------------------------------------------------------
# Cases and the interleaved runner
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    """One measured thing. ``fn()`` runs one repetition and returns its metrics."""

    section: str
    key: str
    label: str
    fn: Callable[[], Metrics]
    note: str = ""
    #: (key of a smaller case, factor): skip this case up front when the smaller
    #: case's first repetition times the factor exceeds the budget.
    predict: tuple[str, float] | None = None
    reps: list[int] = field(default_factory=list)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    wall: list[float] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None

    def add(self, rep: int, metrics: Metrics, wall: float) -> None:
        self.reps.append(rep)
        self.wall.append(wall)
        for name, value in metrics.items():
            self.metrics.setdefault(name, []).append(value)

    def values(self, metric: str) -> list[float]:
        return self.metrics.get(metric, [])

    def by_rep(self, metric: str) -> dict[int, float]:
        return dict(zip(self.reps, self.metrics.get(metric, []), strict=True))

    @property
    def ran(self) -> bool:
        return bool(self.reps)


def run_cases(cases: Sequence[Case], reps: int, budget: float, log: Callable[[str], None]) -> None:
    """Every repetition runs every section in order, and each section's cases once, in
    an order rotated by one per repetition (repetition 0 runs them as listed, so
    scaling sizes run smallest first and the skip estimates have data)."""
    by_key = {c.key: c for c in cases}
    sections: list[str] = []
    for case in cases:
        if case.section not in sections:
            sections.append(case.section)
    for rep in range(reps):
        log(f"-- repetition {rep + 1}/{reps}")
        for section in sections:
            group = [c for c in cases if c.section == section]
            k = rep % len(group)
            for case in group[k:] + group[:k]:
                if case.skipped is not None or case.error is not None:
                    continue
                if not case.ran and case.predict is not None:
                    base = by_key[case.predict[0]]
                    if base.skipped is not None and not base.ran:
                        case.skipped = f"not run: {base.label} was skipped"
                        continue
                    if base.wall:
                        estimate = base.wall[0] * case.predict[1]
                        if estimate > budget:
                            case.skipped = (
                                f"not run: estimated {estimate:.0f} s per repetition "
                                f"(> {budget:.0f} s budget)"
                            )
                            log(f"   skip {case.label}: {case.skipped}")
                            continue
                t0 = time.perf_counter()
                try:
                    metrics = case.fn()
                except Exception as exc:  # a peer failing must not lose the whole run
                    case.error = f"{type(exc).__name__}: {exc}"
                    log(f"   FAILED {case.label}: {case.error}")
                    continue
                finally:
                    gc.collect()
                wall = time.perf_counter() - t0
                case.add(rep, metrics, wall)
                shown = ", ".join(f"{k}={_short(v)}" for k, v in metrics.items())
                log(f"   {section:<10} {case.label:<44} {wall:6.1f} s  {shown}")
                if wall > budget:
                    case.skipped = (
                        f"one repetition took {wall:.0f} s (> {budget:.0f} s budget): not repeated"
                    )


def _short(v: float) -> str:
    if v == 0 or 0.01 <= abs(v) < 1e6:
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:.3g}"


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def percentile(sorted_xs: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted data, nearest rank."""
    if not sorted_xs:
        return float("nan")
    i = min(len(sorted_xs) - 1, max(0, round(q * len(sorted_xs) + 0.5) - 1))
    return sorted_xs[i]


def paired(num: Case, den: Case, metric: str) -> list[float]:
    """Per-repetition ratios ``num / den`` over the repetitions both ran."""
    a, b = num.by_rep(metric), den.by_rep(metric)
    return [a[r] / b[r] for r in a if r in b and b[r] != 0]


# --------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------


def load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def memory_total() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "?"


def versions() -> dict[str, str]:
    out = {"python": f"{sys.version.split()[0]} ({platform.python_implementation()})"}
    for dist in ("envq", "aiojobs", "APScheduler", "uvloop", "matplotlib"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
