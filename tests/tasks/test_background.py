"""Tasks from synchronous code: BackgroundQueue and the global queue with no event loop
(docs/retries.md, "Tasks from plain code"). These run on the real clock with generous
margins; nothing here depends on how fast the machine is, only on the order of events.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import envq
from envq import _background

#: Real seconds to wait for anything that should happen "soon".
PATIENCE = 10.0


def envq_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("envq:")]


@pytest.fixture(autouse=True)
def clean_threads(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Each test starts and ends with no envq thread and no asyncio error logged."""
    envq.shutdown()
    assert envq_threads() == []
    with caplog.at_level(logging.WARNING):
        yield
        envq.shutdown()
    assert envq_threads() == []
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text


def no_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return True
    return False


class TestGlobalFromSyncCode:
    def test_submit_with_no_event_loop(self) -> None:
        """envq.submit() from plain code runs the function on a background thread and the
        task's future holds its return value."""
        assert no_running_loop()
        t = envq.submit(lambda: threading.current_thread().name)
        name = t.future.result(PATIENCE)
        assert name != threading.current_thread().name
        assert t.done
        assert t.result is None

    def test_async_function_from_sync_code(self) -> None:
        """An async function submitted from plain code runs on the background loop."""

        async def work() -> str:
            await asyncio.sleep(0.01)
            return "async ok"

        assert envq.submit(work).future.result(PATIENCE) == "async ok"

    def test_retries_and_after_from_sync_code(self) -> None:
        """A task with retries ends with MaxRetriesExceeded on its future, after() called once."""
        calls: list[int] = []
        seen: list[BaseException | None] = []

        def fail() -> None:
            calls.append(1)
            raise ValueError("nope")

        t = envq.enqueue(envq.Task(fail).retries(3).backoff(0.01).no_jitter().after(seen.append))
        with pytest.raises(envq.MaxRetriesExceeded) as info:
            t.future.result(PATIENCE)
        assert isinstance(info.value.__cause__, ValueError)
        assert len(calls) == 3
        assert seen == [info.value]

    def test_shutdown_waits_joins_and_loses_nothing(self) -> None:
        """envq.shutdown() in plain code returns only when every queued task has ended,
        and leaves no envq thread behind."""
        done: list[int] = []

        def slow(n: int) -> None:
            time.sleep(0.05)
            done.append(n)

        tasks = [envq.submit(functools.partial(slow, n)) for n in range(5)]
        assert envq_threads()
        envq.shutdown()
        assert sorted(done) == [0, 1, 2, 3, 4]
        assert all(t.done for t in tasks)
        assert envq_threads() == []

    def test_fresh_queue_after_shutdown(self) -> None:
        """After the global queue shut down, the next submit starts a fresh one."""
        envq.submit(lambda: None).future.result(PATIENCE)
        envq.shutdown()
        assert envq.submit(lambda: 5).future.result(PATIENCE) == 5

    def test_shutdown_returns_an_ignorable_awaitable(self) -> None:
        """In plain code envq.shutdown() has already finished when it returns."""
        envq.submit(lambda: None)
        result = envq.shutdown()
        assert hasattr(result, "__await__")
        assert envq_threads() == []

    def test_already_complete(self) -> None:
        """A task that ended cannot be queued again."""
        t = envq.submit(lambda: None)
        t.future.result(PATIENCE)
        with pytest.raises(envq.AlreadyComplete):
            envq.enqueue(t)


