"""The decisions both stores take from :mod:`envq._rules`, over every input class: no
policy, an unlimited one, and a limited one before, at and past its last attempt."""

from __future__ import annotations

import pytest

import envq
from envq._machine import (
    BROADCASTS,
    LIVE_STATES,
    QUEUE_MOVES,
    DecisionKind,
    EnvEvent,
    EnvState,
    LifeAction,
    moved_by,
)
from envq._rules import (
    Failure,
    Room,
    by_policy,
    exhausted,
    failure,
    failures_in_a_row,
    hook_number,
    refusal,
    room,
)
from envq.postgres import _moves, schema

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


def _stores() -> list[tuple[str, str]]:
    """Every runtime module of envq but the rules layer, with its text."""
    from pathlib import Path  # noqa: PLC0415

    root = Path(envq.__file__).parent
    skip = {root / "_rules.py", root / "_values.py", root / "_schedule.py"}
    return [
        (str(path.relative_to(root)), path.read_text())
        for path in sorted(root.rglob("*.py"))
        if path not in skip and "conform" not in path.parts and "demo" not in path.parts
    ]


def test_both_stores_call_the_rules_and_decide_no_retry_themselves() -> None:
    """The retry decision is not written again in either store: both decide a failed
    attempt with ``failure``, and no module of envq's runtime but the rules layer
    (and ``Retry`` itself) calls ``Retry.allows`` or ``Retry.delay`` or builds a
    ``MaxRetriesExceeded``."""
    import re  # noqa: PLC0415

    texts = dict(_stores())
    for name in ("_outcomes.py", "postgres/_ends.py"):
        assert "failure(" in texts[name], name
    for name, text in texts.items():
        assert ".allows(" not in text, name
        assert "retry.delay(" not in text, name
        assert not re.search(r"(?<!class )MaxRetriesExceeded\(", text), name
        assert "by_policy(" not in text, name


def test_the_walk_sees_both_stores() -> None:
    """The walk above reads both stores' modules (a walk that read none would pass)."""
    names = {name for name, _text in _stores()}
    assert {"_outcomes.py", "postgres/_ends.py", "postgres/_node.py", "_queue.py"} <= names
    assert "_rules.py" not in names


_LATE = Failure(None, next_run=True, failures=5)


@pytest.mark.parametrize(
    ("periodic", "hooked", "retry", "attempt", "failures", "expected"),
    [
        # A hook decides whenever there is one: called with the attempt's number...
        (False, True, None, 1, 0, Failure(1)),
        (False, True, LIMITED, 3, 0, Failure(3)),  # ...even past the policy's last
        # ...or a periodic envelope's failures in a row, this run's included.
        (True, True, None, 9, 0, Failure(1, failures=1)),
        (True, True, LIMITED, 2, 4, Failure(5, failures=5)),
        # No hook: a periodic run waits for its schedule, whatever its policy.
        (True, False, None, 1, 4, _LATE),
        (True, False, UNLIMITED, 1, 4, _LATE),
        # No hook, one-off: the policy, and spent once it allows no more.
        (False, False, None, 1, 0, Failure(None)),
        (False, False, LIMITED, 1, 0, Failure(None, DecisionKind.RETRY_AFTER, 1.0)),
        (False, False, LIMITED, 2, 0, Failure(None, DecisionKind.RETRY_AFTER, 2.0)),
        (False, False, LIMITED, 3, 0, Failure(None, spent=True)),
        (False, False, LIMITED, 4, 0, Failure(None, spent=True)),
        (False, False, UNLIMITED, 100, 0, Failure(None, DecisionKind.RETRY_AFTER, 4.0)),
    ],
)
def test_how_a_failed_attempt_is_decided(
    periodic: bool,
    hooked: bool,
    retry: envq.Retry | None,
    attempt: int,
    failures: int,
    expected: Failure,
) -> None:
    got = failure(periodic=periodic, hooked=hooked, retry=retry, attempt=attempt, failures=failures)
    assert got == expected
    # Exactly one decides: the hook, the schedule, or the policy.
    assert (got.hook is not None) + got.next_run <= 1
    assert not got.spent or (got.decision is None and got.hook is None)
    # spent says what exhausted reports.
    error = exhausted("queue 'q'", "e", retry, attempt, RuntimeError("x"))
    if not periodic and not hooked:
        assert got.spent == isinstance(error, envq.MaxRetriesExceeded)


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

    for name, text in _stores():
        assert "failures_in_a_row(" not in text, name
        assert not re.search(r"failures\"?\]?\)? \+ 1", text), name


