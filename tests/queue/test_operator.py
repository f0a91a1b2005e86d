"""An operator's moves on an in-process queue (the rows of ``QUEUE_MOVES`` with the
events ``RETRY``, ``CANCEL``, ``DISCARD``) and the story an ended envelope keeps: its
last error with its traceback, its failed attempts; on virtual time."""

from __future__ import annotations

import asyncio

import pytest

import envq
from envq import EnvState, Outcome
from envq._reports import STORY_LIMIT, TRACEBACK_LIMIT


class Flaky:
    """Fails while ``failing``; counts its calls."""

    def __init__(self) -> None:
        self.failing = True
        self.calls = 0

    async def __call__(self, env: envq.Envelope) -> None:
        self.calls += 1
        if self.failing:
            raise ValueError(f"bounce {self.calls}")


def _snap(q: envq.Queue, env: envq.Envelope) -> envq.LiveEnvelope:
    [found] = [s for s in q.envelopes(limit=10_000) if s.envelope is env]
    return found


class TestTheStory:
    async def test_a_failed_envelope_keeps_its_error_and_its_attempts(self) -> None:
        flaky = Flaky()
        q = envq.Queue("q", log_unhandled=False)
        q.start()
        env = envq.Envelope(
            invoke=flaky, id="f", retry=envq.Retry(attempts=3, base=1, jitter=False)
        )
        q.send(env)
        await asyncio.sleep(60)
        snap = _snap(q, env)
        assert snap.state is EnvState.FAILED
        assert snap.error is not None
        assert snap.error.type == "envq._errors.MaxRetriesExceeded"
        assert "failed 3 of 3 attempts" in snap.error.message
        assert "ValueError: bounce 3" in snap.error.traceback  # the chained cause
        assert [(a.attempt, a.outcome) for a in snap.history] == [
            (1, Outcome.ERROR),
            (2, Outcome.ERROR),
            (3, Outcome.ERROR),
        ]
        assert [a.error.message for a in snap.history if a.error] == [
            "bounce 1",
            "bounce 2",
            snap.error.message,
        ]
        assert [a.ended for a in snap.history] == [0.0, 1.0, 3.0]
        await q.terminate()

    async def test_the_story_is_bounded(self) -> None:
        async def fails(env: envq.Envelope) -> None:
            raise RuntimeError("x" * 100_000)

        q = envq.Queue("q", log_unhandled=False)
        q.start()
        policy = envq.Retry(attempts=STORY_LIMIT + 5, base=0.01, cap=0.01, jitter=False)
        env = envq.Envelope(invoke=fails, id="f", retry=policy)
        q.send(env)
        await asyncio.sleep(10_000)
        snap = _snap(q, env)
        assert len(snap.history) == STORY_LIMIT
        assert snap.history[-1].attempt == STORY_LIMIT + 5
        assert all(len(a.error.traceback) <= TRACEBACK_LIMIT for a in snap.history if a.error)
        assert all(len(a.error.message) <= 1000 for a in snap.history if a.error)
        await q.terminate()

    async def test_a_success_keeps_nothing(self) -> None:
        async def ok(env: envq.Envelope) -> None:
            pass

        q = envq.Queue("q")
        q.start()
        q.send(envq.Envelope(invoke=ok, id="s"))
        await asyncio.sleep(1)
        assert q.envelopes() == []
        await q.terminate()

    async def test_the_queue_keeps_the_latest_keep_ended(self) -> None:
        async def fails(env: envq.Envelope) -> None:
            raise RuntimeError("no")

        q = envq.Queue("q", keep_ended=3, log_unhandled=False, workers=4)
        q.start()
        q.send(*(envq.Envelope(invoke=fails, id=i) for i in range(5)))
        await asyncio.sleep(1)
        assert [s.envelope.id for s in q.envelopes(EnvState.FAILED)] == [2, 3, 4]
        assert envq.Queue("q", keep_ended=0).envelopes() == []
        await q.terminate()

    def test_keep_ended_is_checked(self) -> None:
        with pytest.raises(ValueError, match="keep_ended"):
            envq.Queue("q", keep_ended=-1)
        with pytest.raises(TypeError, match="keep_ended"):
            envq.Queue("q", keep_ended="3")  # type: ignore[arg-type]


