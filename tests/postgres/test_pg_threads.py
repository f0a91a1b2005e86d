"""A PostgreSQL queue's coroutine methods awaited from other threads and event loops:
handed to the loop that connected the queue (its connections belong there)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock


def _in_thread(coro_fn: Any) -> Any:
    """Run ``asyncio.run(coro_fn())`` in a thread of its own; its result or error."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["result"] = asyncio.run(coro_fn())
        except BaseException as error:  # handed back to the test
            out["error"] = error

    thread = threading.Thread(target=body)
    thread.start()
    return thread, out


async def _joined(thread: threading.Thread, out: dict[str, Any]) -> Any:
    await asyncio.to_thread(thread.join, 30)
    assert not thread.is_alive(), "the call from the other thread never returned"
    if "error" in out:
        raise out["error"]
    return out["result"]


async def test_send_and_lifecycle_from_another_threads_loop(pg_dsn: str) -> None:
    name = f"threads-{uuid.uuid4().hex[:6]}"
    async with PgQueue(pg_dsn, name, workers=2, poll=0.05) as queue:
        home = threading.get_ident()

        async def elsewhere() -> tuple[int, envq.StopReport, dict[str, int]]:
            assert threading.get_ident() != home
            await queue.start()
            admitted = await queue.send(
                envq.Envelope(invoke=pg_jobs.noop, id=("t", 1)),
                envq.Envelope(invoke=pg_jobs.noop, id=("t", 2)),
            )
            for _ in range(400):
                counts = await queue.counts()
                if counts.get("succeeded") == 2:
                    break
                await asyncio.sleep(0.05)
            await queue.stop()
            return admitted, await queue.wait_stopped(), counts

        admitted, report, counts = await _joined(*_in_thread(elsewhere))
        assert admitted == 2
        assert counts == {"succeeded": 2}
        assert report == envq.StopReport(complete=True)
        assert (await queue.statistics()).state is envq.QueueState.STOPPED


async def test_a_call_while_the_home_loop_is_not_running_is_refused_by_name(
    pg_dsn: str,
) -> None:
    name = f"idle-{uuid.uuid4().hex[:6]}"
    queue = PgQueue(pg_dsn, name, workers=0)
    home = asyncio.new_event_loop()
    try:
        # Connected on a loop that then stops running: its connections wait there.
        await asyncio.to_thread(home.run_until_complete, queue.connect())
        with pytest.raises(RuntimeError, match=r"send\(\) was called from another event loop"):
            await queue.send(envq.Envelope(invoke=pg_jobs.noop))
        # Nothing was admitted meanwhile; the queue works again on its own loop.
        assert await asyncio.to_thread(home.run_until_complete, queue.counts()) == {}
    finally:
        await asyncio.to_thread(home.run_until_complete, queue.close())
        home.close()


async def test_subscribe_and_unsubscribe_from_a_plain_thread(pg_dsn: str) -> None:
    name = f"tsub-{uuid.uuid4().hex[:6]}"
    heard: list[tuple[int, envq.Event]] = []
    async with PgQueue(pg_dsn, name, workers=1, poll=0.05, event_poll=0.05) as queue:
        home = threading.get_ident()
        unsubscribe = await asyncio.to_thread(
            queue.subscribe, lambda event: heard.append((threading.get_ident(), event))
        )
        await queue.start()
        await queue.send(envq.Envelope(invoke=pg_jobs.noop, id="from-a-thread"))
        for _ in range(400):
            if any(e.to_state is envq.EnvState.SUCCEEDED for _, e in heard):
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(unsubscribe)
        assert [e.to_state for _, e in heard if e.envelope is not None] == [
            envq.EnvState.READY,
            envq.EnvState.RUNNING,
            envq.EnvState.SUCCEEDED,
        ]
        assert {thread for thread, _ in heard} == {home}
        count = len(heard)
        await queue.stop()
        await asyncio.sleep(0.3)
        assert len(heard) == count, "an unsubscribed listener heard the stop"
