"""How a queue ends with the program: an orderly exit that parks periodic envelopes is
not a warning; envelopes lost with a queue nobody terminated are; the first SIGINT or
SIGTERM can drain the queue (``Queue.stop_on_signals``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

import envq

S = envq.EnvState
Q = envq.QueueState


async def tick(env: envq.Envelope) -> None:
    pass


async def work(env: envq.Envelope) -> None:
    await asyncio.sleep(env.payload or 0)


def envq_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "envq" and r.levelno == level]


class TestOrderlyExit:
    async def test_parked_periodic_envelopes_are_not_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="envq")
        periodic = envq.Envelope(invoke=tick, interval=60)
        async with envq.Queue("web") as q:
            q.send(periodic)
            await asyncio.sleep(1)
        assert q.leftovers == [periodic]
        assert envq_records(caplog, logging.WARNING) == []
        infos = [r.getMessage() for r in envq_records(caplog, logging.INFO)]
        assert len(infos) == 1
        assert "1 periodic" in infos[0]

    async def test_left_over_one_off_work_is_still_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="envq")
        periodic = envq.Envelope(invoke=tick, interval=60)
        later = envq.Envelope(invoke=tick, delay=600)
        async with envq.Queue("web") as q:
            q.send(periodic, later)
            await asyncio.sleep(1)
        assert q.leftovers == [periodic, later]
        warnings = [r.getMessage() for r in envq_records(caplog, logging.WARNING)]
        assert len(warnings) == 1
        assert "2 envelope(s) left over" in warnings[0]

    async def test_an_exit_by_an_error_is_still_a_warning(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="envq")
        periodic = envq.Envelope(invoke=tick, interval=60)
        q = envq.Queue("web")

        async def body() -> None:
            async with q:
                q.send(periodic)
                await asyncio.sleep(1)
                raise KeyError("boom")

        with pytest.raises(KeyError):
            await body()
        assert q.leftovers == [periodic]
        assert len(envq_records(caplog, logging.WARNING)) == 1


def test_a_queue_never_started_is_lost_loudly(tmp_path: Path) -> None:
    """A script that sends to a queue it never starts, with no logging set up, sees
    that its envelopes were dropped (a ResourceWarning alone is hidden by default)."""
    path = tmp_path / "lost.py"
    path.write_text(
        textwrap.dedent(
            """
            import envq
            async def job(env):
                pass
            q = envq.Queue("forgotten")
            q.send(envq.Envelope(invoke=job), envq.Envelope(invoke=job))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0
    assert "forgotten" in done.stderr
    assert "2 envelope(s)" in done.stderr


@pytest.fixture
def previous_sigterm() -> Iterator[list[int]]:
    """A Python handler of SIGTERM installed before the test (and restored after): what
    a second signal must reach."""
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, before)


