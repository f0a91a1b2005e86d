"""The conformance tests run the engine under drivers that fail on purpose: its log
of those failures is silenced here, and restored after each test."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _quiet_engine() -> Iterator[None]:
    log = logging.getLogger("envq")
    was, log.disabled = log.disabled, True
    yield
    log.disabled = was
