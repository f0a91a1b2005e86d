"""Periodic envelopes sent to a running queue (Go: simple_queue_with_simple_schedule_envelopes.go).

The queue starts first; a producer task then sends three periodic envelopes, each
with its own interval and deadline. They run on their schedule (fixed delay: the
next run is ``interval`` after the previous attempt ends) until the example stops
the queue, which parks them.

Run: ``python examples/schedule_envelopes.py`` (about 1.5 s; Ctrl+C stops it early).
"""

from __future__ import annotations

import asyncio
import collections

from _common import clock, until_signal_or_timeout

import envq

runs: collections.Counter[str] = collections.Counter()


async def email(env: envq.Envelope) -> None:
    runs[env.payload] += 1
    print(clock(), "Email", env.payload)


async def produce(queue: envq.Queue) -> None:
    """Send the periodic envelopes one by one, as the Go example's goroutine does."""
    for version, interval, deadline in (("v1", 0.2, 0.1), ("v2", 0.4, 0.3), ("v3", 0.6, 0.2)):
        try:
            queue.send(
                envq.Envelope(invoke=email, interval=interval, deadline=deadline, payload=version)
            )
        except envq.EnvqError as exc:
            print(f"main: can't send envelope {version} to queue: {exc}")


async def main() -> None:
    queue = envq.Queue("some_queue", workers=5, capacity=1_000_000)
    queue.start()
    producer = asyncio.create_task(produce(queue))

    await until_signal_or_timeout(1.0)
    await producer
    print("parent: done")
    report = await queue.stop()
    print("runs:", dict(sorted(runs.items())))
    print(f"stopped: {len(report.parked)} parked")
    await queue.terminate()
    print("queue: done")


if __name__ == "__main__":
    asyncio.run(main())
