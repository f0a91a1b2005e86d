"""The decisions both stores take from :mod:`envq._rules`, over every input class: no
policy, an unlimited one, and a limited one before, at and past its last attempt."""

from __future__ import annotations

import pytest

import envq
from envq._machine import DecisionKind
from envq._rules import by_policy, exhausted, failures_in_a_row, hook_number

LIMITED = envq.Retry(attempts=3, base=1.0, cap=30.0, jitter=False)
UNLIMITED = envq.Retry(attempts=-1, base=0.5, cap=4.0, jitter=False)


@pytest.mark.parametrize(
    ("retry", "attempt", "expected"),
    [
        (None, 1, (None, 0.0)),
        (None, 7, (None, 0.0)),
        (LIMITED, 1, (DecisionKind.RETRY_AFTER, 1.0)),
        (LIMITED, 2, (DecisionKind.RETRY_AFTER, 2.0)),
        (LIMITED, 3, (None, 0.0)),
        (LIMITED, 4, (None, 0.0)),
        (UNLIMITED, 1, (DecisionKind.RETRY_AFTER, 0.5)),
        (UNLIMITED, 100, (DecisionKind.RETRY_AFTER, 4.0)),
    ],
)
def test_a_policy_decides_a_one_off_failure(
    retry: envq.Retry | None, attempt: int, expected: tuple[DecisionKind | None, float]
) -> None:
    assert by_policy(retry, attempt) == expected


@pytest.mark.parametrize(("retry", "attempt"), [(None, 5), (LIMITED, 2), (UNLIMITED, 50)])
def test_the_attempts_own_error_is_reported_while_the_policy_allows_more(
    retry: envq.Retry | None, attempt: int
) -> None:
    cause = RuntimeError("boom")
    assert exhausted("queue 'q'", "mail/'m1'", retry, attempt, cause) is cause


@pytest.mark.parametrize("attempt", [3, 4])
def test_a_spent_policy_reports_max_retries_exceeded_chained_to_the_error(attempt: int) -> None:
    cause = RuntimeError("boom")
    error = exhausted("queue 'q'", "mail/'m1'", LIMITED, attempt, cause)
    assert isinstance(error, envq.MaxRetriesExceeded)
    assert str(error) == f"queue 'q': mail/'m1' failed {attempt} of 3 attempts"
    assert error.__cause__ is cause


def test_both_stores_call_the_rules_and_decide_no_retry_themselves() -> None:
    """The retry decision is not written again in either store: neither calls
    ``Retry.allows`` or builds a ``MaxRetriesExceeded`` outside envq._rules."""
    from pathlib import Path  # noqa: PLC0415

    root = Path(envq.__file__).parent
    for path in (root / "_outcomes.py", root / "postgres" / "_ends.py"):
        text = path.read_text()
        assert "by_policy(" in text, path
        assert ".allows(" not in text, path
        assert "MaxRetriesExceeded(" not in text, path


@pytest.mark.parametrize(
    ("periodic", "failures", "attempt", "number", "in_a_row"),
    [
        (True, 0, 1, 1, 1),  # a periodic envelope's first failure
        (True, 4, 9, 5, 5),  # its fifth in a row, whatever its runs
        (False, 0, 1, 1, 1),  # a one-off envelope's first attempt
        (False, 0, 3, 3, 1),  # a one-off's third attempt: its number, not a count
    ],
)
def test_the_number_a_hook_is_given_and_the_failures_in_a_row(
    periodic: bool, failures: int, attempt: int, number: int, in_a_row: int
) -> None:
    assert hook_number(periodic, failures, attempt) == number
    assert failures_in_a_row(failures) == in_a_row


def test_both_stores_count_a_periodic_failure_through_the_rules() -> None:
    """Neither store counts a periodic failure or numbers a hook's call by itself."""
    import re  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    root = Path(envq.__file__).parent
    for path in (root / "_outcomes.py", root / "postgres" / "_ends.py"):
        text = path.read_text()
        assert "failures_in_a_row(" in text, path
        assert "hook_number(" in text, path
        assert not re.search(r"failures\"?\]?\)? \+ 1", text), path
