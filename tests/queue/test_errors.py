"""Errors (docs/api.md) and the lifecycle's (docs/lifecycle.md: queue arguments, state
errors): classes, hierarchy, messages."""

from __future__ import annotations

import asyncio
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import envq
from envq.testing import run
from tests.support import assert_names, gated, noop, settle

HIERARCHY: list[tuple[type[BaseException], tuple[type[BaseException], ...]]] = [
    (envq.EnvqError, (Exception,)),
    (envq.BadEnvelope, (envq.EnvqError, ValueError)),
    (envq.BadEnvelopeType, (envq.BadEnvelope, envq.EnvqError, ValueError, TypeError)),
    (envq.BadIntervals, (envq.BadEnvelope, envq.EnvqError, ValueError)),
    (envq.CapacityExceeded, (envq.EnvqError,)),
    (envq.QueueNotRunning, (envq.EnvqError,)),
    (envq.QueueStopping, (envq.QueueNotRunning, envq.EnvqError)),
    (envq.QueueTerminated, (envq.QueueNotRunning, envq.EnvqError)),
    (envq.QueueShuttingDown, (envq.EnvqError,)),
    (envq.TypeBlacklisted, (envq.EnvqError,)),
    (envq.MaxRetriesExceeded, (envq.EnvqError,)),
    (envq.AlreadyComplete, (envq.EnvqError,)),
]
CONTROL_SIGNALS: list[type[BaseException]] = [envq.StopEnvelope, envq.StopType, envq.DoNotRetry]
NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_"


def state_of(q: envq.Queue) -> envq.QueueState:
    """The queue's state (a call, so checks after an await are not narrowed away)."""
    return q.state


