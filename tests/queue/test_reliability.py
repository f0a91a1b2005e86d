"""Reliability in every hand: cancellation, BaseExceptions, threads, interpreter
versions, failures a user can see (issue "Reliable in every hand").

Each test pins one way envq used to break when driven through its public API only.
Time-dependent behaviour runs on the virtual clock; the few thread and process tests
run on the real clock with generous margins.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

import envq
from envq import EnvState as ES
from envq import QueueState as QS
from envq.testing import run
from tests.support import Recorder, noop, now, settle, sleeper

#: Real seconds to wait for anything that should happen "soon".
PATIENCE = 20.0


def accounted(q: envq.Queue, envs: list[envq.Envelope], rec: Recorder) -> None:
    """Every envelope is live in ``q`` or has ended in a terminal state it announced,
    and ``capacity_used`` counts exactly the live ones."""
    live = [env for env in envs if q.state_of(env) is not None]
    assert q.capacity_used == len(live)
    for env in envs:
        if q.state_of(env) is None:
            final = rec.final(env)
            assert final is not None, f"{env!r} is neither in the queue nor ended"


# --------------------------------------------------------------------------------------
# Current Pythons
# --------------------------------------------------------------------------------------


FIRE_AND_FORGET = """
import envq
def fn():
    pass
envq.submit(fn)
print("end")
"""


class TestFireAndForgetExits:
    @pytest.mark.parametrize("attempt", range(5))
    def test_three_line_script_exits(self, tmp_path: Path, attempt: int) -> None:
        """``envq.submit(fn)`` in a plain script exits promptly on this interpreter (it
        spun forever at exit on CPython 3.12 and 3.13: the exit path awaited a gather of
        finished tasks, which completes there without yielding, in a loop)."""
        path = tmp_path / "fire.py"
        path.write_text(FIRE_AND_FORGET)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            timeout=PATIENCE,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "end\n"
        assert done.stderr == ""
        assert time.monotonic() - started < PATIENCE


# --------------------------------------------------------------------------------------
# Cancellation and ownership
# --------------------------------------------------------------------------------------


class TestOwnedQueueCancelled:
    async def test_second_cancel_during_exit_still_terminates(self) -> None:
        """A task owning a queue with ``async with`` is cancelled while an attempt runs,
        then cancelled again during the exit's graceful stop: the block still ends with
        the queue TERMINATED and every envelope accounted for (the attempt cancelled and
        handed back), and the cancellation propagates."""
        q = envq.Queue("owned", workers=1)
        rec = Recorder(q)
        long = envq.Envelope(invoke=sleeper(100), id="long")
        ready = envq.Envelope(invoke=sleeper(1), id="ready")
        later = envq.Envelope(invoke=noop, id="later", delay=50)

        async def owner() -> None:
            async with q:
                q.send(long, ready, later)
                await asyncio.sleep(1000)

        task = asyncio.ensure_future(owner())
        await asyncio.sleep(5)
        task.cancel()  # the body is left by a cancellation: terminate at once
        await settle()
        task.cancel()  # and once more, while the exit waits
        with pytest.raises(asyncio.CancelledError):
            await task
        assert q.state is QS.TERMINATED
        assert set(q.leftovers) == {long, ready, later}
        assert rec.final(long) is not None
        assert rec.final(long).to_state is ES.RETURNED  # type: ignore[union-attr]
        assert now() == 5.0
        accounted(q, [long, ready, later], rec)

    async def test_cancel_during_graceful_stop_escalates(self) -> None:
        """Leaving the block normally starts a graceful stop (DRAIN); a cancel of the
        owner during that stop escalates to terminate: the in-flight attempt is
        cancelled and handed back instead of being waited for."""
        q = envq.Queue("owned", workers=1)
        rec = Recorder(q)
        long = envq.Envelope(invoke=sleeper(100), id="long")

        async def owner() -> None:
            async with q:
                q.send(long)
                await asyncio.sleep(1)

        task = asyncio.ensure_future(owner())
        await asyncio.sleep(10)
        assert q.state is QS.STOPPING  # waiting for the attempt, gracefully
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert now() == 10.0
        assert q.state is QS.TERMINATED
        assert q.leftovers == [long]
        accounted(q, [long], rec)

    async def test_normal_exit_is_graceful(self) -> None:
        """Without cancellation the exit drains: the attempt runs to its end."""
        q = envq.Queue("owned")
        rec = Recorder(q)
        a = envq.Envelope(invoke=sleeper(3), id="a")
        async with q:
            q.send(a)
        assert now() == 3.0
        assert rec.final(a).to_state is ES.SUCCEEDED  # type: ignore[union-attr]
        assert q.leftovers == []


class TestTerminateCancelled:
    async def test_caller_cancelled_part_way(self) -> None:
        """``terminate()`` under a ``wait_for`` that times out while an attempt ignores
        its cancel for a while: the termination goes on, the queue ends TERMINATED and
        what it handed back is in ``leftovers``; nothing is lost or counted twice."""
        q = envq.Queue("t", workers=1)
        rec = Recorder(q)

        async def stubborn(env: envq.Envelope) -> None:
            try:
                await asyncio.sleep(100)
            except asyncio.CancelledError:
                await asyncio.sleep(5)  # takes its time to wind down
                raise

        a = envq.Envelope(invoke=stubborn, id="a")
        b = envq.Envelope(invoke=noop, id="b")
        q.start()
        q.send(a, b)
        await asyncio.sleep(1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(q.terminate(), 2)
        assert q.state is QS.STOPPING
        await asyncio.sleep(10)
        assert q.state is QS.TERMINATED
        assert q.leftovers == [a, b]
        assert [e.to_state for e in rec.of(a)][-1] is ES.RETURNED
        assert sum(1 for e in rec.events if e.to_state is ES.RETURNED) == 2
        accounted(q, [a, b], rec)
        assert await q.terminate() == []

    async def test_concurrent_terminates_share_one_end(self) -> None:
        """Two ``terminate()`` calls at once: one termination; the first caller gets
        the envelopes, the second ``[]``; each envelope is handed back once."""
        q = envq.Queue("t", workers=1)
        rec = Recorder(q)
        a = envq.Envelope(invoke=sleeper(100), id="a")
        b = envq.Envelope(invoke=noop, id="b", delay=30)
        q.start()
        q.send(a, b)
        await asyncio.sleep(1)
        first, second = await asyncio.gather(q.terminate(), q.terminate())
        assert first == [a, b]
        assert second == []
        assert q.leftovers == [a, b]
        assert sum(1 for e in rec.events if e.to_state is ES.RETURNED) == 2


class TestSendWaitCancelled:
    async def test_cancel_in_the_iteration_of_admission_admits_nothing(self) -> None:
        """A producer woken for room and cancelled before it runs again has admitted
        nothing (cancelled means not sent); the next producer gets the room instead."""
        q = envq.Queue("sw", capacity=1)
        rec = Recorder(q)
        q.start()
        a = envq.Envelope(invoke=sleeper(1), id="a")
        b = envq.Envelope(invoke=noop, id="b")
        c = envq.Envelope(invoke=noop, id="c")
        q.send(a)
        pb = asyncio.ensure_future(q.send_wait(b))
        pc = asyncio.ensure_future(q.send_wait(c))
        await settle()

        def cancel_b_when_a_ends(event: envq.Event) -> None:
            if event.envelope is a and event.to_state is ES.SUCCEEDED:
                pb.cancel()

        q.subscribe(cancel_b_when_a_ends)
        with pytest.raises(asyncio.CancelledError):
            await pb
        await pc
        assert q.state_of(b) is None
        assert rec.of(b) == []
        assert q.state_of(c) is not None or rec.final(c) is not None
        await asyncio.sleep(1)
        assert rec.final(c).to_state is ES.SUCCEEDED  # type: ignore[union-attr]
        assert q.capacity_used == 0
        await q.terminate()


class TestLoopClosing:
    def test_loop_closed_under_a_running_queue(self) -> None:
        """``asyncio.run`` (here the virtual-time runner) returns while the queue runs,
        with one attempt in flight, one ready and one delayed envelope: the loop's
        shutdown cancels the workers; the queue stops with everything parked, its
        counts consistent, and ``terminate()`` later hands everything back."""
        q = envq.Queue("closing", workers=1, capacity=10)
        envs = [
            envq.Envelope(invoke=sleeper(100), id="running"),
            envq.Envelope(invoke=noop, id="ready"),
            envq.Envelope(invoke=noop, id="delayed", delay=60),
            envq.Envelope(invoke=noop, id="periodic", interval=30),
        ]
        events: list[envq.Event] = []

        async def main() -> None:
            q.subscribe(events.append)
            q.start()
            q.send(*envs)
            await asyncio.sleep(45)

        run(main())
        assert q.state is QS.STOPPED
        assert {env.id: q.state_of(env) for env in envs} == dict.fromkeys(
            ["running", "ready", "delayed", "periodic"], ES.PARKED
        )
        stats = q.statistics()
        assert stats.capacity_used == 4
        assert stats.in_flight == 0
        assert stats.by_state[ES.RUNNING] == 0
        cancelled = [e for e in events if e.outcome is envq.Outcome.CANCELLED]
        assert [e.envelope.id for e in cancelled] == ["running"]  # type: ignore[union-attr]
        assert run(q.terminate()) == envs
        assert q.state is QS.TERMINATED
        assert q.capacity_used == 0

    def test_loop_closed_during_a_drain(self) -> None:
        """The loop closes while a DRAIN stop waits for ready work: the stop becomes a
        cancelling STOP, and nothing is left READY or RUNNING."""
        q = envq.Queue("closing", workers=1)
        a = envq.Envelope(invoke=sleeper(100), id="a")
        b = envq.Envelope(invoke=noop, id="b")

        async def main() -> None:
            q.start()
            q.send(a, b)
            await asyncio.sleep(1)
            await q.stop(wait=False)
            await asyncio.sleep(1)

        run(main())
        assert q.state is QS.STOPPED
        assert q.state_of(a) is ES.PARKED
        assert q.state_of(b) is ES.PARKED
        assert run(q.terminate()) == [a, b]


# --------------------------------------------------------------------------------------
# BaseExceptions and limiters
# --------------------------------------------------------------------------------------


class Custom(BaseException):
    """A BaseException that is not an Exception."""


BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, Custom]


def raiser(exc: type[BaseException]) -> Callable[..., Any]:
    async def fn(*args: Any) -> None:
        raise exc("from user code")

    return fn


class TestBaseExceptions:
    @pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
    async def test_invoke(self, exc: type[BaseException]) -> None:
        """An invoke raising a BaseException fails its attempt (ERROR, FAILED); the
        worker lives on and runs the next envelope."""
        q = envq.Queue("b", log_unhandled=False)
        rec = Recorder(q)
        q.start()
        bad = envq.Envelope(invoke=raiser(exc), id="bad")
        good = envq.Envelope(invoke=noop, id="good")
        q.send(bad, good)
        end = await rec.ended(good)
        assert end.to_state is ES.SUCCEEDED
        final = rec.final(bad)
        assert final is not None
        assert (final.outcome, final.to_state) == (envq.Outcome.ERROR, ES.FAILED)
        assert type(final.cause) is exc
        await q.terminate()

    @pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
    def test_plain_invoke_in_a_thread(self, exc: type[BaseException]) -> None:
        """The same from a plain (threaded) invoke."""

        def boom(env: envq.Envelope) -> None:
            raise exc("in a thread")

        async def main() -> list[ES]:
            q = envq.Queue("b", log_unhandled=False)
            rec = Recorder(q)
            q.start()
            bad, good = envq.Envelope(invoke=boom), envq.Envelope(invoke=noop)
            q.send(bad, good)
            await rec.ended(good)
            await q.terminate()
            return [rec.final(bad).to_state, rec.final(good).to_state]  # type: ignore[union-attr]

        assert run(main()) == [ES.FAILED, ES.SUCCEEDED]

    @pytest.mark.parametrize("hook", ["before", "after", "on_success", "on_failure"])
    @pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
    async def test_hooks(self, hook: str, exc: type[BaseException]) -> None:
        """A hook raising a BaseException never leaves the envelope RUNNING: before →
        ERROR; after and on_success are logged and ignored; on_failure counts as drop."""
        q = envq.Queue("b", log_unhandled=False)
        rec = Recorder(q)
        q.start()
        fields: dict[str, Any] = {hook: raiser(exc)}
        if hook == "on_failure":
            fields["invoke"] = raiser(ValueError)
        else:
            fields["invoke"] = noop
        env = envq.Envelope(**fields)
        after = envq.Envelope(invoke=noop)
        q.send(env, after)
        await rec.ended(after)
        final = await rec.ended(env)
        expected = {
            "before": ES.FAILED,
            "after": ES.SUCCEEDED,
            "on_success": ES.SUCCEEDED,
            "on_failure": ES.FAILED,
        }
        assert final.to_state is expected[hook]
        assert q.statistics().in_flight == 0
        await q.terminate()

    @pytest.mark.parametrize("exc", BASE_EXCEPTIONS)
    async def test_listener(
        self, exc: type[BaseException], caplog: pytest.LogCaptureFixture
    ) -> None:
        """A listener raising a BaseException is logged; the queue carries on."""
        q = envq.Queue("b")
        rec = Recorder(q)

        def bad(event: envq.Event) -> None:
            raise exc("listener")

        q.subscribe(bad)
        q.start()
        a = envq.Envelope(invoke=noop)
        with caplog.at_level(logging.ERROR, logger="envq"):
            q.send(a)
            assert (await rec.ended(a)).to_state is ES.SUCCEEDED
        assert "listener" in caplog.text
        await q.terminate()

    @pytest.mark.parametrize("exc", [*BASE_EXCEPTIONS, ValueError])
    async def test_async_dead_letter(self, exc: type[BaseException]) -> None:
        """An ``async def`` dead_letter raising is logged; it never escapes the loop."""
        q = envq.Queue("b", dead_letter=raiser(exc))
        rec = Recorder(q)
        q.start()
        a = envq.Envelope(invoke=raiser(ValueError))
        q.send(a)
        await rec.ended(a)
        await asyncio.sleep(1)
        assert q.state is QS.RUNNING
        await q.terminate()


class Broken:
    """A limiter whose methods raise (or answer nonsense)."""

    def __init__(self, exc: BaseException | None = None, answer: Any = 0.0) -> None:
        self.exc = exc
        self.answer = answer
        self.calls = 0

    def when(self, env: object) -> float:
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return self.answer  # type: ignore[no-any-return]

    def forget(self, env: object) -> None:
        if self.exc is not None:
            raise self.exc

    def retries(self, env: object) -> int:
        return 0


class TestBrokenLimiters:
    @pytest.mark.parametrize("exc", [ValueError("x"), KeyboardInterrupt(), Custom()])
    async def test_rate_that_raises(
        self, exc: BaseException, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A ``rate=`` limiter that raises is logged and means no wait: every envelope
        still runs, on every worker."""
        q = envq.Queue("r", workers=3, rate=Broken(exc))
        rec = Recorder(q)
        q.start()
        envs = [envq.Envelope(invoke=sleeper(1)) for _ in range(6)]
        with caplog.at_level(logging.ERROR, logger="envq"):
            q.send(*envs)
            for env in envs:
                assert (await rec.ended(env)).to_state is ES.SUCCEEDED
        assert now() == 2.0
        assert "rate limiter" in caplog.text
        await q.terminate()

    @pytest.mark.parametrize("answer", [float("nan"), -1.0, float("inf"), "3", None])
    async def test_rate_answering_nonsense(self, answer: Any) -> None:
        """A rate limiter answering something other than seconds ≥ 0 means no wait."""
        q = envq.Queue("r", rate=Broken(answer=answer))
        rec = Recorder(q)
        q.start()
        a = envq.Envelope(invoke=noop)
        q.send(a)
        assert (await rec.ended(a)).to_state is ES.SUCCEEDED
        await q.terminate()

    @pytest.mark.parametrize("exc", [ValueError("x"), SystemExit(3), Custom()])
    async def test_failure_limiter_that_raises(self, exc: BaseException) -> None:
        """A ``limiter=`` whose when/forget raise: retries go ahead with the decided
        delay, and terminate() hands back everything (it used to stop half-way)."""
        q = envq.Queue("l", limiter=Broken(exc), log_unhandled=False)
        rec = Recorder(q)
        q.start()
        retried = envq.Envelope(
            invoke=raiser(ValueError), retry=envq.Retry(attempts=3, base=2, jitter=False)
        )
        ok = envq.Envelope(invoke=noop)
        parked = [envq.Envelope(invoke=noop, delay=100) for _ in range(3)]
        q.send(retried, ok, *parked)
        assert (await rec.ended(retried)).to_state is ES.FAILED
        assert now() == 6.0  # 2 + 4: the decided backoff, the limiter ignored
        assert (await rec.ended(ok)).to_state is ES.SUCCEEDED
        assert await q.terminate() == parked
        assert q.capacity_used == 0


