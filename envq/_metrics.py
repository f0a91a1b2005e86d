"""Prometheus metrics for envq queues (the optional ``envq[prometheus]`` extra).

Theory of operation
-------------------
:func:`prometheus_metrics` subscribes a listener to a queue's events and
registers one collector per ``prometheus_client`` registry, shared by every queue
exported through that registry, so each metric family appears once with one series
per queue (label ``name``). Nothing is registered at import, and this module imports
``prometheus_client`` only when one of its functions is called: ``import envq`` works
without the extra.

The client-go workqueue metrics are kept by the listener from the events, on the
event loop, timed with the loop's clock (so they follow virtual time in tests):

* an envelope is *added* when it enters READY (client-go's ``Add``: the item is in the
  queue, ready for a worker); delayed, buffered and parked envelopes are not in the
  queue yet, as a client-go item waiting in ``AddAfter`` is not;
* *queue duration* is READY → RUNNING, *work duration* is RUNNING → the attempt's next
  state (the attempt, and its ``on_success``/``on_failure`` hook: client-go's ``Done``);
* a *retry* is a failed attempt (ERROR, TIMEOUT, EXPIRED: the outcomes whose rows put
  an envelope back as a failure retry) whose envelope is put back for another run
  (READY, DELAYED, or PARKED because the queue is stopping);
* ``depth``, the in-flight gauges and envq's own metrics are computed at scrape time
  from ``Queue.statistics()`` and the attempts in flight.

A scrape usually runs on another thread (``prometheus_client``'s HTTP server,
:func:`serve_metrics`). The queue is not thread-safe, so the collector hands the
reading to the queue's loop (``call_soon_threadsafe``) and waits for it at most
:data:`SCRAPE_TIMEOUT` seconds; a loop that does not answer in time (blocked by a
stuck synchronous call) is served the last snapshot taken.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import http.server
import threading
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Protocol, cast, final

from envq import _checks
from envq._envelope import Envelope
from envq._machine import LIVE_STATES, OUTCOMES, TERMINAL_STATES, EnvState, Outcome, QueueState
from envq._reports import Event
from envq._values import Statistics

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry

    from envq._protocol import QueueProtocol
    from envq._queue import Queue

__all__ = [
    "BUCKETS",
    "SCRAPE_TIMEOUT",
    "MetricsServer",
    "PrometheusMetrics",
    "prometheus_metrics",
    "serve_metrics",
]

#: Histogram buckets of client-go's workqueue metrics:
#: ``prometheus.ExponentialBuckets(10e-9, 10, 10)``, 10 ns to 10 s.
BUCKETS: Final = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
#: The buckets' ``le`` labels, as prometheus_client writes them ("1e-08" … "10.0", "+Inf").
_LE: Final = (*(repr(bound) for bound in BUCKETS), "+Inf")
#: Longest a scrape from another thread waits for the queue's loop, in seconds.
SCRAPE_TIMEOUT: Final = 2.0

_INSTALL: Final = (
    "Prometheus metrics need the prometheus_client package: "
    "pip install 'envq[prometheus]' (or pip install prometheus_client)"
)

_READY: Final = EnvState.READY
_RUNNING: Final = EnvState.RUNNING
#: The outcomes whose move back into the queue is a failure retry (``limited`` rows).
_FAILED_OUTCOMES: Final = frozenset(o for (_, o), row in OUTCOMES.items() if row.limited)
_PUT_BACK: Final = frozenset({EnvState.READY, EnvState.DELAYED, EnvState.PARKED})
#: Envelope states by kind, in the order of :class:`envq.EnvState` (metric label order).
_LIVE: Final = tuple(state for state in EnvState if state in LIVE_STATES)
_ENDED: Final = tuple(state for state in EnvState if state in TERMINAL_STATES)

# Help texts of client-go's workqueue metrics (k8s.io/component-base/metrics/prometheus/
# workqueue), so dashboards and alerts built for them read the same.
_WQ_HELP: Final = {
    "adds": "Total number of adds handled by workqueue",
    "depth": "Current depth of workqueue",
    "queue_duration": "How long in seconds an item stays in workqueue before being requested.",
    "work_duration": "How long in seconds processing an item from workqueue takes.",
    "unfinished": (
        "How many seconds of work has done that is in progress and hasn't been observed "
        "by work_duration. Large values indicate stuck threads. One can deduce the number "
        "of stuck threads by observing the rate at which this increases."
    ),
    "longest": "How many seconds has the longest running processor for workqueue been running.",
    "retries": "Total number of retries handled by workqueue",
}


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401, PLC0415 - the optional extra, on demand
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc


class Histogram:
    """Per-bucket counts (not cumulative) and the sum, over :data:`BUCKETS` + ``+Inf``."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets count observations <= le: the first bound >= value.
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value

    def copy(self) -> Histogram:
        other = Histogram()
        other.counts = list(self.counts)
        other.total = self.total
        return other

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count)`` pairs as ``HistogramMetricFamily`` takes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for le, count in zip(_LE, self.counts, strict=True):
            running += count
            out.append((le, float(running)))
        return out


