"""pytest plugin: run ``async def`` tests on envq's virtual-time loop, when asked to.

Load it with ``-p envq.pytest_plugin`` or ``pytest_plugins = ["envq.pytest_plugin"]``
in the root ``conftest.py``. Then:

* ``@pytest.mark.virtual_time`` runs a coroutine test on a fresh
  :class:`envq.testing.VirtualTimeLoop` (through :func:`envq.testing.run`); its
  keyword arguments are :func:`envq.testing.run`'s (``wall_start``, ``thread_grace``,
  ``idle_timeout``), and :func:`virtual_time` makes the same marker with typed
  arguments: ``@virtual_time(wall_start=datetime(2026, 3, 29, tzinfo=UTC))``;
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
import datetime as dt
import functools
import inspect
from collections.abc import Callable, Generator
from typing import Any, Final

import pytest

from envq.testing import _check_clock_args, run

__all__ = ["MODES", "EnvqPluginWarning", "virtual_time"]

#: The values of the ``envq_virtual_time`` ini option.
MODES: Final = ("marked", "all")
_OPTION: Final = "envq_virtual_time"
#: Markers of the other plugins that run coroutine tests, and the plugin's name.
_OWNERS: Final = {"asyncio": "pytest-asyncio", "anyio": "anyio", "trio": "pytest-trio"}
#: Set on the function the plugin put in place of a coroutine test.
_TAKEN: Final = "__envq_loop__"
#: The keyword arguments the ``virtual_time`` marker takes (those of ``run``).
_CLOCK_ARGS: Final = ("wall_start", "thread_grace", "idle_timeout")


def virtual_time(
    *,
    wall_start: float | dt.datetime | None = None,
    thread_grace: float = 2.0,
    idle_timeout: float = 30.0,
) -> pytest.MarkDecorator:
    """The ``virtual_time`` marker with typed arguments: run the test on a fresh
    :class:`envq.testing.VirtualTimeLoop` whose wall clock starts at ``wall_start``
    (seconds since the epoch or an aware datetime; default: real now).

    :raises TypeError: a value of the wrong type.
    :raises ValueError: a bad value (a naive datetime, a negative grace, …).
    """
    _check_clock_args("virtual_time", wall_start, thread_grace, idle_timeout)
    return pytest.mark.virtual_time(
        wall_start=wall_start, thread_grace=thread_grace, idle_timeout=idle_timeout
    )


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


def _clock_args(item: pytest.Function) -> dict[str, Any] | str:
    """The closest ``virtual_time`` marker's arguments for ``run``, checked; or what is
    wrong with them."""
    mark = item.get_closest_marker("virtual_time")
    if mark is None:
        return {}
    if mark.args:
        return "virtual_time takes keyword arguments only (wall_start, thread_grace, idle_timeout)"
    unknown = sorted(set(mark.kwargs) - set(_CLOCK_ARGS))
    if unknown:
        return (
            f"virtual_time has no argument {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(_CLOCK_ARGS)}"
        )
    args = {"wall_start": None, "thread_grace": 2.0, "idle_timeout": 30.0, **mark.kwargs}
    try:
        wall_start, grace, idle = _check_clock_args(
            "virtual_time", args["wall_start"], args["thread_grace"], args["idle_timeout"]
        )
    except (TypeError, ValueError) as exc:
        return str(exc)
    return {"wall_start": wall_start, "thread_grace": grace, "idle_timeout": idle}


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
        args = _clock_args(item) if virtual else {}
        if isinstance(args, str):
            item.obj = _failing(fn, f"{item.nodeid}: {args}")
        else:
            item.obj = _on_loop(fn, functools.partial(run, **args), "virtual")


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
