"""Shared test setup: envq checks every envelope move against its table in tests."""

from __future__ import annotations

import envq._machine

envq._machine.STRICT = True