class Snapshot:
    """One queue's numbers at one scrape. ``adds`` and ``queue_hist`` are None where
    they cannot be known (a shared queue: its envelopes enter READY on any node);
    ``rows``: the ended envelopes are rows kept for a while (a gauge each), not
    counted since the queue was made."""

    __slots__ = (
        "adds",
        "longest",
        "queue_hist",
        "retries",
        "rows",
        "stats",
        "unfinished",
        "work_hist",
    )

    def __init__(
        self,
        stats: Statistics,
        adds: int | None,
        retries: int,
        queue_hist: Histogram | None,
        work_hist: Histogram,
        unfinished: float,
        longest: float,
        *,
        rows: bool = False,
    ) -> None:
        self.stats = stats
        self.adds = adds
        self.retries = retries
        self.queue_hist = queue_hist
        self.work_hist = work_hist
        self.unfinished = unfinished
        self.longest = longest
        self.rows = rows


class Source(Protocol):
    """Where one queue's series come from."""

    name: str

    def snapshot(self) -> Snapshot | None:
        """The queue's numbers now (None: none yet)."""
        ...


class _Source:
    """The listener of one queue: keeps the event-derived numbers, takes snapshots."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.name = queue.name
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.adds = 0
        self.retries = 0
        self.queue_hist = Histogram()
        self.work_hist = Histogram()
        #: Envelopes READY / RUNNING → the loop time they entered that state.
        self.ready: dict[Envelope, float] = {}
        self.running: dict[Envelope, float] = {}
        self.last: Snapshot | None = None
        self._find_loop()

    def _find_loop(self) -> None:
        with contextlib.suppress(RuntimeError):  # no loop yet: found at the next event
            self.loop = asyncio.get_running_loop()

    def __call__(self, ev: Event) -> None:
        """The queue listener."""
        if self.loop is None:
            self._find_loop()
        env = ev.envelope
        if env is None:
            return
        frm = ev.from_state
        to = ev.to_state
        t = ev.time
        with self.lock:
            if frm is _READY:
                since = self.ready.pop(env, None)
                if to is _RUNNING and since is not None:
                    self.queue_hist.observe(t - since)
            elif frm is _RUNNING:
                since = self.running.pop(env, None)
                if since is not None:
                    self.work_hist.observe(t - since)
                if ev.outcome in _FAILED_OUTCOMES and to in _PUT_BACK:
                    self.retries += 1
            if to is _READY:
                self.adds += 1
                self.ready[env] = t
            elif to is _RUNNING:
                self.running[env] = t

    def take(self) -> Snapshot:
        """Read the queue and the event-derived numbers; run it on the queue's loop."""
        stats = self.queue.statistics()
        loop = self.loop
        with self.lock:
            now = loop.time() if loop is not None else 0.0
            ages = [max(0.0, now - since) for since in self.running.values()]
            snap = Snapshot(
                stats,
                self.adds,
                self.retries,
                self.queue_hist.copy(),
                self.work_hist.copy(),
                sum(ages),
                max(ages, default=0.0),
            )
            self.last = snap
        return snap

    def snapshot(self) -> Snapshot:
        """:meth:`take` on the queue's loop, from whichever thread scrapes."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running() or _running_here(loop):
            return self.take()
        fut: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()

        def take_on_loop() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(self.take())
            except BaseException as exc:
                fut.set_exception(exc)

        try:
            loop.call_soon_threadsafe(take_on_loop)
        except RuntimeError:  # the loop closed meanwhile: nothing runs on it any more
            return self.take()
        try:
            return fut.result(timeout=SCRAPE_TIMEOUT)
        except TimeoutError:
            # The loop is blocked (a stuck synchronous call): serve the last snapshot.
            # Never scraped before: read from here, as nothing moves on a blocked loop.
            fut.cancel()
            with self.lock:
                last = self.last
            return last if last is not None else self.take()


def _running_here(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Collector:
    """The collector of one registry: every queue exported through it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sources: dict[str, Source] = {}

    def describe(self) -> list[Metric]:
        """The metric families, without samples (for the registry's name checks)."""
        return list(_families([]))

    def collect(self) -> list[Metric]:
        """Every metric family, one series per queue."""
        with self.lock:
            sources = sorted(self.sources.values(), key=lambda s: s.name)
        snaps = [(s.name, s.snapshot()) for s in sources]
        return list(_families([(name, snap) for name, snap in snaps if snap is not None]))


