"""envq.pytest_plugin in a user's project: opt-in virtual time, beside pytest-asyncio
(auto and strict modes) and anyio, with a warning when another plugin owns a test.

Each case runs pytest in a subprocess on a small project of its own (a ``pytest.ini``
and a test module), as a user would, and reads the outcome from pytest's summary.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEADER = """\
import asyncio

import pytest

from envq.testing import VirtualTimeLoop


def on_virtual_time() -> bool:
    return isinstance(asyncio.get_running_loop(), VirtualTimeLoop)
"""


def pytester(tmp_path: Path, ini: str, tests: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run pytest on a project made of ``pytest.ini`` (the ``[pytest]`` section's
    lines) and ``test_user.py`` (``HEADER`` + ``tests``)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n" + textwrap.dedent(ini))
    (tmp_path / "test_user.py").write_text(HEADER + textwrap.dedent(tests))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def counts(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """pytest's closing line as {"passed": n, "failed": n, ...}."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("=")]
    assert lines, proc.stdout + proc.stderr
    found = re.findall(r"(\d+) (passed|failed|errors?|warnings?|skipped)", lines[-1])
    return {kind.rstrip("s") if kind != "passed" else kind: int(n) for n, kind in found}


PLUGIN = "addopts = -p envq.pytest_plugin --strict-markers\n"
AUTO = PLUGIN + "asyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"

MIXED = """
@pytest.mark.virtual_time
async def test_marked_sleeps_an_hour_on_virtual_time():
    assert on_virtual_time()
    loop = asyncio.get_running_loop()
    await asyncio.sleep(3600)
    assert loop.time() == 3600


async def test_unmarked():
    assert on_virtual_time() is {unmarked_virtual}
"""


def test_marker_takes_its_test_from_pytest_asyncio_auto_mode(tmp_path: Path) -> None:
    # Before, pytest-asyncio's auto mode ran every async test on a real loop (an hour of
    # sleep took an hour); now a test marked virtual_time is envq's, the rest stay its.
    proc = pytester(tmp_path, AUTO, MIXED.format(unmarked_virtual=False))
    assert counts(proc) == {"passed": 2}, proc.stdout


def test_option_all_takes_every_unclaimed_async_test_from_auto_mode(tmp_path: Path) -> None:
    proc = pytester(
        tmp_path, AUTO + "envq_virtual_time = all\n", MIXED.format(unmarked_virtual=True)
    )
    assert counts(proc) == {"passed": 2}, proc.stdout


def test_option_all_warns_about_a_test_another_plugin_owns(tmp_path: Path) -> None:
    tests = """
    @pytest.mark.asyncio
    async def test_owned_by_pytest_asyncio():
        assert not on_virtual_time()
    """
    proc = pytester(tmp_path, AUTO + "envq_virtual_time = all\n", tests)
    assert counts(proc) == {"passed": 1, "warning": 1}, proc.stdout
    assert "EnvqPluginWarning" in proc.stdout
    assert "falls under envq_virtual_time = all, but pytest-asyncio (marker 'asyncio') runs it" in (
        proc.stdout
    )


def test_virtual_time_and_another_plugins_marker_warns(tmp_path: Path) -> None:
    tests = """
    @pytest.mark.virtual_time
    @pytest.mark.asyncio
    async def test_both():
        assert not on_virtual_time()
    """
    proc = pytester(tmp_path, PLUGIN + "asyncio_default_fixture_loop_scope = function\n", tests)
    assert counts(proc) == {"passed": 1, "warning": 1}, proc.stdout
    assert "is marked virtual_time, but pytest-asyncio (marker 'asyncio') runs it" in proc.stdout


def test_strict_mode_leaves_marked_tests_to_envq(tmp_path: Path) -> None:
    tests = """
    @pytest.mark.virtual_time
    async def test_envq():
        assert on_virtual_time()


    @pytest.mark.asyncio
    async def test_pytest_asyncio():
        assert not on_virtual_time()
    """
    ini = PLUGIN + "asyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
    proc = pytester(tmp_path, ini, tests)
    assert counts(proc) == {"passed": 2}, proc.stdout


ALONE = "addopts = -p envq.pytest_plugin -p no:asyncio -p no:anyio --strict-markers\n"


def test_unmarked_async_test_fails_saying_how_to_run_it(tmp_path: Path) -> None:
    tests = """
    async def test_unmarked():
        await asyncio.sleep(3600)
    """
    proc = pytester(tmp_path, ALONE, tests)
    assert counts(proc) == {"failed": 1}, proc.stdout
    assert "no plugin runs: mark it @pytest.mark.virtual_time" in proc.stdout