# --------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------


class TestOtherThreads:
    @pytest.mark.real_clock
    async def test_send_from_another_thread_runs_promptly(self) -> None:
        """``send()`` from another thread is handed to the loop and wakes it: the
        envelope runs at once, not when some unrelated timer fires."""
        q = envq.Queue("threads")
        q.start()
        ran = asyncio.Event()

        async def invoke(env: envq.Envelope) -> None:
            ran.set()

        # The only timer is the wait_for's, PATIENCE away: nothing else wakes the loop.
        await asyncio.sleep(0.05)
        started = time.monotonic()

        def later() -> None:
            time.sleep(0.2)  # the loop is asleep in its selector by then
            q.send(envq.Envelope(invoke=invoke))

        sender = threading.Thread(target=later)
        sender.start()
        await asyncio.wait_for(ran.wait(), PATIENCE)
        assert time.monotonic() - started < 2.0
        sender.join()
        await q.terminate()

    @pytest.mark.real_clock
    async def test_send_from_another_thread_raises_there(self) -> None:
        """Errors of a handed-over ``send()`` are raised in the calling thread."""
        q = envq.Queue("threads", capacity=1)
        q.start()
        q.send(envq.Envelope(invoke=sleeper(0.5)))
        with pytest.raises(envq.CapacityExceeded):
            await asyncio.to_thread(q.send, envq.Envelope(invoke=noop))
        await q.terminate()
        with pytest.raises(envq.QueueTerminated):
            await asyncio.to_thread(q.send, envq.Envelope(invoke=noop))

    @pytest.mark.real_clock
    async def test_many_threads_send_and_read_statistics(self) -> None:
        """Eight threads sending 200 envelopes each while reading ``statistics()``: every
        envelope runs once, no error, and the counts add up."""
        q = envq.Queue("threads", workers=4)
        q.start()
        done: list[int] = []
        errors: list[BaseException] = []
        all_done = asyncio.Event()

        async def invoke(env: envq.Envelope) -> None:
            done.append(env.id)  # type: ignore[arg-type]
            if len(done) == 1600:
                all_done.set()

        def producer(base: int) -> None:
            try:
                for i in range(200):
                    q.send(envq.Envelope(invoke=invoke, id=base + i))
                    stats = q.statistics()
                    assert stats.capacity_used >= 0
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(n * 1000,)) for n in range(8)]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        assert errors == []
        await asyncio.wait_for(all_done.wait(), PATIENCE)
        assert sorted(done) == sorted(n * 1000 + i for n in range(8) for i in range(200))
        stats = q.statistics()
        assert stats.by_state[ES.SUCCEEDED] == 1600
        assert stats.capacity_used == 0
        await q.terminate()

    @pytest.mark.real_clock
    async def test_start_and_subscribe_from_another_thread(self) -> None:
        """``start()``, ``subscribe()`` and its unsubscribe work from any thread once the
        queue's loop runs."""
        q = envq.Queue("threads")
        q.start()
        await q.stop()
        seen: list[envq.Event] = []
        unsubscribe = await asyncio.to_thread(q.subscribe, seen.append)
        await asyncio.to_thread(q.start)
        assert q.state is QS.RUNNING
        await asyncio.to_thread(unsubscribe)
        q.send(envq.Envelope(invoke=noop))
        await asyncio.sleep(0.05)
        assert [e.to_state for e in seen] == [QS.RUNNING]
        await q.terminate()

    def test_coroutine_methods_on_another_loop_raise(self) -> None:
        """The coroutine methods awaited on a loop other than the queue's raise a
        RuntimeError that names ``run_coroutine_threadsafe``."""
        q = envq.Queue("threads")
        ready = threading.Event()
        release = threading.Event()
        holder: list[asyncio.AbstractEventLoop] = []

        async def host() -> None:
            q.start()
            holder.append(asyncio.get_running_loop())
            ready.set()
            await asyncio.to_thread(release.wait)
            await q.terminate()

        thread = threading.Thread(target=lambda: asyncio.run(host()))
        thread.start()
        try:
            assert ready.wait(PATIENCE)
            calls: list[Callable[[], Any]] = [
                q.stop,
                q.terminate,
                q.wait_stopped,
                lambda: q.send_wait(envq.Envelope(invoke=noop)),
                q.run_until_empty,
            ]
            for call in calls:
                with pytest.raises(RuntimeError, match="run_coroutine_threadsafe"):
                    asyncio.run(call())
            fut = asyncio.run_coroutine_threadsafe(q.stop(), holder[0])
            assert fut.result(PATIENCE).complete
        finally:
            release.set()
            thread.join(PATIENCE)
        assert q.state is QS.TERMINATED