def _families(snaps: list[tuple[str, Snapshot]]) -> Iterator[Metric]:
    from prometheus_client.core import (  # noqa: PLC0415 - the optional extra, on demand
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    def counter(name: str, help_: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, help_, labels=["name", *labels])

    def gauge(name: str, help_: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help_, labels=["name", *labels])

    def histogram(name: str, help_: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, help_, labels=["name"])

    # client-go's workqueue metrics.
    adds = counter("workqueue_adds_total", _WQ_HELP["adds"])
    depth = gauge("workqueue_depth", _WQ_HELP["depth"])
    queue_d = histogram("workqueue_queue_duration_seconds", _WQ_HELP["queue_duration"])
    work_d = histogram("workqueue_work_duration_seconds", _WQ_HELP["work_duration"])
    unfinished = gauge("workqueue_unfinished_work_seconds", _WQ_HELP["unfinished"])
    longest = gauge("workqueue_longest_running_processor_seconds", _WQ_HELP["longest"])
    retries = counter("workqueue_retries_total", _WQ_HELP["retries"])
    # envq's own.
    used = gauge("envq_capacity_used", "Envelopes in non-terminal states (counted by capacity).")
    limit = gauge("envq_capacity_limit", "The queue's capacity; 0 means unlimited.")
    envelopes = gauge(
        "envq_envelopes",
        "Envelopes in the queue by live state (on PostgreSQL, ended rows kept too).",
        labels=("state",),
    )
    ended = counter(
        "envq_envelopes_ended_total", "Envelopes that ended, by terminal state.", ("state",)
    )
    parked = gauge("envq_parked", "Envelopes held back across a stop (PARKED).")
    in_flight = gauge("envq_in_flight", "Attempts in flight.")
    outcomes = counter("envq_outcomes_total", "Attempts by outcome.", ("outcome",))
    dedups = counter("envq_dedups_total", "Sends of an envelope already live in the queue.")
    rejections = counter("envq_rejections_total", "Refused sends by reason.", ("reason",))
    stuck = gauge(
        "envq_stuck_threads",
        "Plain callables still running in a thread after their deadline gave up on them.",
    )
    state = gauge(
        "envq_queue_state", "The queue's lifecycle state (1 for the current one).", ("state",)
    )

    for name, snap in snaps:
        stats = snap.stats
        if snap.adds is not None:
            adds.add_metric([name], snap.adds)
        depth.add_metric([name], stats.by_state.get(_READY, 0))
        if snap.queue_hist is not None:
            queue_d.add_metric([name], snap.queue_hist.cumulative(), snap.queue_hist.total)
        work_d.add_metric([name], snap.work_hist.cumulative(), snap.work_hist.total)
        unfinished.add_metric([name], snap.unfinished)
        longest.add_metric([name], snap.longest)
        retries.add_metric([name], snap.retries)
        used.add_metric([name], stats.capacity_used)
        limit.add_metric([name], stats.capacity_limit)
        for s in _LIVE:
            envelopes.add_metric([name, s.value], stats.by_state.get(s, 0))
        for s in _ENDED:
            # A shared queue's ended envelopes are rows until retention removes them.
            kept = envelopes if snap.rows else ended
            kept.add_metric([name, s.value], stats.by_state.get(s, 0))
        parked.add_metric([name], stats.by_state.get(EnvState.PARKED, 0))
        in_flight.add_metric([name], stats.in_flight)
        for outcome in Outcome:
            outcomes.add_metric([name, outcome.value], stats.outcomes.get(outcome, 0))
        dedups.add_metric([name], stats.dedups)
        for reason, count in sorted(stats.rejections.items()):
            rejections.add_metric([name, reason], count)
        stuck.add_metric([name], stats.stuck_threads)
        for qs in QueueState:
            state.add_metric([name, qs.value], 1.0 if stats.state is qs else 0.0)

    yield from (adds, depth, queue_d, work_d, unfinished, longest, retries)
    yield from (used, limit, envelopes, ended, parked, in_flight, outcomes, dedups)
    yield from (rejections, stuck, state)


_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, _Collector] = weakref.WeakKeyDictionary()
_COLLECTORS_LOCK: Final = threading.Lock()


