"""Contract: the public names of envq — present, documented, typed."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest

import envq

REQUIRED = {
    "Queue",
    "Envelope",
    "QueueState",
    "EnvState",
    "Outcome",
    "StopMode",
    "StopReport",
    "Statistics",
    "Event",
    "Retry",
    "HookTimeout",
    "Decision",
    "drop",
    "retry_now",
    "retry_after",
    "FIXED_DELAY",
    "FIXED_RATE",
    "logging_stamp",
    "EnvqError",
    "BadEnvelope",
    "BadIntervals",
    "CapacityExceeded",
    "QueueNotRunning",
    "QueueStopping",
    "QueueTerminated",
    "QueueShuttingDown",
    "TypeBlacklisted",
    "MaxRetriesExceeded",
    "AlreadyComplete",
    "StopEnvelope",
    "StopType",
    "DoNotRetry",
}
ERRORS = [
    "EnvqError",
    "BadEnvelope",
    "BadEnvelopeType",
    "BadIntervals",
    "CapacityExceeded",
    "QueueNotRunning",
    "QueueStopping",
    "QueueTerminated",
    "QueueShuttingDown",
    "TypeBlacklisted",
    "MaxRetriesExceeded",
    "AlreadyComplete",
    "StopEnvelope",
    "StopType",
    "DoNotRetry",
]


class TestExports:
    def test_required_names_exported(self) -> None:
        """__all__ lists every public name the contract fixes."""
        missing = REQUIRED - set(envq.__all__)
        assert not missing, sorted(missing)

    def test_all_has_no_duplicates(self) -> None:
        """__all__ names each export once, as strings."""
        assert all(isinstance(name, str) for name in envq.__all__)
        assert len(envq.__all__) == len(set(envq.__all__))

    @pytest.mark.parametrize("name", sorted(envq.__all__))
    def test_name_exists(self, name: str) -> None:
        """Every name in __all__ is an attribute of the package."""
        assert hasattr(envq, name)

    @pytest.mark.parametrize("name", sorted(envq.__all__))
    def test_name_documented(self, name: str) -> None:
        """Every name in __all__ has a non-empty docstring (a type alias, which cannot
        carry one, is documented in the package docstring)."""
        obj = getattr(envq, name)
        if typing.get_origin(obj) is not None:
            assert f"``{name}``" in (envq.__doc__ or ""), f"alias envq.{name} undocumented"
            return
        doc = inspect.getdoc(obj)
        assert doc, f"envq.{name} has no docstring"
        assert doc.strip()

    def test_star_import(self) -> None:
        """`from envq import *` binds exactly the names in __all__."""
        namespace: dict[str, object] = {}
        exec("from envq import *", namespace)
        namespace.pop("__builtins__", None)
        assert set(namespace) == set(envq.__all__)
        for name, value in namespace.items():
            assert value is getattr(envq, name)

    def test_py_typed(self) -> None:
        """The package ships the PEP 561 marker envq/py.typed."""
        assert (Path(envq.__file__).parent / "py.typed").is_file()

    def test_package_docstring(self) -> None:
        """The package itself has a docstring."""
        assert inspect.getdoc(envq)

    def test_schedule_constants(self) -> None:
        """FIXED_DELAY and FIXED_RATE are distinct values."""
        assert len({envq.FIXED_DELAY, envq.FIXED_RATE}) == 2

    @pytest.mark.parametrize("name", ERRORS, ids=str)
    def test_errors_are_exception_classes(self, name: str) -> None:
        """Every exported error and control signal is an exception class."""
        obj = getattr(envq, name)
        assert isinstance(obj, type)
        assert issubclass(obj, Exception)
