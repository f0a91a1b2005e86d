"""pytest plugin: run ``async def`` tests on envq's virtual-time loop.

Enable it with ``-p envq.pytest_plugin`` (envq's own test suite does) or
``pytest_plugins = ["envq.pytest_plugin"]`` in a ``conftest.py``. Every coroutine test
function then runs on a fresh :class:`envq.testing.VirtualTimeLoop`; mark a test
``@pytest.mark.real_clock`` to run it on a plain asyncio loop instead (for the few
smoke tests that must see real time).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from envq.testing import run


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``real_clock`` marker."""
    config.addinivalue_line("markers", "real_clock: run this async test on a real asyncio loop")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a coroutine test function to completion on the right loop."""
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    names = pyfuncitem._fixtureinfo.argnames
    kwargs: dict[str, Any] = {name: pyfuncitem.funcargs[name] for name in names}
    if pyfuncitem.get_closest_marker("real_clock") is not None:
        asyncio.run(fn(**kwargs))
    else:
        run(fn(**kwargs))
    return True