class TestStuckThreads:
    def test_timed_out_plain_invoke_counts_until_its_thread_returns(self) -> None:
        """A plain invoke that overruns its deadline counts as a stuck thread until its
        thread returns, then not; the queue keeps nothing of it (no leak)."""
        release = threading.Event()
        entered = threading.Event()

        def blocked(env: envq.Envelope) -> None:
            entered.set()
            release.wait(PATIENCE)

        env = envq.Envelope(invoke=blocked, deadline=1)
        ref = weakref.ref(env)

        async def main(env: envq.Envelope) -> tuple[int, int]:
            q = envq.Queue("stuck", log_unhandled=False)
            rec = Recorder(q)
            q.start()
            q.send(env)
            await rec.ended(env)
            stuck_then = q.statistics().stuck_threads
            release.set()
            for _ in range(200):
                if q.statistics().stuck_threads == 0:
                    break
                await asyncio.to_thread(time.sleep, 0.01)
            stuck_after = q.statistics().stuck_threads
            await q.terminate()
            return stuck_then, stuck_after

        stuck_then, stuck_after = run(main(env))
        assert (stuck_then, stuck_after) == (1, 0)
        del env
        gc.collect()
        assert ref() is None


FORK = """
import os, signal, sys, time, envq
q = envq.BackgroundQueue("forked")
print("parent", q.submit(lambda: 1).future.result(10), flush=True)
pid = os.fork()
if pid == 0:
    try:
        q.submit(lambda: 2)
    except RuntimeError as exc:
        print("child refused:", "forked child" in str(exc), flush=True)
    t = envq.submit(lambda: 3)  # the global queue starts afresh in the child
    print("child global", t.future.result(10), flush=True)
    q.shutdown(timeout=5)
    envq.shutdown()
    os._exit(0)
for _ in range(400):  # a child that hangs is killed, never left behind
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.05)
else:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child hung", flush=True)
print("parent again", q.submit(lambda: 4).future.result(10), flush=True)
q.shutdown()
"""