class TestRetry:
    async def test_a_failed_envelope_is_sent_back_and_keeps_its_story(self) -> None:
        flaky = Flaky()
        q = envq.Queue("q", log_unhandled=False)
        q.start()
        env = envq.Envelope(invoke=flaky, id="f")
        q.send(env)
        await asyncio.sleep(1)
        assert q.state_of(env) is None  # ended: not live
        flaky.failing = False
        assert q.retry("f") == 1
        await asyncio.sleep(1)
        assert flaky.calls == 2
        assert q.statistics().by_state[EnvState.SUCCEEDED] == 1
        assert q.envelopes() == []  # a success is not kept
        assert env._rec.attempts == 2  # the story went on from the first stay
        await q.terminate()

    async def test_a_retry_is_a_move_of_the_tables_reported_as_an_event(self) -> None:
        flaky = Flaky()
        events: list[tuple[EnvState, EnvState]] = []
        q = envq.Queue("q", log_unhandled=False)
        q.subscribe(lambda ev: events.append((ev.from_state, ev.to_state)))  # type: ignore[arg-type]
        q.start()
        env = envq.Envelope(invoke=flaky, id="f")
        q.send(env)
        await asyncio.sleep(1)
        events.clear()
        flaky.failing = False
        assert q.retry(env) == 1
        await asyncio.sleep(1)
        assert events == [
            (EnvState.FAILED, EnvState.READY),
            (EnvState.READY, EnvState.RUNNING),
            (EnvState.RUNNING, EnvState.SUCCEEDED),
        ]
        await q.terminate()

    async def test_a_retry_is_checked_as_a_send(self) -> None:
        flaky = Flaky()
        q = envq.Queue("q", capacity=1, log_unhandled=False)
        q.start()
        env = envq.Envelope(invoke=flaky, id="f")
        q.send(env)
        await asyncio.sleep(1)
        blocker = envq.Envelope(invoke=flaky, id="blocker", delay=100)
        q.send(blocker)
        with pytest.raises(envq.CapacityExceeded):
            q.retry("f")
        assert q.state_of(env) is None
        assert _snap(q, env).state is EnvState.FAILED  # still kept, nothing moved
        # The same id live again is a dedup, not a second live envelope.
        q.cancel(blocker)
        twin = envq.Envelope(invoke=flaky, id="f", delay=100)
        q.send(twin)
        assert q.retry("f") == 0
        await q.stop()
        with pytest.raises(envq.QueueNotRunning):
            q.retry("f")
        await q.terminate()

    async def test_retry_before_the_first_start_buffers(self) -> None:
        q = envq.Queue("q")
        env = envq.Envelope(invoke=Flaky(), id="b")
        q.send(env)
        assert q.cancel(env) == 1
        assert q.retry(env) == 1
        assert q.state_of(env) is EnvState.BUFFERED
        await q.terminate()

    async def test_a_succeeded_or_unknown_envelope_is_not_retried(self) -> None:
        async def ok(env: envq.Envelope) -> None:
            pass

        q = envq.Queue("q")
        q.start()
        env = envq.Envelope(invoke=ok, id="s")
        q.send(env)
        await asyncio.sleep(1)
        assert q.retry(env, "nope", 12) == 0
        with pytest.raises(TypeError, match="an envelope or an id"):
            q.retry(["unhashable"])
        await q.terminate()