class TestHierarchy:
    @pytest.mark.parametrize(("cls", "bases"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
    def test_bases(self, cls: type[BaseException], bases: tuple[type[BaseException], ...]) -> None:
        """Each error class derives from the bases the contract lists."""
        for base in bases:
            assert issubclass(cls, base), f"{cls.__name__} is not a {base.__name__}"

    @pytest.mark.parametrize(("cls", "bases"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
    def test_raisable_and_catchable_as_envq_error(
        self, cls: type[BaseException], bases: tuple[type[BaseException], ...]
    ) -> None:
        """Every error can be raised with a message and caught as EnvqError."""
        with pytest.raises(envq.EnvqError, match="boom"):
            raise cls("boom")

    def test_distinct_state_errors(self) -> None:
        """QueueStopping and QueueTerminated are distinct; neither is the other."""
        assert not issubclass(envq.QueueStopping, envq.QueueTerminated)
        assert not issubclass(envq.QueueTerminated, envq.QueueStopping)
        assert not issubclass(envq.CapacityExceeded, envq.QueueNotRunning)
        assert not issubclass(envq.TypeBlacklisted, envq.BadEnvelope)


class TestControlSignals:
    @pytest.mark.parametrize("cls", CONTROL_SIGNALS, ids=lambda c: c.__name__)
    def test_not_envq_errors(self, cls: type[BaseException]) -> None:
        """Control signals are plain exceptions, not EnvqError."""
        assert issubclass(cls, Exception)
        assert not issubclass(cls, envq.EnvqError)

    def test_stop_type_is_stop_envelope(self) -> None:
        """StopType is a StopEnvelope; DoNotRetry is neither."""
        assert issubclass(envq.StopType, envq.StopEnvelope)
        assert not issubclass(envq.DoNotRetry, envq.StopEnvelope)
        assert not issubclass(envq.StopEnvelope, envq.StopType)


class TestQueueArguments:
    @given(
        name=st.one_of(
            st.just(""),
            st.text(min_size=1, max_size=10).filter(
                lambda s: not s.isprintable() or s.strip() != s
            ),
        )
    )
    def test_bad_name(self, name: str) -> None:
        """An empty queue name, one with a control character or line break, or one
        with surrounding whitespace raises ValueError naming it."""
        with pytest.raises(ValueError, match=r"(?s).") as info:
            envq.Queue(name)
        message = str(info.value)
        assert repr(name) in message or (name != "" and name in message), message

    @pytest.mark.parametrize("name", ["emails\n", "a\tb", " a", "a ", "\x1b[31m"])
    def test_bad_name_examples(self, name: str) -> None:
        """Near-misses (trailing newline, tab, surrounding space, an escape code) are
        rejected."""
        with pytest.raises(ValueError, match="name|" + re.escape(repr(name))):
            envq.Queue(name)

    @given(
        name=st.one_of(
            st.text(alphabet=NAME_CHARS, min_size=1, max_size=20),
            st.text(min_size=1, max_size=20).filter(lambda s: s.isprintable() and s.strip() == s),
        )
    )
    def test_good_name(self, name: str) -> None:
        """Any non-empty printable name without surrounding whitespace ("my-queue",
        "a b", "é") is accepted and used in events."""

        async def main() -> list[str]:
            q = envq.Queue(name)
            seen: list[str] = []
            q.subscribe(lambda ev: seen.append(ev.queue))
            q.start()
            await q.terminate()
            return seen

        seen = run(main())
        assert seen
        assert set(seen) == {name}

    @pytest.mark.parametrize("workers", [0, -1])
    def test_bad_workers(self, workers: object) -> None:
        """An int workers that is not > 0 raises ValueError naming workers."""
        with pytest.raises(ValueError, match="workers"):
            envq.Queue("q", workers=workers)  # type: ignore[arg-type]

    @pytest.mark.parametrize("workers", [1.5, "2", True, None])
    def test_workers_not_an_int(self, workers: object) -> None:
        """workers that is not an int (a bool is not) raises TypeError naming workers."""
        with pytest.raises(TypeError, match="workers"):
            envq.Queue("q", workers=workers)  # type: ignore[arg-type]

    @pytest.mark.parametrize("capacity", [-1, -100])
    def test_bad_capacity(self, capacity: int) -> None:
        """A negative capacity raises ValueError naming capacity."""
        with pytest.raises(ValueError, match="capacity"):
            envq.Queue("q", capacity=capacity)

    async def test_good_arguments(self) -> None:
        """Valid workers and capacity (including 0 = unlimited) are accepted."""
        for workers, capacity in [(1, 0), (4, 1000), (16, 1)]:
            q = envq.Queue("q", workers=workers, capacity=capacity)
            assert q.state is envq.QueueState.INIT
            assert q.statistics().capacity_limit == capacity
            await q.terminate()


class TestStateErrors:
    async def test_stopping(self) -> None:
        """While STOPPING, send() and start() raise QueueStopping naming the queue."""
        gate = asyncio.Event()
        q = envq.Queue("stopq")
        q.send(gated(gate, id="g", type="gate"))
        q.start()
        await settle()
        await q.stop(wait=False)
        assert q.state is envq.QueueState.STOPPING
        with pytest.raises(envq.QueueStopping) as info:
            q.send(envq.Envelope(invoke=noop))
        assert_names(info.value, "stopq")
        with pytest.raises(envq.QueueStopping):
            q.start()
        assert state_of(q) is envq.QueueState.STOPPING
        gate.set()
        await q.wait_stopped()
        assert state_of(q) is envq.QueueState.STOPPED
        await q.terminate()

    async def test_stopped(self) -> None:
        """While STOPPED, send() raises QueueNotRunning (not a subclass) naming the queue."""
        q = envq.Queue("stoppedq")
        q.start()
        await q.stop()
        assert q.state is envq.QueueState.STOPPED
        with pytest.raises(envq.QueueNotRunning) as info:
            q.send(envq.Envelope(invoke=noop, type="t", id=3))
        assert type(info.value) is envq.QueueNotRunning
        assert_names(info.value, "stoppedq")
        await q.terminate()

    async def test_terminated(self) -> None:
        """Once TERMINATED, send() and start() raise QueueTerminated naming the queue."""
        q = envq.Queue("termq")
        q.start()
        await q.terminate()
        with pytest.raises(envq.QueueTerminated) as info:
            q.send(envq.Envelope(invoke=noop))
        assert_names(info.value, "termq")
        with pytest.raises(envq.QueueTerminated):
            q.start()
        assert q.state is envq.QueueState.TERMINATED


class TestSendMessages:
    @pytest.mark.parametrize("state", ["stopping", "stopped", "terminated"])
    async def test_state_error_names_envelope(self, state: str) -> None:
        """A send refused for the queue's state names the queue and the envelope's type/id."""
        gate = asyncio.Event()
        q = envq.Queue("stateq")
        q.start()
        q.send(gated(gate, id="g", type="gate"))
        await settle()
        if state == "stopping":
            await q.stop(wait=False)
        elif state == "stopped":
            gate.set()
            await q.stop()
        else:
            await q.terminate()
        with pytest.raises(envq.QueueNotRunning) as info:
            q.send(envq.Envelope(invoke=noop, type="invoice", id=314))
        assert_names(info.value, "stateq", "invoice", "314")
        gate.set()
        await q.terminate()

    async def test_not_an_envelope(self) -> None:
        """Sending a non-envelope raises BadEnvelope naming the queue."""
        q = envq.Queue("msgq")
        q.start()
        with pytest.raises(envq.BadEnvelope) as info:
            q.send("not an envelope")  # type: ignore[arg-type]
        assert_names(info.value, "msgq")
        await q.terminate()

    async def test_foreign(self) -> None:
        """Sending an envelope live in another queue raises BadEnvelope naming queue and type/id."""
        a = envq.Queue("qa")
        b = envq.Queue("qb")
        env = envq.Envelope(invoke=noop, type="mail", id=42)
        a.send(env)
        with pytest.raises(envq.BadEnvelope) as info:
            b.send(env)
        assert_names(info.value, "qb", "mail", "42")
        await a.terminate()
        await b.terminate()

    async def test_capacity(self) -> None:
        """CapacityExceeded names the queue and an envelope of the batch."""
        q = envq.Queue("capq", capacity=1)
        q.send(envq.Envelope(invoke=noop))
        with pytest.raises(envq.CapacityExceeded) as info:
            q.send(envq.Envelope(invoke=noop, type="extra", id=9))
        assert_names(info.value, "capq", "extra", "9")
        await q.terminate()

    async def test_blacklisted(self) -> None:
        """After StopType, sending that type raises TypeBlacklisted naming queue, type and id."""

        async def stop_type(env: envq.Envelope) -> None:
            raise envq.StopType

        q = envq.Queue("blq")
        q.start()
        q.send(envq.Envelope(invoke=stop_type, type="spam", id=1))
        await settle()
        with pytest.raises(envq.TypeBlacklisted) as info:
            q.send(envq.Envelope(invoke=noop, type="spam", id=2))
        assert_names(info.value, "blq", "spam", "2")
        q.send(envq.Envelope(invoke=noop, type="ham", id=3))  # other types still admitted
        await q.terminate()

    async def test_empty_type_stop_type_blacklists_nothing(self) -> None:
        """StopType on an envelope with an empty type acts as STOP: nothing is blacklisted."""

        async def stop_type(env: envq.Envelope) -> None:
            raise envq.StopType

        q = envq.Queue("blq")
        q.start()
        q.send(envq.Envelope(invoke=stop_type))
        await settle()
        q.send(envq.Envelope(invoke=noop))
        await settle()
        assert q.statistics().outcomes.get(envq.Outcome.STOP, 0) == 1
        assert q.statistics().outcomes.get(envq.Outcome.STOP_TYPE, 0) == 0
        await q.terminate()


class TestRunErrors:
    async def test_max_retries_exceeded(self) -> None:
        """Used-up retries end FAILED with a MaxRetriesExceeded cause naming queue and type/id."""
        boom = RuntimeError("boom")

        async def fail(env: envq.Envelope) -> None:
            raise boom

        q = envq.Queue("retryq")
        events: list[envq.Event] = []
        q.subscribe(events.append)
        env = envq.Envelope(
            invoke=fail, type="job", id=5, retry=envq.Retry(attempts=2, base=1, jitter=False)
        )
        q.start()
        q.send(env)
        await asyncio.sleep(10)
        final = [e for e in events if e.envelope is env][-1]
        assert final.to_state is envq.EnvState.FAILED
        assert isinstance(final.cause, envq.MaxRetriesExceeded)
        assert final.cause.__cause__ is boom
        assert_names(final.cause, "retryq", "job", "5")
        await q.terminate()