class TestFork:
    @pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
    def test_forked_child_refuses_and_global_restarts(self, tmp_path: Path) -> None:
        """After ``os.fork()`` the child's copy of a started BackgroundQueue refuses
        tasks with a clear RuntimeError, the global queue starts afresh in the child,
        the child exits promptly, and the parent's queue carries on."""
        path = tmp_path / "fork.py"
        path.write_text(FORK)
        done = subprocess.run(
            [sys.executable, "-W", "ignore::DeprecationWarning", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "parent 1",
            "child refused: True",
            "child global 3",
            "child exit 0",
            "parent again 4",
        ]


# --------------------------------------------------------------------------------------
# Sync callables that return awaitables
# --------------------------------------------------------------------------------------


class TestPlainCallableReturningAwaitable:
    async def test_plain_invoke_returning_a_coroutine_is_awaited(self) -> None:
        """``invoke=lambda env: work(env)`` for an ``async def work``: the coroutine is
        awaited (its failure is the attempt's), never dropped with "never awaited"."""
        seen: list[str] = []

        async def work(env: envq.Envelope) -> None:
            seen.append("ran")
            if env.payload == "fail":
                raise ValueError("inner")

        q = envq.Queue("aw", log_unhandled=False)
        rec = Recorder(q)
        q.start()
        # Plain lambdas that return a coroutine: that is the point here.
        ok = envq.Envelope(invoke=lambda env: work(env))  # noqa: PLW0108
        bad = envq.Envelope(invoke=lambda env: work(env), payload="fail")  # noqa: PLW0108
        q.send(ok, bad)
        assert (await rec.ended(ok)).to_state is ES.SUCCEEDED
        end = await rec.ended(bad)
        assert end.to_state is ES.FAILED
        assert str(end.cause) == "inner"
        assert seen == ["ran", "ran"]
        await q.terminate()


# --------------------------------------------------------------------------------------
# Failures a user can see
# --------------------------------------------------------------------------------------


def unhandled(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "envq" and r.levelno == logging.WARNING and "nothing" in r.getMessage()
    ]


class TestUnhandledFailures:
    async def test_logged_once_with_traceback(self, caplog: pytest.LogCaptureFixture) -> None:
        """An envelope that fails with nothing to handle it is logged once at WARNING
        with its error's traceback; its retries are not logged, only the end."""
        q = envq.Queue("u")
        q.start()
        a = envq.Envelope(
            invoke=raiser(ValueError), id="a", retry=envq.Retry(attempts=3, jitter=False)
        )
        with caplog.at_level(logging.WARNING, logger="envq"):
            q.send(a)
            await asyncio.sleep(100)
        [record] = unhandled(caplog)
        assert "-/'a'" in record.getMessage()
        assert record.exc_info is not None
        assert isinstance(record.exc_info[1], envq.MaxRetriesExceeded)
        assert isinstance(record.exc_info[1].__cause__, ValueError)
        await q.terminate()

    @pytest.mark.parametrize("handler", ["on_failure", "dead_letter", "listener", "off"])
    async def test_handled_is_not_logged(
        self, handler: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """on_failure, dead_letter, a subscribed listener or ``log_unhandled=False``
        each silence it."""
        options: dict[str, Any] = {}
        fields: dict[str, Any] = {"invoke": raiser(ValueError)}
        if handler == "on_failure":
            fields["on_failure"] = lambda env, exc, n: None
        elif handler == "dead_letter":
            options["dead_letter"] = lambda env, exc: None
        elif handler == "off":
            options["log_unhandled"] = False
        q = envq.Queue("u", **options)
        if handler == "listener":
            q.subscribe(lambda event: None)
        q.start()
        with caplog.at_level(logging.WARNING, logger="envq"):
            q.send(envq.Envelope(**fields))
            await asyncio.sleep(10)
        assert unhandled(caplog) == []
        await q.terminate()

    async def test_metrics_do_not_count_as_handling(self, caplog: pytest.LogCaptureFixture) -> None:
        """envq's own listeners (Prometheus metrics) do not silence it."""

        q = envq.Queue("u")
        envq.prometheus_metrics(q, registry=prometheus_client.CollectorRegistry())
        q.start()
        with caplog.at_level(logging.WARNING, logger="envq"):
            q.send(envq.Envelope(invoke=raiser(ValueError)))
            await asyncio.sleep(1)
        assert len(unhandled(caplog)) == 1
        await q.terminate()

    async def test_unobserved_task_failure_is_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A task that fails with no ``after`` callback and nobody waiting on it is
        logged once; an awaited task, one with ``after``, or ``log_unhandled=False`` is
        not."""

        async def boom() -> None:
            raise ValueError("boom")

        with caplog.at_level(logging.WARNING, logger="envq"):
            async with envq.TaskQueue("t") as tq:
                tq.submit(boom)
                awaited = tq.submit(boom)
                tq.enqueue(envq.Task(boom).after(lambda err: None))
                with pytest.raises(ValueError, match="boom"):
                    await awaited
            async with envq.TaskQueue("quiet", log_unhandled=False) as tq:
                tq.submit(boom)
        records = [r for r in caplog.records if "nothing observes it" in r.getMessage()]
        assert len(records) == 1
        assert isinstance(records[0].exc_info[1], ValueError)  # type: ignore[index]

    def test_unobserved_global_submit_is_visible(self, tmp_path: Path) -> None:
        """``envq.submit(boom)`` in a script with no logging set up prints the failure
        (it was silent)."""
        path = tmp_path / "boom.py"
        path.write_text(
            textwrap.dedent(
                """
                import envq
                def boom():
                    raise ValueError("kaboom")
                envq.submit(boom)
                """
            )
        )
        done = subprocess.run(
            [sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0
        assert "kaboom" in done.stderr
        assert "Traceback" in done.stderr


class TestResourceWarning:
    def test_collected_holding_envelopes(self) -> None:
        """A queue garbage-collected while it holds envelopes (never started, with
        buffered ones) warns with ResourceWarning; a terminated one does not."""

        def make(terminate: bool) -> None:
            q = envq.Queue("leaky")
            q.send(envq.Envelope(invoke=noop))
            if terminate:
                run(q.terminate())

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make(terminate=True)
            gc.collect()
            assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
            make(terminate=False)
            gc.collect()
        leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(leaks) == 1
        assert "leaky" in str(leaks[0].message)
        assert "1 envelope" in str(leaks[0].message)