@final
class PrometheusMetrics:
    """The export of one queue's metrics to one registry; made by
    :func:`envq.prometheus_metrics`.

    ``close()`` (or leaving a ``with`` block) unsubscribes from the queue and drops the
    queue's series; the registry's envq collector goes when its last queue does.
    """

    def __init__(self, queue: QueueProtocol, registry: CollectorRegistry) -> None:
        _check_queue("PrometheusMetrics: queue", queue)
        _check_registry("PrometheusMetrics: registry", registry, "register", "unregister")
        self.queue: Final = queue
        self.registry: Final = registry
        self._source, self._unsubscribe = _source_of("PrometheusMetrics: queue", queue)
        try:
            self._collector: _Collector | None = self._join(queue.name, registry)
        except BaseException:
            self._unsubscribe()
            raise

    def _join(self, name: str, registry: CollectorRegistry) -> _Collector:
        """Add this queue's source to the registry's collector (made on first use)."""
        with _COLLECTORS_LOCK:
            collector = _COLLECTORS.get(registry)
            fresh = collector is None
            if collector is None:
                collector = _Collector()
            with collector.lock:
                if name in collector.sources:
                    raise ValueError(
                        f"queue {name!r}: its metrics are already exported to this "
                        "registry (queue names label the series, so they must be unique)"
                    )
                collector.sources[name] = self._source
            if fresh:
                try:
                    registry.register(cast("Collector", collector))
                except BaseException:
                    collector.sources.clear()
                    raise
                _COLLECTORS[registry] = collector
        return collector

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._collector is None

    def close(self) -> None:
        """Stop exporting: unsubscribe from the queue and remove its series. Idempotent."""
        collector = self._collector
        if collector is None:
            return
        self._collector = None
        self._unsubscribe()
        with _COLLECTORS_LOCK:
            with collector.lock:
                if collector.sources.get(self.queue.name) is self._source:
                    del collector.sources[self.queue.name]
                empty = not collector.sources
            if empty and _COLLECTORS.get(self.registry) is collector:
                del _COLLECTORS[self.registry]
                self.registry.unregister(cast("Collector", collector))

    def __enter__(self) -> PrometheusMetrics:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<envq.PrometheusMetrics queue={self.queue.name!r} {state}>"