class TestBackgroundQueue:
    def test_many_threads_submit(self) -> None:
        """Eight threads submitting at once: every task runs exactly once."""
        counts: list[int] = []
        lock = threading.Lock()

        def bump() -> None:
            with lock:
                counts.append(1)

        with envq.BackgroundQueue("threads", workers=4) as q:

            def producer() -> None:
                for _ in range(50):
                    q.submit(bump)

            producers = [threading.Thread(target=producer) for _ in range(8)]
            for p in producers:
                p.start()
            for p in producers:
                p.join()
        assert len(counts) == 400

    def test_no_task_lost_to_a_racing_shutdown(self) -> None:
        """Producers racing a shutdown: every task that enqueue accepted has ended by the
        time shutdown() returns; the rest were refused with QueueShuttingDown."""
        q = envq.BackgroundQueue("race", workers=2)
        accepted: list[envq.Task] = []
        refused = threading.Event()
        lock = threading.Lock()

        def producer() -> None:
            while True:
                try:
                    t = q.submit(lambda: time.sleep(0.001))
                except envq.QueueShuttingDown:
                    refused.set()
                    return
                with lock:
                    accepted.append(t)

        producers = [threading.Thread(target=producer) for _ in range(4)]
        for p in producers:
            p.start()
        while len(accepted) < 20:
            time.sleep(0.001)
        q.shutdown()
        for p in producers:
            p.join(PATIENCE)
        assert refused.is_set()
        assert all(t.done for t in accepted)
        assert all(t.future.done() for t in accepted)

    def test_refuses_while_shutting_down(self) -> None:
        """Once shutdown() is called, enqueue raises QueueShuttingDown; queued work finishes."""
        release = threading.Event()
        q = envq.BackgroundQueue("refuse")
        t = q.submit(lambda: release.wait(PATIENCE))
        closer = threading.Thread(target=q.shutdown)
        closer.start()
        deadline = time.monotonic() + PATIENCE
        while not q.shutting_down and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(envq.QueueShuttingDown):
            q.submit(lambda: None)
        release.set()
        closer.join(PATIENCE)
        assert t.future.result(0) is True
        assert q.closed

    def test_shutdown_timeout(self) -> None:
        """shutdown(timeout) raises TimeoutError while tasks still run; a later one completes."""
        release = threading.Event()
        q = envq.BackgroundQueue("timeout")
        t = q.submit(lambda: release.wait(PATIENCE))
        with pytest.raises(TimeoutError):
            q.shutdown(timeout=0.05)
        release.set()
        q.shutdown()
        assert t.done
        assert q.closed
        assert q.thread is not None
        assert not q.thread.is_alive()

    def test_never_started(self) -> None:
        """Shutting down a queue that never got a task starts no thread."""
        q = envq.BackgroundQueue("idle")
        q.shutdown()
        assert q.thread is None
        assert q.closed
        with pytest.raises(envq.QueueShuttingDown):
            q.submit(lambda: None)

    def test_shutdown_from_its_own_task(self) -> None:
        """shutdown() from one of the queue's own tasks raises RuntimeError (it would wait
        for itself)."""
        q = envq.BackgroundQueue("self")
        t = q.submit(q.shutdown)
        with pytest.raises(RuntimeError, match="wait for itself"):
            t.future.result(PATIENCE)
        q.shutdown()

    def test_options_reach_the_queue(self) -> None:
        """workers and limiter are the hosted task queue's."""
        lim = envq.default_limiter()
        q = envq.BackgroundQueue("opts", workers=3, limiter=lim)
        assert q.tasks.queue.workers == 3
        assert q.tasks.queue.limiter is lim
        q.shutdown()

    def test_not_a_task(self) -> None:
        """enqueue() of something that is not a Task raises BadEnvelopeType (a
        TypeError, and a BadEnvelope as before)."""
        with (
            envq.BackgroundQueue("bad") as q,
            pytest.raises(envq.BadEnvelopeType, match="must be a Task"),
        ):
            q.enqueue("task")  # type: ignore[arg-type]

    @pytest.mark.real_clock
    async def test_from_async_code(self) -> None:
        """From a coroutine on another loop: await the task, await envq.shutdown(queue)."""
        q = envq.BackgroundQueue("fromasync")

        async def work() -> asyncio.AbstractEventLoop:
            return asyncio.get_running_loop()

        t = q.submit(work)
        loop = await t
        assert loop is not asyncio.get_running_loop()
        await envq.shutdown(q)
        assert q.closed
        assert envq_threads() == []

    def test_task_queue_on_another_threads_loop(self) -> None:
        """envq.shutdown() in plain code shuts down a TaskQueue whose loop runs elsewhere."""
        started = threading.Event()
        holder: list[envq.TaskQueue] = []
        ran: list[int] = []

        async def host() -> None:
            tq = envq.TaskQueue("hosted")
            holder.append(tq)

            async def slow() -> None:
                await asyncio.sleep(0.05)
                ran.append(1)

            tq.submit(slow)
            started.set()
            await tq.run()

        thread = threading.Thread(target=asyncio.run, args=(host(),))
        thread.start()
        assert started.wait(PATIENCE)
        envq.shutdown(holder[0])
        thread.join(PATIENCE)
        assert ran == [1]
        assert not thread.is_alive()

    def test_task_queue_without_a_loop_is_refused(self) -> None:
        """In plain code, a TaskQueue with no running loop cannot be shut down from here."""
        with pytest.raises(RuntimeError, match="no running event loop"):
            envq.shutdown(envq.TaskQueue("loopless"))


class TestGlobalAsyncReal:
    @pytest.mark.real_clock
    async def test_global_in_async_code_uses_the_loop(self) -> None:
        """From a coroutine the global queue runs on the caller's loop, not a thread."""

        async def where() -> asyncio.AbstractEventLoop:
            return asyncio.get_running_loop()

        assert await envq.submit(where) is asyncio.get_running_loop()
        await envq.shutdown()
        assert _background._background is None


SCRIPT_SHUTDOWN = """
import asyncio, time, envq

async def a():
    await asyncio.sleep(0.05)
    print("async task", flush=True)

def s():
    time.sleep(0.05)
    print("sync task", flush=True)

envq.submit(a)
envq.submit(s)
envq.enqueue(envq.Task(lambda: 1 / 0).retries(2).backoff(0.01)
             .after(lambda e: print("after", type(e).__name__, flush=True)))
envq.shutdown()
print("shut down", flush=True)
"""

SCRIPT_AT_EXIT = """
import time, envq

calls = []

def flaky():
    calls.append(1)
    if len(calls) == 1:
        raise ValueError("first attempt fails")
    time.sleep(0.05)
    print("retried at exit", flush=True)

envq.enqueue(envq.Task(flaky).retries(2).backoff(0.2).no_jitter())
print("main done", flush=True)
"""


def run_script(source: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class TestProcess:
    def test_clean_shutdown_in_a_fresh_interpreter(self, tmp_path: Path) -> None:
        """A script that submits and shuts down exits 0 with every task run and nothing on
        stderr (no "Task was destroyed", no warnings, in asyncio debug mode)."""
        done = run_script(SCRIPT_SHUTDOWN, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        lines = done.stdout.splitlines()
        assert sorted(lines[:3]) == ["after MaxRetriesExceeded", "async task", "sync task"]
        assert lines[3:] == ["shut down"]

    def test_interpreter_exit_waits_for_queued_tasks(self, tmp_path: Path) -> None:
        """A script that never calls shutdown still runs its queued task, a retry in a
        thread included, before the interpreter exits."""
        done = run_script(SCRIPT_AT_EXIT, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        assert done.stdout.splitlines() == ["main done", "retried at exit"]