@pytest.mark.parametrize(
    ("live", "fresh", "capacity", "expected"),
    [
        (0, 5, 0, Room.FITS),  # no capacity
        (9, 0, 3, Room.FITS),  # nothing new (every envelope a dedup)
        (0, 3, 3, Room.FITS),  # exactly full
        (1, 2, 3, Room.FITS),
        (2, 2, 3, Room.FULL),  # an end may free room
        (3, 1, 3, Room.FULL),
        (0, 4, 3, Room.NEVER),  # no end ever frees enough
        (2, 4, 3, Room.NEVER),
    ],
)
def test_whether_a_batch_fits_the_capacity(
    live: int, fresh: int, capacity: int, expected: Room
) -> None:
    assert room(live, fresh, capacity) is expected
    # Producers waiting ahead change only a batch that would fit: it goes behind them.
    behind = room(live, fresh, capacity, waiting=True)
    if expected is Room.FITS and capacity and fresh:
        assert behind is Room.BEHIND
    else:
        assert behind is expected


def test_the_words_of_a_capacity_refusal() -> None:
    assert refusal(Room.FULL, 2, 2, 3) == "no room for 2 envelope(s): 2 of 3 used"
    assert (
        refusal(Room.FULL, 2, 2, 3, doing="retry") == "no room to retry 2 envelope(s): 2 of 3 used"
    )
    assert (
        refusal(Room.NEVER, 0, 4, 3)
        == "a batch of 4 new envelope(s) can never fit the capacity of 3"
    )
    assert (
        refusal(Room.BEHIND, 1, 1, 2)
        == "producers are waiting in send_wait for 1 envelope(s): 1 of 2 used"
    )


def test_both_stores_refuse_a_batch_with_the_rules_words() -> None:
    """Neither store words a capacity refusal, or compares a batch with the capacity
    on its refusal path, by itself."""
    from pathlib import Path  # noqa: PLC0415

    root = Path(envq.__file__).parent
    for path in (root / "_admission.py", root / "postgres" / "_edges.py"):
        text = path.read_text()
        assert "refusal(" in text, path
        assert "can never fit the capacity" not in text, path


async def test_a_batch_that_never_fits_is_refused_in_the_rules_words_in_process() -> None:
    """A plain send of more new envelopes than the capacity: NEVER's words (the
    PostgreSQL store's test of the same is in tests/postgres/test_pg_api_checks.py)."""
    q = envq.Queue("cap", workers=1, capacity=2)
    batch = [envq.Envelope(invoke=_noop) for _ in range(3)]
    with pytest.raises(envq.CapacityExceeded) as caught:
        q.send(*batch)
    assert refusal(Room.NEVER, 0, 3, 2) in str(caught.value)
    await q.terminate()


async def _noop() -> None:
    pass


class TestBroadcasts:
    """Which envelopes a lifecycle call moves: one table both stores read."""

    def test_a_stop_escalated_parks_as_a_stop_begun(self) -> None:
        assert BROADCASTS[LifeAction.ESCALATE] == BROADCASTS[LifeAction.BEGIN_STOP]

    def test_every_event_broadcast_has_rows_to_follow(self) -> None:
        for action, events in BROADCASTS.items():
            for event in events:
                moved = {state for (state, ev) in QUEUE_MOVES if ev is event}
                assert moved & LIVE_STATES, (action, event)

    def test_an_action_that_moves_no_envelope_is_not_listed(self) -> None:
        quiet = {LifeAction.NOTHING, LifeAction.REJECT, LifeAction.AWAIT_STOP}
        quiet |= {LifeAction.FINISH_STOP, LifeAction.BUFFER, LifeAction.ADMIT}
        # Performed as their two steps, each of which is listed.
        quiet |= {LifeAction.STOP_THEN_TERMINATE, LifeAction.ESCALATE_THEN_TERMINATE}
        assert not quiet & set(BROADCASTS)
        assert set(BROADCASTS) | quiet == set(LifeAction)

    def test_a_start_arms_what_a_stop_parked_and_the_buffer(self) -> None:
        """The states a start arms (each with the wait it had left): the buffered and
        parked envelopes; the PostgreSQL store's statements name the same states."""
        armed = moved_by(EnvEvent.START)
        assert armed == {EnvState.BUFFERED, EnvState.PARKED}
        assert armed == {s for (s, ev) in QUEUE_MOVES if ev is EnvEvent.START}
        assert armed.isdisjoint(moved_by(EnvEvent.SEND) - {EnvState.NEW})
        listed = {s.strip("' ") for s in _moves._ARMED_BY_START.split(",")}
        assert listed == {s.value for s in armed}
        sql = schema.render()
        assert f"AND e.state IN ({', '.join(sorted(repr(s.value) for s in armed))})" in sql
