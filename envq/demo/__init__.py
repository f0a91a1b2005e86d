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

The package, from the entry point down: :mod:`~envq.demo.run` (:func:`run_demo`: the
view, the metrics server, the loop, the exit codes), :mod:`~envq.demo.scenario` (the
driver's script), :mod:`~envq.demo.workload` (the envelopes and their jobs),
:mod:`~envq.demo.narration` (the event listener that tells the story),
:mod:`~envq.demo.live` (the rich view), :mod:`~envq.demo.output` (where lines go and how
they look) and :mod:`~envq.demo.options` (:class:`DemoOptions`).
"""

from envq.demo.options import DemoOptions
from envq.demo.run import run_demo

__all__ = ["DemoOptions", "run_demo"]
