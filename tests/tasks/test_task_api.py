"""The task API's edge cases on virtual time: waiting with a timeout, shutting down a
task queue whose engine was terminated, and tasks left queued when a loop ends."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import envq
import envq._background
from envq.testing import run

ROOT = Path(__file__).resolve().parents[2]


class Flaky:
    """An async task function that fails its first ``fails`` calls, then returns ``value``."""

    def __init__(self, fails: int, value: Any = "done") -> None:
        self.fails = fails
        self.value = value
        self.calls = 0

    async def __call__(self) -> Any:
        self.calls += 1
        if self.calls <= self.fails:
            raise ValueError(f"failure {self.calls}")
        return self.value


class TestWaitWithTimeout:
    async def test_wait_for_timing_out_leaves_the_task_and_its_future_alone(self) -> None:
        """A wait that times out ends the wait only: the task goes on, succeeds, and
        its future and ``await task`` give the result."""
        q = envq.TaskQueue()
        q.start()
        fn = Flaky(fails=1, value=42)
        task = q.enqueue(envq.Task(fn).retries(3).no_jitter().backoff(10))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 1)
        assert not task.future.cancelled()
        assert await task == 42
        assert task.future.result() == 42
        assert fn.calls == 2
        await q.shutdown()

    async def test_cancelling_an_awaiting_coroutine_does_not_cancel_the_task(self) -> None:
        """A coroutine awaiting a task, cancelled, leaves the task running to its end."""
        q = envq.TaskQueue()
        q.start()
        task = q.enqueue(envq.Task(Flaky(fails=1, value="ok")).retries(2).no_jitter())
        waiter = asyncio.ensure_future(task)
        await asyncio.sleep(0.5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await task == "ok"
        await q.shutdown()

    async def test_future_cancel_is_refused(self) -> None:
        """``task.future.cancel()`` returns False and changes nothing, queued or not."""
        q = envq.TaskQueue()
        task = envq.Task(Flaky(fails=0, value=7))
        assert task.future.cancel() is False
        q.enqueue(task)
        assert task.future.cancel() is False
        assert not task.future.cancelled()
        await q.shutdown()
        assert task.future.result() == 7


class TestShutdownAfterTerminate:
    async def test_tasks_held_while_stopped_end_when_the_engine_is_terminated(self) -> None:
        """Tasks queued while the engine is stopped are held; a terminate of the
        engine ends them with QueueTerminated (their after callbacks run)."""
        q = envq.TaskQueue()
        q.start()
        await q.queue.stop()
        reported: list[BaseException | None] = []
        task = q.enqueue(envq.Task(Flaky(fails=0)).after(reported.append))
        await q.queue.terminate()
        await asyncio.sleep(0)
        assert task.done
        await q.shutdown()
        assert task.done
        assert isinstance(task.result, envq.QueueTerminated)
        assert reported == [task.result]

    async def test_shutdown_after_the_engine_was_terminated(self) -> None:
        """``shutdown()`` of a task queue whose engine the user terminated returns:
        the tasks the terminate handed back end with an error, none is left pending."""
        q = envq.TaskQueue()
        q.start()
        done = q.enqueue(envq.Task(Flaky(fails=0, value=1)))
        await q.dispatch()
        reported: list[BaseException | None] = []
        later = q.enqueue(envq.Task(Flaky(fails=0)).not_before(_in(3600)).after(reported.append))
        await q.queue.terminate()
        await q.shutdown()
        assert len(reported) == 1
        assert isinstance(reported[0], envq.QueueTerminated)
        assert q.closed
        assert done.future.result() == 1
        assert later.done
        with pytest.raises(envq.EnvqError, match="terminated"):
            later.future.result()
        with pytest.raises(envq.QueueShuttingDown):
            q.submit(Flaky(fails=0))

    async def test_shutdown_of_a_never_started_queue_whose_engine_was_terminated(self) -> None:
        """A task queue never started, its engine terminated: shutdown() returns."""
        q = envq.TaskQueue()
        await q.queue.terminate()
        await q.shutdown()
        assert q.closed


def _in(seconds: float) -> Any:
    import datetime as dt  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    wall = loop.wall_time()  # type: ignore[attr-defined]
    return dt.datetime.fromtimestamp(wall + seconds, tz=dt.UTC)


class TestLoopEndsWithTasksQueued:
    """``envq.submit()`` from a coroutine queues on a task queue of the running loop;
    when that loop ends before ``await envq.shutdown()``, nothing queued is lost."""

    def test_tasks_run_to_their_end_before_the_loop_closes(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """asyncio.run() (here envq.testing.run, an asyncio.Runner) returning without
        a shutdown runs the queued tasks (retries, after callbacks) before it closes
        the loop, like a BackgroundQueue at interpreter exit; it says so at INFO."""
        reported: list[BaseException | None] = []

        async def slow() -> str:
            await asyncio.sleep(30)
            return "slow"

        async def main() -> list[envq.Task]:
            return [
                envq.submit(slow),
                envq.submit(lambda: "plain"),
                envq.enqueue(
                    envq.Task(Flaky(fails=2, value="flaky"))
                    .retries(3)
                    .no_jitter()
                    .after(reported.append)
                ),
            ]

        with caplog.at_level(logging.INFO, logger="envq"):
            tasks = run(main())
        assert [t.done for t in tasks] == [True, True, True]
        assert [t.future.result(timeout=0) for t in tasks] == ["slow", "plain", "flaky"]
        assert reported == [None]
        assert any("still queued" in r.getMessage() for r in caplog.records)
        envq.shutdown()  # nothing left; returns at once

    def test_a_waiter_in_another_thread_is_woken(self) -> None:
        """A thread blocked on a task's future gets the result when the loop ends."""
        got: list[Any] = []

        async def main() -> envq.Task:
            task = envq.submit(Flaky(fails=0, value=9))
            waiter = threading.Thread(target=lambda: got.append(task.future.result()))
            waiter.start()
            waiters.append(waiter)
            return task

        waiters: list[threading.Thread] = []
        run(main())
        waiters[0].join(30)  # real seconds, a generous margin: it is woken at once
        assert got == [9]

    def test_submit_after_the_loop_ended_uses_a_fresh_queue(self) -> None:
        """Each loop gets its own global task queue; one that ended leaves nothing behind."""

        async def main() -> Any:
            return await envq.submit(Flaky(fails=0, value="again"))

        assert run(main()) == "again"
        assert run(main()) == "again"
        assert not envq._background._per_loop
        assert not envq._background._LOOP_END

    def test_an_explicit_shutdown_still_works(self) -> None:
        """``await envq.shutdown()`` before the loop ends: the hook finds nothing to do."""

        async def main() -> envq.Task:
            task = envq.submit(Flaky(fails=0, value=1))
            await envq.shutdown()
            return task

        assert run(main()).future.result(timeout=0) == 1
        assert not envq._background._LOOP_END

    def test_a_loop_closed_without_finishing_fails_its_tasks_loudly(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A loop closed by hand without ``shutdown_asyncgens()`` cannot run the tasks:
        the next plain ``envq.shutdown()`` ends them with an EnvqError, calls their
        after callbacks, wakes their waiters and logs them at ERROR."""
        reported: list[BaseException | None] = []

        async def slow() -> None:
            await asyncio.sleep(3600)

        async def main() -> envq.Task:
            return envq.enqueue(envq.Task(slow).after(reported.append))

        loop = asyncio.new_event_loop()
        try:
            task = loop.run_until_complete(main())
        finally:
            loop.close()
        assert not task.done
        with caplog.at_level(logging.ERROR, logger="envq"):
            envq.shutdown()
        assert task.done
        with pytest.raises(envq.EnvqError, match="event loop"):
            task.future.result(timeout=0)
        assert len(reported) == 1
        assert isinstance(reported[0], envq.EnvqError)
        assert any("never ran to their end" in r.getMessage() for r in caplog.records)
        assert not envq._background._per_loop


class TestLoopEndsInAFreshInterpreter:
    """Real ``asyncio.run()`` and a real interpreter exit, in a child process (a smoke
    test on the real clock: the work takes milliseconds, the limit is a minute)."""

    @staticmethod
    def run_python(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )

    def test_asyncio_run_returns_after_running_the_queued_tasks(self) -> None:
        """``asyncio.run(main())`` where ``main`` only submits: the tasks have run."""
        done = self.run_python(
            """
            import asyncio
            import envq

            async def double(n):
                await asyncio.sleep(0.01)
                return 2 * n

            async def main():
                return [envq.submit(double, n) for n in range(3)]

            tasks = asyncio.run(main())
            print([t.future.result(timeout=0) for t in tasks])
            """
        )
        assert (done.returncode, done.stdout) == (0, "[0, 2, 4]\n"), done.stderr

    def test_a_loop_closed_by_hand_is_reported_at_exit(self) -> None:
        """A loop closed without ``shutdown_asyncgens()``: at interpreter exit its
        tasks end with an EnvqError (after callbacks run) and an ERROR is logged."""
        done = self.run_python(
            """
            import asyncio
            import envq

            async def slow():
                await asyncio.sleep(3600)

            async def main():
                task = envq.Task(slow).after(lambda e: print("after:", type(e).__name__))
                envq.enqueue(task)

            loop = asyncio.new_event_loop()
            loop.run_until_complete(main())
            loop.close()
            print("exiting")
            """
        )
        assert (done.returncode, done.stdout) == (0, "exiting\nafter: EnvqError\n"), done.stderr
        assert "never ran to their end" in done.stderr


class TestFinisherCancelled:
    """A task's ``after`` callbacks and future are handled by a finisher task on the
    loop; a loop's teardown may cancel it (``asyncio.run()`` cancels every task)."""

    @staticmethod
    async def ended_with_callbacks(
        *blocks: bool,
    ) -> tuple[envq.TaskQueue, envq.Task[Any], list[str]]:
        """A task that has ended, its finisher in the first of its after callbacks
        (``blocks[i]``: callback ``b<i+1>`` never returns)."""
        ran: list[str] = []

        def blocker(name: str, block: bool) -> Any:
            async def callback(error: BaseException | None) -> None:
                ran.append(name)
                if block:
                    await asyncio.Event().wait()  # never returns

            callback.__qualname__ = name
            return callback

        q = envq.TaskQueue()
        q.start()
        task = envq.Task(Flaky(fails=0, value="v"))
        for i, block in enumerate(blocks):
            task.after(blocker(f"b{i + 1}", block))
        q.enqueue(task)
        await asyncio.sleep(1)
        return q, task, ran

    @staticmethod
    async def cancel_finisher(q: envq.TaskQueue) -> None:
        (finisher,) = q._finishing
        finisher.cancel()
        await asyncio.sleep(1)

    async def test_a_cancelled_finisher_starts_again_once(self) -> None:
        """Cancelled once, the finisher goes on with the next callback; the future
        gets the result when the callbacks are done."""
        q, task, ran = await self.ended_with_callbacks(True, False)
        assert ran == ["b1"]
        assert not task.future.done()
        await self.cancel_finisher(q)
        assert ran == ["b1", "b2"]
        assert task.future.result(timeout=0) == "v"
        assert not q._finishing
        await q.shutdown()

    async def test_a_second_cancel_resolves_the_future_and_logs_what_was_skipped(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Cancelled twice, the finisher gives up: the future is resolved all the same
        and the callbacks that never started are logged."""
        q, task, ran = await self.ended_with_callbacks(True, True, True)
        await self.cancel_finisher(q)
        with caplog.at_level(logging.WARNING, logger="envq"):
            await self.cancel_finisher(q)
        assert ran == ["b1", "b2"]
        assert task.future.result(timeout=0) == "v"
        assert not q._finishing
        assert any("b3" in r.getMessage() for r in caplog.records)
        await q.shutdown()
