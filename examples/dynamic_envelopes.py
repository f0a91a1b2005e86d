"""One-off envelopes sent while the queue runs (Go: simple_queue_with_simple_dynamic_envelopes.go).

A producer sends a new one-off envelope every 0.1 s until the example ends; five
workers run them as they arrive. Stopping in DRAIN mode runs what is still ready,
so every email that was admitted is sent.

Run: ``python examples/dynamic_envelopes.py`` (about 1.5 s; Ctrl+C stops it early).
"""

from __future__ import annotations

import asyncio
import itertools

from _common import clock, until_signal_or_timeout

import envq


async def email(env: envq.Envelope) -> None:
    await asyncio.sleep(0.05)  # the work
    print(clock(), "Email", env.id)


async def produce(queue: envq.Queue, every: float) -> int:
    """Send a new envelope every ``every`` seconds until cancelled; return how many."""
    sent = 0
    try:
        for n in itertools.count(1):
            await asyncio.sleep(every)
            try:
                queue.send(envq.Envelope(invoke=email, id=n, type="email", deadline=1))
                sent += 1
            except envq.EnvqError as exc:
                print(f"main: can't send envelope to queue: {exc}")
    except asyncio.CancelledError:
        print("sender: done")
    return sent


async def main() -> None:
    queue = envq.Queue("some_queue", workers=5, capacity=1_000_000)
    queue.start()
    producer = asyncio.create_task(produce(queue, every=0.1))

    await until_signal_or_timeout(1.0)
    producer.cancel()
    sent = await producer
    print("parent: done")
    await queue.stop()  # DRAIN: ready envelopes still run
    succeeded = queue.statistics().by_state[envq.EnvState.SUCCEEDED]
    print(f"sent {sent}, succeeded {succeeded}")
    await queue.terminate()
    print("queue: done")


if __name__ == "__main__":
    asyncio.run(main())