def test_markers_and_option_without_other_plugins(tmp_path: Path) -> None:
    tests = """
    @pytest.fixture
    def answer():
        return 42


    @pytest.mark.virtual_time
    class TestClass:
        @pytest.mark.parametrize("hours", [1, 2])
        async def test_method(self, hours, answer):
            assert on_virtual_time() and answer == 42
            await asyncio.sleep(hours * 3600)
            assert asyncio.get_running_loop().time() == hours * 3600


    @pytest.mark.real_clock
    async def test_real():
        assert not on_virtual_time()


    @pytest.mark.real_clock
    @pytest.mark.virtual_time
    async def test_both_clocks():
        pass


    @pytest.mark.virtual_time
    def test_sync_marked():
        pass


    class TestOptOut:
        pytestmark = pytest.mark.virtual_time

        @pytest.mark.real_clock
        async def test_own_marker_wins(self):
            assert not on_virtual_time()

        def test_sync_under_a_class_marker(self):
            pass
    """
    proc = pytester(tmp_path, ALONE, tests)
    assert counts(proc) == {"passed": 6, "failed": 1, "warning": 1}, proc.stdout
    assert "test_both_clocks is marked both virtual_time and real_clock" in proc.stdout
    assert "test_sync_marked is marked virtual_time but is not an 'async def'" in proc.stdout


def test_the_marker_sets_the_wall_clocks_start(tmp_path: Path) -> None:
    """``@pytest.mark.virtual_time(wall_start=...)`` (seconds or an aware datetime) and
    the typed ``envq.pytest_plugin.virtual_time(...)`` start the virtual wall clock
    there, so a cron job on a given date is an async test; bad arguments fail the
    test, saying why."""
    tests = """
    import datetime as dt

    import envq
    from envq.pytest_plugin import virtual_time
    from envq.testing import wall_time

    NEW_YEAR = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


    @pytest.mark.virtual_time(wall_start=NEW_YEAR.timestamp())
    async def test_seconds():
        assert wall_time() == NEW_YEAR.timestamp()


    @virtual_time(wall_start=NEW_YEAR - dt.timedelta(minutes=1))
    async def test_typed_with_a_datetime():
        runs = []

        async def tick(env):
            runs.append(dt.datetime.fromtimestamp(wall_time(), dt.UTC))

        async with envq.Queue("cron") as q:
            q.send(envq.Envelope(invoke=tick, schedule=envq.Cron("0 0 1 1 *")))
            await asyncio.sleep(120)
        assert runs == [NEW_YEAR]


    @pytest.mark.virtual_time
    class TestClassMarker:
        @pytest.mark.virtual_time(wall_start=0)
        async def test_own_marker_wins(self):
            assert wall_time() == 0


    @pytest.mark.virtual_time(wall_start=dt.datetime(2030, 1, 1))
    async def test_naive():
        pass


    @pytest.mark.virtual_time(wall_begin=0)
    async def test_unknown():
        pass
    """
    proc = pytester(tmp_path, ALONE, tests)
    assert counts(proc) == {"passed": 3, "failed": 2}, proc.stdout
    assert "virtual_time: wall_start must be an aware datetime" in proc.stdout
    assert "virtual_time has no argument 'wall_begin'" in proc.stdout


def test_a_bad_option_value_is_a_usage_error(tmp_path: Path) -> None:
    proc = pytester(tmp_path, ALONE + "envq_virtual_time = some\n", "")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR
    assert "envq_virtual_time must be one of marked, all, got 'some'" in proc.stderr


def test_anyio_route_runs_on_virtual_time(tmp_path: Path) -> None:
    # The route the testing page documents for anyio users (no envq plugin needed).
    tests = """
    @pytest.fixture
    def anyio_backend():
        return ("asyncio", {"loop_factory": VirtualTimeLoop})


    @pytest.mark.anyio
    async def test_anyio():
        assert on_virtual_time()
        await asyncio.sleep(3600)
        assert asyncio.get_running_loop().time() == 3600
    """
    proc = pytester(tmp_path, "addopts = -p no:asyncio --strict-markers\n", tests)
    assert counts(proc) == {"passed": 1}, proc.stdout


def test_pytest_asyncio_loop_factory_route_runs_on_virtual_time(tmp_path: Path) -> None:
    # The route the testing page documents for pytest-asyncio users.
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            from envq.testing import VirtualTimeLoop


            def pytest_asyncio_loop_factories(config, item):
                return {"virtual_time": VirtualTimeLoop}
            """
        )
    )
    tests = """
    async def test_auto():
        assert on_virtual_time()
        await asyncio.sleep(3600)
        assert asyncio.get_running_loop().time() == 3600
    """
    ini = "asyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    proc = pytester(tmp_path, ini, tests)
    assert counts(proc) == {"passed": 1}, proc.stdout
