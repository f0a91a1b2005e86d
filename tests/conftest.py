"""Shared test setup.

- envq checks every envelope move against its table (``STRICT``), unless the
  environment says ``ENVQ_STRICT=0``: CI runs the whole suite both ways, so the
  engine's path with nobody observing it is tested as well.
- Hypothesis profiles: ``dev`` (default), ``ci`` (bounded, used by ``.ci/run``),
  ``deep`` for audits (``pytest --hypothesis-profile=deep``), and ``deep-sample``: the
  deep profile's settings with fewer examples (``ENVQ_DEEP_SAMPLE``, default 1,000),
  which CI runs with a fixed ``--hypothesis-seed`` so that the deep profile cannot
  start failing unnoticed.
- envq's jitter RNG is registered with Hypothesis so failures replay and shrink.
- Queue fixtures: ``make_queue`` makes queues (watched by any ``Trace`` or other
  watcher given) and terminates, at the end of the test, every one it made;
  ``queue`` is one such queue, not started.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, settings

import envq._machine
import envq._values
from envq.testing import run
from tests.support import QueueMaker

# ``tests/strategies.py`` is imported as ``strategies`` by ``tests/test_stateful.py``.
# Appended, not prepended: ``tests/queue/`` must not hide the standard library's ``queue``.
sys.path.append(str(Path(__file__).resolve().parent))

envq._machine.STRICT = os.environ.get("ENVQ_STRICT", "1") != "0"
hypothesis.register_random(envq._values.default_rng)

_common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("dev", max_examples=40, **_common)
settings.register_profile("ci", max_examples=60, derandomize=True, **_common)
settings.register_profile("deep", max_examples=10_000, **_common)
settings.register_profile(
    "deep-sample", max_examples=int(os.environ.get("ENVQ_DEEP_SAMPLE", "1000")), **_common
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, plus one. Many tests wait on real time (driver
    processes starting, a PostgreSQL server, real-clock smoke tests), so one more
    worker than cores keeps the cores busy: on 2 cores the suite takes about 105 s with
    3 workers against 135 s with 2 (4 gain nothing more)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores + 1


@pytest.fixture(autouse=True)
def _engine_log_left_enabled() -> Iterator[None]:
    """A test that silences the ``envq`` logger must restore it: the tests of what
    the engine logs would otherwise pass or fail by the order they run in."""
    yield
    assert not logging.getLogger("envq").disabled, "the envq logger was left disabled"


@pytest.fixture
def make_queue() -> QueueMaker:
    """A factory of queues, each terminated when the test ends (an async test only)."""
    return QueueMaker()


@pytest.fixture
def queue(make_queue: QueueMaker) -> envq.Queue:
    """A queue named ``test``, not started, terminated when the test ends."""
    return make_queue()


def _closing(test: Callable[..., Any], maker: QueueMaker, real: bool) -> Callable[..., None]:
    """``test`` (an async test as written) run on its loop, then the queues ``maker``
    made terminated on that same loop, before it closes."""

    @functools.wraps(test)
    def body(*args: Any, **kwargs: Any) -> None:
        async def then_close() -> None:
            try:
                await test(*args, **kwargs)
            finally:
                await maker.aclose()

        if real:
            asyncio.run(then_close())
        else:
            run(then_close())

    return body


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """An async test given ``make_queue`` (or ``queue``) runs with its queues terminated
    at its end, still on its own loop: a fixture's teardown runs after that loop closed."""
    maker = pyfuncitem.funcargs.get("make_queue")
    test = inspect.unwrap(pyfuncitem.obj)  # the async test under the envq plugin's runner
    if not isinstance(maker, QueueMaker) or not inspect.iscoroutinefunction(test):
        return (yield)
    taken = pyfuncitem.obj
    real = pyfuncitem.get_closest_marker("real_clock") is not None
    pyfuncitem.obj = _closing(test, maker, real)
    try:
        return (yield)
    finally:
        pyfuncitem.obj = taken