def prometheus_metrics(
    queue: QueueProtocol, registry: CollectorRegistry | None = None
) -> PrometheusMetrics:
    """Export ``queue``'s metrics to a ``prometheus_client`` registry (default: the
    global ``prometheus_client.REGISTRY``); returns the export, whose ``close()`` stops it.

    The series carry client-go's workqueue names, types, buckets and label ``name``
    (the queue's name), so dashboards built for Kubernetes controllers work; envq's own
    metrics are prefixed ``envq_``. See ``docs/observability.md`` for the list.
    Attach it before ``start()`` to see every envelope: attempts already in flight or
    waiting when it attaches are not timed. Needs the ``envq[prometheus]`` extra
    (``ImportError`` otherwise). ``ValueError`` if a queue of the same name is already
    exported to the registry.
    """
    _check_queue("prometheus_metrics: queue", queue)
    if registry is not None:
        _check_registry("prometheus_metrics: registry", registry, "register", "unregister")
    _require_prometheus()
    if registry is None:
        from prometheus_client import REGISTRY  # noqa: PLC0415 - the optional extra

        registry = REGISTRY
    return PrometheusMetrics(queue, registry)


def _check_queue(what: str, queue: object) -> None:
    from envq._queue import Queue  # noqa: PLC0415 - envq._queue is not needed at import

    if not isinstance(queue, Queue) and getattr(type(queue), "_metrics_source", None) is None:
        _checks.instance(what, queue, Queue, want="an envq.Queue or an envq.postgres.PgQueue")


def _source_of(what: str, queue: object) -> tuple[Source, Callable[[], None]]:
    """The source of ``queue``'s series, and what stops it.

    :raises TypeError: neither an :class:`envq.Queue` nor an
        :class:`envq.postgres.PgQueue`.
    """
    from envq._queue import Queue  # noqa: PLC0415 - envq._queue is not needed at import

    if isinstance(queue, Queue):
        source = _Source(queue)
        # envq's own listener: it does not count as handling failures.
        return source, queue._listen(source, handles_failures=False)
    _check_queue(what, queue)
    shared = type(queue)._metrics_source(queue)  # type: ignore[attr-defined]
    return shared, shared.close


def _check_registry(what: str, registry: object, *methods: str) -> None:
    for method in methods:
        if not callable(getattr(registry, method, None)):
            raise TypeError(
                f"{what} must be a prometheus_client CollectorRegistry, got "
                f"{_checks.show(registry)} (it has no {method}() method)"
            )


@final
class MetricsServer:
    """A ``/metrics`` HTTP endpoint on a background thread; made by
    :func:`envq.serve_metrics`. ``close()`` (or leaving a ``with`` block) stops it.

    The server and its thread are the ones ``prometheus_client.start_http_server``
    returns; this object only adds the address read back, ``close()`` and ``with``.
    """

    def __init__(self, server: http.server.HTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._closed = False
        address: Any = server.server_address
        #: The address and port served (the real port when 0 was asked for).
        self.host: Final[str] = str(address[0])
        self.port: Final[int] = int(address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<envq.MetricsServer {self.url}{' closed' if self._closed else ''}>"


def serve_metrics(
    port: int = 0, *, host: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (default: the global ``prometheus_client.REGISTRY``) in the
    Prometheus text format on ``http://host:port/metrics``, from a daemon thread.

    ``port=0`` picks a free port (read it back from ``.port``). The default host is the
    loopback interface: pass ``host="0.0.0.0"`` deliberately to expose it. Needs the
    ``envq[prometheus]`` extra; ``OSError`` if the address cannot be bound.
    """
    port = _checks.integer("serve_metrics: port", port, minimum=0, maximum=65535)
    _checks.instance("serve_metrics: host", host, str, want="a str")
    if registry is not None:
        _check_registry("serve_metrics: registry", registry, "collect")
    _require_prometheus()
    import prometheus_client  # noqa: PLC0415 - the optional extra

    server, thread = prometheus_client.start_http_server(
        port, addr=host, registry=registry if registry is not None else prometheus_client.REGISTRY
    )
    return MetricsServer(server, thread)
