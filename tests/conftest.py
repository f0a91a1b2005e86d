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
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
from hypothesis import HealthCheck, settings

import envq._machine
import envq._values

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


@pytest.fixture(autouse=True)
def _engine_log_left_enabled() -> Iterator[None]:
    """A test that silences the ``envq`` logger must restore it: the tests of what
    the engine logs would otherwise pass or fail by the order they run in."""
    yield
    assert not logging.getLogger("envq").disabled, "the envq logger was left disabled"
