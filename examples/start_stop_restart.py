"""Hooks, payloads, decisions and a start/stop/start cycle
(Go: queue_with_simple_start_stop_dynamic_execute.go).

- ``email_1`` (one-off) has every hook and a per-envelope logging stamp; its first
  attempt fails, ``on_failure`` answers ``retry_after(0.2)``, and the second succeeds.
  ``invoke`` edits the ``User`` in its payload, which ``after`` then reads.
- ``email_2`` (periodic) ends itself: its ``after`` raises ``StopEnvelope``.
- ``metrics`` and ``food`` are periodic; ``metrics_1`` is a one-off that succeeds and
  ``metrics_3`` one that fails (it has no ``on_failure``: ``dead_letter`` sees it).
- The queue is started, the envelopes sent (re-sending live ones is a no-op), then it
  is stopped at once and started again: the stop (DRAIN) runs what was ready and
  *parks* what was waiting — the periodic envelopes and ``email_1``'s retry — and the
  restart resumes them. Then 15 dynamic one-offs arrive while it runs, and the final
  stop and ``terminate()`` hand back the periodic envelopes still scheduled.

Run: ``python examples/start_stop_restart.py`` (about 2.5 s; Ctrl+C stops it early).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass

from _common import clock, until_signal_or_timeout

import envq


@dataclass
class User:
    name: str
    email: str
    age: int


#: Envelope ids whose first attempt has failed already.
failed_once: set[object] = set()


async def before(env: envq.Envelope) -> None:
    print(clock(), "hook before", env.type, env.id)


async def send_email(env: envq.Envelope) -> None:
    await asyncio.sleep(0.05)
    user: User = env.payload
    print(clock(), "Email", env.type, env.id, "to", user.name)
    if env.id == "first" and env.id not in failed_once:
        failed_once.add(env.id)
        raise ConnectionError("smtp down")
    env.payload = User("Changed Name", user.email, user.age)  # UpdatePayload


async def after_email(env: envq.Envelope) -> None:
    print(clock(), "hook after", env.type, env.id, "payload name:", env.payload.name)


def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
    print(clock(), "failure hook", env.type, env.id, f"attempt {attempt}: {exc!r}")
    return envq.retry_after(0.2)  # RetryOnceAfterDecision(...)


async def on_success(env: envq.Envelope) -> None:
    print(clock(), "success hook", env.type, env.id)


async def stop_after(env: envq.Envelope) -> None:
    print(clock(), "hook after", env.type, "-> StopEnvelope")
    raise envq.StopEnvelope


def printer(text: str) -> envq.Invoke:
    async def invoke(env: envq.Envelope) -> None:
        print(clock(), text)

    return invoke


async def fails(env: envq.Envelope) -> None:
    raise RuntimeError("some error")


def dead_letter(env: envq.Envelope, error: BaseException | None) -> None:
    print(clock(), "dead letter", env.type, f"{error!r}")


def email(id_: object, *, hooks: bool = True) -> envq.Envelope:
    """An ``email_1`` envelope; with ``hooks``, every hook and a logging stamp."""
    user = User("John", "john@example.com", 30)
    if not hooks:
        return envq.Envelope(invoke=send_email, id=id_, type="email_1", deadline=1, payload=user)
    return envq.Envelope(
        invoke=send_email,
        id=id_,
        type="email_1",
        deadline=1,
        before=before,
        after=after_email,
        on_failure=on_failure,
        on_success=on_success,
        stamps=[envq.logging_stamp()],
        payload=user,
    )


async def main() -> None:
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("envq").setLevel(logging.INFO)  # logging_stamp logs at INFO

    email_1 = email("first")
    # The Go example gives several envelopes one id (it dedups by pointer); envq dedups
    # by id, so each envelope here has its own.
    email_2 = envq.Envelope(
        invoke=printer("Email v2"), id="email_2", type="email_2", interval=0.3, after=stop_after
    )
    metrics = envq.Envelope(
        invoke=printer("Metrics v2"), id="metrics", type="metrics", interval=0.3
    )
    metrics_1 = envq.Envelope(invoke=printer("Metrics v1"), id="metrics_1", type="metrics_1")
    metrics_3 = envq.Envelope(invoke=fails, id="metrics_3", type="metrics_3")
    food = envq.Envelope(invoke=printer("Fooding v2"), id="food", type="food", interval=0.2)

    queue = envq.Queue(
        "test_queue",
        workers=5,
        wait=True,
        stop_mode=envq.StopMode.DRAIN,
        capacity=50,
        dead_letter=dead_letter,
    )

    def start() -> None:
        queue.start()
        queue.send(email_1, metrics, food)
        queue.send(email_2)
        queue.send(email_1, email_2, metrics_1, metrics_3)  # the first two are live: no-op

    start()
    report = await queue.stop()  # DRAIN: ready envelopes run, the rest is parked
    print(clock(), "parked after the first stop:", sorted(env.type for env in report.parked))
    # The restart re-arms the parked envelopes; of the sends, those for live envelopes
    # are dedups, while email_2, metrics_1 and metrics_3 have ended, so they run again.
    start()

    async def dynamic() -> None:
        for n in range(1, 16):
            queue.send(email(n, hooks=False))
            await asyncio.sleep(0.02)

    await asyncio.gather(dynamic(), until_signal_or_timeout(1.5))
    print("parent: done")
    report = await queue.stop()
    stats = queue.statistics()
    counts = {state.name: n for state, n in stats.by_state.items() if n}
    print("final states:", counts)
    print("capacity used:", queue.capacity_used, "| dedups:", stats.dedups)
    handed_back = await queue.terminate()
    print("handed back:", sorted(env.type for env in handed_back))
    print("queue: done")


if __name__ == "__main__":
    asyncio.run(main())
