"""pytest plugin: run ``async def`` tests on envq's virtual-time loop, when asked to.

Load it with ``-p envq.pytest_plugin`` or ``pytest_plugins = ["envq.pytest_plugin"]``
in the root ``conftest.py``. Then:

* ``@pytest.mark.virtual_time`` runs a coroutine test on a fresh
  :class:`envq.testing.VirtualTimeLoop` (through :func:`envq.testing.run`);
* ``@pytest.mark.real_clock`` runs it with ``asyncio.run`` on a plain loop (for the
  few smoke tests that must see real time); the closest of the two markers wins, so
  a test can opt out of its module's ``pytestmark``;
* the ini option ``envq_virtual_time = all`` (default ``marked``) puts every other
  coroutine test on virtual time too, unless another plugin's marker claims it.

The plugin takes a test at collection, before pytest-asyncio (even in
``asyncio_mode = auto``) or anyio see it, by turning it into a plain test that runs
the coroutine on the chosen loop; so a test the plugin takes never runs on another
plugin's loop by accident. A test marked ``asyncio``, ``anyio`` or ``trio``, or using
anyio's ``anyio_backend`` fixture, belongs to that plugin: when it is also marked
``virtual_time`` or ``real_clock`` (or the option says ``all``), the plugin leaves it to
its owner and warns (:class:`EnvqPluginWarning`) instead of running it silently on a
real clock. The ``docs/testing.md`` page shows how to give pytest-asyncio and anyio the
virtual-time loop themselves.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Generator
from typing import Any, Final

import pytest

from envq.testing import run

__all__ = ["MODES", "EnvqPluginWarning"]

#: The values of the ``envq_virtual_time`` ini option.
MODES: Final = ("marked", "all")
_OPTION: Final = "envq_virtual_time"
#: Markers of the other plugins that run coroutine tests, and the plugin's name.
_OWNERS: Final = {"asyncio": "pytest-asyncio", "anyio": "anyio", "trio": "pytest-trio"}
#: Set on the function the plugin put in place of a coroutine test.
_TAKEN: Final = "__envq_loop__"


class EnvqPluginWarning(pytest.PytestWarning):
    """A coroutine test asked for envq's loop, but another plugin runs it."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the ``envq_virtual_time`` ini option."""
    parser.addini(
        _OPTION,
        "which async tests envq.pytest_plugin runs on virtual time: 'marked' (those "
        "marked virtual_time; the default) or 'all' (every async test no other plugin "
        "claims)",
        default="marked",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers and check the ini option."""
    config.addinivalue_line(
        "markers", "virtual_time: run this async test on envq's virtual-time loop"
    )
    config.addinivalue_line(
        "markers", "real_clock: run this async test with asyncio.run on a real asyncio loop"
    )
    _mode(config)


def _mode(config: pytest.Config) -> str:
    value = config.getini(_OPTION)
    mode = value.strip().lower() if isinstance(value, str) else value
    if mode not in MODES:
        raise pytest.UsageError(
            f"envq.pytest_plugin: {_OPTION} must be one of {', '.join(MODES)}, got {value!r}"
        )
    return str(mode)


def _owner(item: pytest.Function) -> str | None:
    """The other plugin that claims ``item`` by its marker or fixture, if any."""
    for marker, plugin in _OWNERS.items():
        if item.get_closest_marker(marker) is not None:
            return f"{plugin} (marker {marker!r})"
    if "anyio_backend" in item.fixturenames:
        return "anyio (fixture 'anyio_backend')"
    return None


def _on_loop(
    fn: Callable[..., Any], runner: Callable[[Any], object], loop: str
) -> Callable[..., None]:
    @functools.wraps(fn)
    def test(*args: Any, **kwargs: Any) -> None:
        runner(fn(*args, **kwargs))

    setattr(test, _TAKEN, loop)
    return test


def _failing(fn: Callable[..., Any], message: str) -> Callable[..., None]:
    @functools.wraps(fn)
    def test(*args: Any, **kwargs: Any) -> None:
        pytest.fail(message, pytrace=False)

    setattr(test, _TAKEN, "none")
    return test


def _clock(item: pytest.Function) -> tuple[str | None, bool]:
    """The closest of the markers ``virtual_time`` and ``real_clock`` (a test's own
    marker overrides its class's or module's), ``"both"`` when one node has both; and
    whether it is the test's own."""
    for node in reversed(item.listchain()):
        names = {mark.name for mark in node.own_markers} & {"virtual_time", "real_clock"}
        if len(names) > 1:
            return "both", node is item
        if names:
            return names.pop(), node is item
    return None, False


def _take(item: pytest.Function) -> None:
    """Put a coroutine test on the loop it asks for, or warn why it is not."""
    fn = item.obj
    clock, own = _clock(item)
    virtual = clock in {"virtual_time", "both"}
    real = clock == "real_clock"
    if not inspect.iscoroutinefunction(fn):
        # A class's or module's marker also covers its sync tests, harmlessly.
        if own and clock is not None and not hasattr(fn, _TAKEN):
            item.warn(
                EnvqPluginWarning(
                    f"{item.nodeid} is marked {clock} but is not an 'async def' test "
                    "function: the marker does nothing"
                )
            )
        return
    everything = _mode(item.config) == "all"
    if not (virtual or real or everything):
        return  # not asked: left to whichever plugin runs async tests
    owner = _owner(item)
    if owner is not None:
        asked = (
            "is marked virtual_time"
            if virtual
            else "is marked real_clock"
            if real
            else f"falls under {_OPTION} = all"
        )
        item.warn(
            EnvqPluginWarning(
                f"{item.nodeid} {asked}, but {owner} runs it, on its own loop and on "
                "real time: remove one of the two, or give that plugin envq's "
                "VirtualTimeLoop (see envq's testing docs)"
            )
        )
        return
    if clock == "both":
        item.obj = _failing(fn, f"{item.nodeid} is marked both virtual_time and real_clock")
    elif real:
        item.obj = _on_loop(fn, asyncio.run, "real")
    else:
        item.obj = _on_loop(fn, run, "virtual")


# trylast: the innermost wrapper, so the items are taken before pytest-asyncio's
# wrapper (an outer one) looks for coroutine functions to run on its own loop.
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, object, object]:
    """Take the collected coroutine tests that ask for envq's loops."""
    result = yield
    items = result if isinstance(result, list) else [result]
    for item in items:
        if isinstance(item, pytest.Function):
            _take(item)
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Fail an async test nobody runs, saying how to have it run."""
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn) or _owner(pyfuncitem) is not None:
        return None
    pytest.fail(
        f"{pyfuncitem.nodeid} is an async test that no plugin runs: mark it "
        "@pytest.mark.virtual_time (envq's virtual-time loop) or @pytest.mark.real_clock, "
        f"or set the ini option {_OPTION} = all",
        pytrace=False,
    )
