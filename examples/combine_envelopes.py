"""Periodic and one-off envelopes together (Go: simple_queue_with_simple_combine_envelopes.go).

Three periodic envelopes run on their schedules while a producer sends a one-off
envelope every 0.05 s. The queue shares its five workers between them. At the end
the stop runs the ready one-offs (DRAIN) and parks the periodic ones, and
``terminate()`` hands those back.

Run: ``python examples/combine_envelopes.py`` (about 1.5 s; Ctrl+C stops it early).
"""

from __future__ import annotations

import asyncio
import itertools

from _common import clock, until_signal_or_timeout

import envq


async def periodic(env: envq.Envelope) -> None:
    print(clock(), "Email", env.payload)


async def one_off(env: envq.Envelope) -> None:
    await asyncio.sleep(0.02)


async def produce(queue: envq.Queue) -> None:
    """A one-off envelope every 0.05 s until cancelled."""
    try:
        for n in itertools.count(1):
            await asyncio.sleep(0.05)
            queue.send(envq.Envelope(invoke=one_off, id=n, type="dynamic", deadline=1))
    except asyncio.CancelledError:
        print("sender: done")


async def main() -> None:
    queue = envq.Queue("some_queue", workers=5, capacity=1_000_000)
    queue.start()
    queue.send(
        envq.Envelope(invoke=periodic, type="schedule", interval=0.2, deadline=0.1, payload="v1"),
        envq.Envelope(invoke=periodic, type="schedule", interval=0.4, deadline=0.3, payload="v2"),
        envq.Envelope(invoke=periodic, type="schedule", interval=0.6, deadline=0.2, payload="v3"),
    )
    producer = asyncio.create_task(produce(queue))

    await until_signal_or_timeout(1.0)
    producer.cancel()
    await producer
    print("parent: done")
    report = await queue.stop()
    stats = queue.statistics()
    print(f"one-offs succeeded: {stats.by_state[envq.EnvState.SUCCEEDED]}")
    print(f"stopped: {len(report.parked)} parked")
    handed_back = await queue.terminate()
    print("handed back:", sorted(env.payload for env in handed_back))
    print("queue: done")


if __name__ == "__main__":
    asyncio.run(main())