class TestCancel:
    async def test_live_envelopes_not_running_end_stopped(self) -> None:
        flaky = Flaky()
        q = envq.Queue("q", workers=1)
        q.start()
        hold = asyncio.Event()

        async def hang(env: envq.Envelope) -> None:
            await hold.wait()

        running = envq.Envelope(invoke=hang, id="r")
        ready = envq.Envelope(invoke=flaky, id="ready")
        delayed = envq.Envelope(invoke=flaky, id="d", delay=50)
        q.send(running, ready, delayed)
        await asyncio.sleep(0)
        assert q.state_of(ready) is EnvState.READY
        assert q.cancel("ready", delayed) == 2
        assert q.state_of(ready) is None
        assert q.state_of(delayed) is None
        stats = q.statistics()
        assert stats.by_state[EnvState.STOPPED] == 2
        assert stats.capacity_used == 1
        hold.set()
        await asyncio.sleep(100)
        assert flaky.calls == 0  # neither ran
        await q.terminate()

    async def test_a_running_envelope_is_asked_to_stop_and_ends_stopped_without_hooks(
        self,
    ) -> None:
        hooks: list[str] = []

        async def long(env: envq.Envelope) -> None:
            await asyncio.sleep(1000)

        async def on_failure(
            env: envq.Envelope, error: BaseException | None, attempt: int
        ) -> envq.Decision:
            hooks.append("on_failure")
            return envq.retry_now()

        q = envq.Queue("q")
        q.start()
        env = envq.Envelope(invoke=long, id="l", on_failure=on_failure)
        q.send(env)
        await asyncio.sleep(1)
        assert q.state_of(env) is EnvState.RUNNING
        assert q.cancel("l") == 1
        await asyncio.sleep(0.1)
        assert q.state_of(env) is None
        assert q.statistics().by_state[EnvState.STOPPED] == 1
        assert hooks == []
        assert q.statistics().outcomes[Outcome.CANCELLED] == 1
        await q.terminate()

    async def test_a_running_envelope_that_ends_anyway_is_stopped(self) -> None:
        """An attempt that swallows the cancel and returns still ends STOPPED: the
        operator's cancel relabelled its row group."""

        async def stubborn(env: envq.Envelope) -> None:
            try:
                await asyncio.sleep(1000)
            except asyncio.CancelledError:
                return

        q = envq.Queue("q")
        q.start()
        env = envq.Envelope(invoke=stubborn, id="s")
        q.send(env)
        await asyncio.sleep(1)
        q.cancel(env)
        await asyncio.sleep(1)
        assert q.statistics().by_state[EnvState.STOPPED] == 1
        assert q.statistics().by_state.get(EnvState.SUCCEEDED, 0) == 0
        # Retried, it runs as itself again (the relabel was the last stay's).
        assert q.retry(env) == 1
        await asyncio.sleep(0.1)
        assert q.state_of(env) is EnvState.RUNNING
        await q.terminate()

    async def test_a_parked_envelope_is_cancelled_while_stopped(self) -> None:
        q = envq.Queue("q")
        q.start()
        env = envq.Envelope(invoke=Flaky(), id="p", delay=100)
        q.send(env)
        await q.stop()
        assert q.state_of(env) is EnvState.PARKED
        assert q.cancel(env) == 1
        assert await q.terminate() == []


class TestDiscard:
    async def test_a_kept_envelope_is_forgotten(self) -> None:
        q = envq.Queue("q", log_unhandled=False)
        q.start()
        env = envq.Envelope(invoke=Flaky(), id="f")
        q.send(env)
        await asyncio.sleep(1)
        assert [s.state for s in q.envelopes()] == [EnvState.FAILED]
        assert q.discard("f", "nope") == 1
        assert q.envelopes() == []
        assert env._rec.state is EnvState.NEW
        assert env._rec.story is None
        assert q.retry(env) == 0  # no longer kept
        await q.terminate()

    async def test_a_live_envelope_is_not_discarded(self) -> None:
        q = envq.Queue("q")
        q.start()
        env = envq.Envelope(invoke=Flaky(), id="d", delay=100)
        q.send(env)
        assert q.discard(env) == 0
        assert q.state_of(env) is EnvState.DELAYED
        await q.terminate()


def test_the_moves_work_from_another_thread() -> None:
    """As send() does, the operator's calls work from a thread other than the loop's."""

    async def main() -> list[int]:
        q = envq.Queue("q", log_unhandled=False)
        q.start()
        env = envq.Envelope(invoke=Flaky(), id="f", delay=10)
        q.send(env)
        got = await asyncio.to_thread(lambda: q.cancel("f"))
        await q.terminate()
        return [got]

    assert asyncio.run(main()) == [1]
