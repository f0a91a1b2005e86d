"""Fixtures of the queue tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_internal_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A table row the runtime cannot perform shows up as envq's "internal error" log
    (the worker catches it): the row tests, which use this, fail on one."""
    caplog.set_level(logging.ERROR, logger="envq")
    yield
    bad = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert not bad, bad
