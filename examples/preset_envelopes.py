"""Envelopes sent before the queue starts (Go: simple_queue_with_simple_preset_envelopes.go).

Three periodic envelopes and one one-off are sent while the queue is still INIT: they
wait in the pre-start buffer (and count against capacity) until ``start()``. After a
second the example stops the queue (DRAIN) and terminates it: the periodic envelopes
are parked by the stop and handed back by ``terminate()``, where the Go library's
stop drops them.

Run: ``python examples/preset_envelopes.py`` (about 1.5 s; Ctrl+C stops it early).
"""

from __future__ import annotations

import asyncio

from _common import clock, until_signal_or_timeout

import envq


def email(version: str) -> envq.Invoke:
    """An invoke that prints which email it sends."""

    async def invoke(env: envq.Envelope) -> None:
        print(clock(), "Email", version)

    return invoke


async def main() -> None:
    # NewSimpleDrainQueue(ctx, "some_queue", 5): 5 workers, DRAIN, wait, capacity 1e6.
    queue = envq.Queue("some_queue", workers=5, capacity=1_000_000)
    queue.send(
        envq.Envelope(invoke=email("v1"), interval=0.2, deadline=0.1),  # NewScheduleEnvelope
        envq.Envelope(invoke=email("v2"), interval=0.4, deadline=0.3),
        envq.Envelope(invoke=email("v3"), interval=0.6, deadline=0.2),
        envq.Envelope(invoke=email("dynamic"), deadline=0.1),  # NewDynamicEnvelope
    )
    print(f"before start: {queue.state.name}, {queue.capacity_used} buffered")
    queue.start()

    await until_signal_or_timeout(1.0)
    print("parent: done")
    report = await queue.stop()  # DRAIN: the next periodic runs are parked, not lost
    print(f"stopped: {len(report.parked)} parked")
    handed_back = await queue.terminate()
    print(f"terminated: {len(handed_back)} handed back, capacity used {queue.capacity_used}")
    print("queue: done")


if __name__ == "__main__":
    asyncio.run(main())