class TestStopOnSignals:
    async def test_the_first_signal_drains_the_queue(self, previous_sigterm: list[int]) -> None:
        q = envq.Queue("service", workers=1)
        q.start()
        remove = q.stop_on_signals()
        running = envq.Envelope(invoke=work, payload=5, id="running")
        ready = envq.Envelope(invoke=work, payload=5, id="ready")
        periodic = envq.Envelope(invoke=tick, interval=60, delay=30, id="periodic")
        q.send(running, ready, periodic)
        await asyncio.sleep(1)
        signal.raise_signal(signal.SIGTERM)
        report = await q.wait_stopped()
        assert asyncio.get_running_loop().time() == 10.0  # both ran to the end
        assert q.state is Q.STOPPED
        assert report.parked == (periodic,)
        assert q.statistics().by_state[S.SUCCEEDED] == 2
        assert previous_sigterm == []
        remove()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        await q.terminate()

    async def test_a_second_signal_gets_the_previous_handling(
        self, previous_sigterm: list[int]
    ) -> None:
        q = envq.Queue("service", workers=1)
        q.start()
        q.stop_on_signals(signal.SIGTERM)
        q.send(envq.Envelope(invoke=work, payload=100))
        await asyncio.sleep(1)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert q.state is Q.STOPPING
        assert previous_sigterm == []
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert previous_sigterm == [signal.SIGTERM]
        await q.terminate()

    async def test_remove_restores_the_previous_handler(self, previous_sigterm: list[int]) -> None:
        q = envq.Queue("service")
        q.start()
        before = signal.getsignal(signal.SIGTERM)
        remove = q.stop_on_signals(signal.SIGTERM)
        remove()
        assert signal.getsignal(signal.SIGTERM) is before
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(0)
        assert previous_sigterm == [signal.SIGTERM]
        assert q.state is Q.RUNNING
        await q.terminate()

    async def test_every_registered_queue_stops_then_the_previous_handler(
        self, previous_sigterm: list[int]
    ) -> None:
        """Two queues take SIGTERM: the first signal stops both (not only the one that
        registered last); the second reaches the handler from before envq."""
        first, second = envq.Queue("first"), envq.Queue("second")
        for q in (first, second):
            q.start()
            q.stop_on_signals()
            q.send(envq.Envelope(invoke=work, payload=100))
        await asyncio.sleep(1)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert (first.state, second.state) == (Q.STOPPING, Q.STOPPING)
        assert previous_sigterm == []
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert previous_sigterm == [signal.SIGTERM]
        for q in (first, second):
            await q.terminate()

    async def test_one_queue_registering_twice_gives_the_signal_back(
        self, previous_sigterm: list[int]
    ) -> None:
        q = envq.Queue("twice")
        q.start()
        q.stop_on_signals()
        q.stop_on_signals(signal.SIGTERM)
        q.send(envq.Envelope(invoke=work, payload=100))
        await asyncio.sleep(1)
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert q.state is Q.STOPPING
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert previous_sigterm == [signal.SIGTERM]
        await q.terminate()

    async def test_giving_back_one_registration_keeps_the_others(
        self, previous_sigterm: list[int]
    ) -> None:
        """A registration given back early leaves the signal to the other queue's; once
        neither wants it, the handler from before is back."""
        first, second = envq.Queue("first"), envq.Queue("second")
        before = signal.getsignal(signal.SIGTERM)
        for q in (first, second):
            q.start()
        remove_first = first.stop_on_signals(signal.SIGTERM)
        remove_second = second.stop_on_signals(signal.SIGTERM)
        remove_first()
        signal.raise_signal(signal.SIGTERM)
        await asyncio.sleep(1)
        assert (first.state, second.state) == (Q.RUNNING, Q.STOPPED)
        assert previous_sigterm == []
        remove_second()  # already given back by the signal: a no-op
        assert signal.getsignal(signal.SIGTERM) is before
        for q in (first, second):
            await q.terminate()

    async def test_the_loops_own_handler_from_before_is_given_back(self) -> None:
        """A handler the program added on the loop before envq took the signal gets the
        second signal."""
        loop = asyncio.get_running_loop()
        got: list[str] = []
        loop.add_signal_handler(signal.SIGTERM, got.append, "own")
        try:
            first, second = envq.Queue("first"), envq.Queue("second")
            for q in (first, second):
                q.start()
                q.stop_on_signals(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(1)
            assert (first.state, second.state) == (Q.STOPPED, Q.STOPPED)
            assert got == []
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(1)
            assert got == ["own"]
            for q in (first, second):
                await q.terminate()
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    def test_a_second_ctrl_c_interrupts_with_two_queues(self, tmp_path: Path) -> None:
        """Two queues take SIGINT; the first Ctrl-C stops both, the second raises
        KeyboardInterrupt as it would have without envq (real process, real clock)."""
        script = tmp_path / "two_queues.py"
        script.write_text(
            textwrap.dedent(
                """
                import asyncio, signal
                import envq

                async def slow(env):
                    await asyncio.sleep(30)

                async def main():
                    queues = [envq.Queue("a"), envq.Queue("b")]
                    for q in queues:
                        q.start()
                        q.stop_on_signals()
                        q.send(envq.Envelope(invoke=slow))
                    await asyncio.sleep(0.05)
                    signal.raise_signal(signal.SIGINT)
                    await asyncio.sleep(0.05)
                    print("states", [q.state.name for q in queues], flush=True)
                    signal.raise_signal(signal.SIGINT)
                    await asyncio.sleep(5)
                    print("not interrupted", flush=True)

                asyncio.run(main())
                """
            )
        )
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
        )
        assert "states ['STOPPING', 'STOPPING']" in done.stdout, done.stdout + done.stderr
        assert "not interrupted" not in done.stdout
        assert done.returncode != 0
        assert "KeyboardInterrupt" in done.stderr

    async def test_bad_signals(self) -> None:
        q = envq.Queue("service")
        q.start()
        with pytest.raises(TypeError, match="signals"):
            q.stop_on_signals("SIGTERM")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="signals"):
            q.stop_on_signals(signal.SIGKILL)
        await q.terminate()

    def test_needs_the_queue_started(self) -> None:
        q = envq.Queue("idle")
        with pytest.raises(RuntimeError, match="stop_on_signals"):
            q.stop_on_signals()
