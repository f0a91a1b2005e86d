"""The Envelope (docs/concepts.md) — construction, validation, frozen fields, evolve, identity."""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import envq
from envq._checks import is_async_callable
from tests.support import assert_names

SECONDS_FIELDS = ("interval", "deadline", "delay")
HOOK_FIELDS = ("before", "after", "on_failure", "on_success")
Invoker = Callable[[envq.Envelope], Awaitable[None]]
FROZEN_FIELDS = (
    "invoke",
    "id",
    "type",
    "interval",
    "deadline",
    "before",
    "after",
    "on_failure",
    "on_success",
    "stamps",
    "retry",
    "delay",
    "not_before",
    "schedule",
)


async def work(env: envq.Envelope) -> None:
    """An async invoke that does nothing."""


def sync_work(env: envq.Envelope) -> None:
    """A plain invoke that does nothing."""


def make(**kwargs: Any) -> envq.Envelope:
    """An envelope with a valid invoke unless the caller gives one."""
    kwargs.setdefault("invoke", work)
    return envq.Envelope(**kwargs)


#: Values that are not a valid number of seconds: negative, NaN, infinite.
bad_seconds = st.one_of(
    st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    st.integers(max_value=-1),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)
#: Values that are not numbers (nor timedeltas) at all.
not_numbers = st.one_of(
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.just(object()),
    st.just({}),
)
#: Values that are not callable.
not_callables = st.one_of(
    st.integers(),
    st.text(max_size=5),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=2),
)


class TestEnvelopeConstruction:
    def test_defaults(self) -> None:
        """An envelope made with only invoke has the documented defaults."""
        env = make()
        assert env.invoke is work
        assert env.id is None
        assert env.type == ""
        assert env.interval == 0
        assert env.deadline == 0
        assert env.delay == 0
        assert env.before is None
        assert env.after is None
        assert env.on_failure is None
        assert env.on_success is None
        assert tuple(env.stamps) == ()
        assert env.payload is None
        assert env.retry is None
        assert env.not_before is None
        assert env.schedule is envq.FIXED_DELAY

    def test_every_field_is_kept(self) -> None:
        """Every field given at construction reads back as given."""

        async def hook(env: envq.Envelope) -> None:
            """A hook."""

        def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> None:
            """A failure hook."""

        def stamp(nxt: Invoker) -> Invoker:
            return nxt

        retry = envq.Retry(attempts=5, base=1, cap=600, jitter=False)
        when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
        payload = {"to": "a@b"}
        env = envq.Envelope(
            invoke=sync_work,
            id=7,
            type="email",
            interval=10,
            deadline=3,
            before=hook,
            after=hook,
            on_failure=on_failure,
            on_success=hook,
            stamps=[stamp],
            payload=payload,
            delay=2.5,
            not_before=when,
            schedule=envq.FIXED_RATE,
        )
        assert env.invoke is sync_work
        assert (env.id, env.type) == (7, "email")
        assert (env.interval, env.deadline, env.delay) == (10.0, 3.0, 2.5)
        assert env.before is hook
        assert env.after is hook
        assert env.on_failure is on_failure
        assert env.on_success is hook
        assert tuple(env.stamps) == (stamp,)
        assert env.payload is payload
        assert env.not_before == when
        assert env.schedule is envq.FIXED_RATE
        # retry goes only on a one-off envelope without on_failure (see the refusals).
        assert envq.Envelope(invoke=sync_work, retry=retry).retry is retry

    @pytest.mark.parametrize("field", SECONDS_FIELDS)
    def test_timedelta_means_seconds(self, field: str) -> None:
        """A timedelta for interval/deadline/delay is read as its number of seconds."""
        kwargs: dict[str, Any] = {field: dt.timedelta(minutes=1, milliseconds=500)}
        if field == "deadline":
            kwargs["interval"] = 100
        env = make(**kwargs)
        assert getattr(env, field) == pytest.approx(60.5)

    @given(
        field=st.sampled_from(SECONDS_FIELDS),
        value=st.one_of(
            st.integers(min_value=0, max_value=10**6),
            st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False),
        ),
    )
    def test_finite_non_negative_numbers_accepted(self, field: str, value: float) -> None:
        """Any finite non-negative int or float is accepted for interval/deadline/delay
        (an interval: 0 or at least a microsecond)."""
        assume(field != "interval" or value == 0 or value >= 1e-6)
        kwargs: dict[str, Any] = {field: value}
        if field == "deadline":
            kwargs["interval"] = 0
        env = make(**kwargs)
        assert getattr(env, field) == pytest.approx(value)

    def test_plain_and_async_invoke_accepted(self) -> None:
        """invoke may be an async def or a plain def."""
        assert make(invoke=work).invoke is work
        assert make(invoke=sync_work).invoke is sync_work

    def test_deadline_equal_to_interval_allowed(self) -> None:
        """A periodic envelope whose deadline equals its interval is valid."""
        env = make(interval=5, deadline=5)
        assert (env.interval, env.deadline) == (5.0, 5.0)

    def test_one_off_deadline_unbounded_by_interval(self) -> None:
        """A one-off envelope (interval 0) may have any deadline."""
        assert make(interval=0, deadline=1000).deadline == 1000.0

    def test_aware_not_before_accepted(self) -> None:
        """An aware datetime is accepted as not_before."""
        when = dt.datetime(2030, 5, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2)))
        assert make(not_before=when).not_before == when


class TestEnvelopeValidation:
    def test_invoke_missing(self) -> None:
        """An envelope without invoke raises BadEnvelope naming invoke."""
        with pytest.raises(envq.BadEnvelope) as info:
            envq.Envelope()  # type: ignore[call-arg]
        assert_names(info.value, "invoke")

    def test_invoke_none(self) -> None:
        """invoke=None raises BadEnvelope naming invoke."""
        with pytest.raises(envq.BadEnvelope) as info:
            envq.Envelope(invoke=None)  # type: ignore[arg-type]
        assert_names(info.value, "invoke")

    @given(value=not_callables)
    def test_invoke_not_callable(self, value: object) -> None:
        """A non-callable invoke raises BadEnvelope naming invoke and the value."""
        with pytest.raises(envq.BadEnvelope) as info:
            envq.Envelope(invoke=value)  # type: ignore[arg-type]
        assert_names(info.value, "invoke", repr(value))

    @given(field=st.sampled_from(SECONDS_FIELDS), value=bad_seconds)
    def test_bad_seconds(self, field: str, value: float) -> None:
        """A negative, NaN or infinite interval/deadline/delay raises BadEnvelope naming it."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(**{field: value})
        assert_names(info.value, field, repr(value))

    @given(field=st.sampled_from(SECONDS_FIELDS), value=not_numbers)
    def test_non_number_seconds(self, field: str, value: object) -> None:
        """A non-number interval/deadline/delay raises BadEnvelope naming the field."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(**{field: value})
        assert_names(info.value, field, repr(value))

    @pytest.mark.parametrize("field", SECONDS_FIELDS)
    def test_negative_timedelta(self, field: str) -> None:
        """A negative timedelta raises BadEnvelope naming the field and the value."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(**{field: dt.timedelta(seconds=-5)})
        assert_names(info.value, field, "-5")

    @given(
        interval=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
        excess=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
    )
    def test_deadline_over_interval(self, interval: float, excess: float) -> None:
        """A periodic envelope with deadline > interval raises BadIntervals naming both."""
        deadline = interval + excess
        assert deadline > interval
        with pytest.raises(envq.BadIntervals) as info:
            make(interval=interval, deadline=deadline)
        assert isinstance(info.value, envq.BadEnvelope)
        assert_names(info.value, "deadline", "interval")

    @given(
        interval=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
        share=st.floats(min_value=0, max_value=1),
    )
    def test_deadline_within_interval(self, interval: float, share: float) -> None:
        """A periodic envelope with deadline ≤ interval is valid."""
        deadline = min(interval, interval * share)
        env = make(interval=interval, deadline=deadline)
        assert env.deadline <= env.interval

    def test_naive_not_before(self) -> None:
        """A naive datetime as not_before raises BadEnvelope naming the field."""
        naive = dt.datetime(2030, 1, 1)
        with pytest.raises(envq.BadEnvelope) as info:
            make(not_before=naive)
        assert_names(info.value, "not_before", repr(naive))

    @given(value=st.one_of(st.integers(), st.text(max_size=5), st.just(dt.date(2030, 1, 1))))
    def test_not_before_not_datetime(self, value: object) -> None:
        """A not_before that is not a datetime raises BadEnvelope naming the field."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(not_before=value)
        assert_names(info.value, "not_before", repr(value))

    @given(field=st.sampled_from(HOOK_FIELDS), value=not_callables)
    def test_hook_not_callable(self, field: str, value: object) -> None:
        """A hook that is neither callable nor None raises BadEnvelope naming it."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(**{field: value})
        assert_names(info.value, field, repr(value))

    @given(value=not_callables)
    def test_stamp_not_callable(self, value: object) -> None:
        """A stamps sequence holding a non-callable raises BadEnvelope naming stamps."""

        def stamp(nxt: Invoker) -> Invoker:
            return nxt

        with pytest.raises(envq.BadEnvelope) as info:
            make(stamps=[stamp, value])
        assert_names(info.value, "stamps", repr(value))

    @pytest.mark.parametrize("value", [5, 1.5, object()])
    def test_stamps_not_a_sequence(self, value: object) -> None:
        """stamps that is not a sequence raises BadEnvelope naming stamps."""
        with pytest.raises(envq.BadEnvelope) as info:
            make(stamps=value)
        assert_names(info.value, "stamps")

    def test_retry_beside_on_failure_is_refused(self) -> None:
        """on_failure decides every failure, so a retry policy beside it could never
        apply: refused at construction (and by evolve), naming both parameters."""

        def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> None:
            """A failure hook."""

        retry = envq.Retry(attempts=4)
        with pytest.raises(envq.BadEnvelope) as info:
            make(retry=retry, on_failure=on_failure)
        assert isinstance(info.value, ValueError)
        assert_names(info.value, "retry", "on_failure")
        with pytest.raises(envq.BadEnvelope, match="on_failure"):
            make(retry=retry).evolve(on_failure=on_failure)

    @pytest.mark.parametrize(
        "periodic",
        [{"interval": 60}, {"interval": 1, "schedule": envq.FIXED_RATE}, {"cron": True}],
        ids=["interval", "fixed-rate", "cron"],
    )
    def test_retry_on_a_periodic_envelope_is_refused(self, periodic: dict[str, Any]) -> None:
        """A periodic envelope goes on with its schedule after a failure: a retry policy
        on it could never apply, so it is refused, naming retry and the schedule."""
        fields = dict(periodic)
        if fields.pop("cron", False):
            pytest.importorskip("cronsim")
            fields["schedule"] = envq.Cron("0 3 * * *")
        with pytest.raises(envq.BadEnvelope) as info:
            make(retry=envq.Retry(attempts=4), **fields)
        assert_names(info.value, "retry", "periodic")
        with pytest.raises(envq.BadEnvelope, match="retry"):
            make(**fields).evolve(retry=envq.Retry())

    def test_bad_envelope_is_value_error(self) -> None:
        """Validation errors can be caught as ValueError."""
        with pytest.raises(ValueError, match="delay"):
            make(delay=-1)


class TestEnvelopeFrozen:
    @pytest.mark.parametrize("field", FROZEN_FIELDS)
    def test_schedule_fields_frozen(self, field: str) -> None:
        """Assigning any field other than payload raises FrozenAttributeError, value kept."""
        env = make(interval=10, deadline=1, type="t", id=1)
        before = getattr(env, field)
        with pytest.raises(attrs.exceptions.FrozenAttributeError):
            setattr(env, field, before)
        with pytest.raises(attrs.exceptions.FrozenAttributeError):
            setattr(env, field, None)
        assert getattr(env, field) is before

    def test_payload_assignable(self) -> None:
        """payload may be replaced after construction."""
        env = make(payload=1)
        env.payload = {"n": 2}
        assert env.payload == {"n": 2}
        env.payload = None
        assert env.payload is None


class TestEnvelopeEvolve:
    def test_evolve_applies_changes_on_a_copy(self) -> None:
        """evolve returns a new envelope with the changes; the original is unchanged."""
        env = make(id=1, type="a", interval=10, deadline=2, payload="p")
        copy = env.evolve(interval=20, type="b")
        assert copy is not env
        assert (copy.interval, copy.type) == (20.0, "b")
        assert (copy.id, copy.deadline, copy.invoke) == (1, 2.0, work)
        assert copy.payload == "p"
        assert (env.interval, env.type) == (10.0, "a")

    def test_evolve_without_changes_is_new_identity(self) -> None:
        """evolve() with no changes still returns a distinct, unequal envelope."""
        env = make()
        copy = env.evolve()
        assert copy is not env
        assert copy != env

    @pytest.mark.parametrize("field", SECONDS_FIELDS)
    def test_evolve_validates(self, field: str) -> None:
        """evolve with a bad value raises BadEnvelope naming the field and value."""
        env = make()
        with pytest.raises(envq.BadEnvelope) as info:
            env.evolve(**{field: -3})
        assert_names(info.value, field, "-3")

    def test_evolve_checks_intervals(self) -> None:
        """evolve that makes deadline exceed interval raises BadIntervals."""
        env = make(interval=10, deadline=5)
        with pytest.raises(envq.BadIntervals):
            env.evolve(deadline=11)
        with pytest.raises(envq.BadIntervals):
            env.evolve(interval=4)

    def test_evolve_accepts_timedelta(self) -> None:
        """evolve converts a timedelta like the constructor."""
        assert make().evolve(delay=dt.timedelta(seconds=90)).delay == 90.0

    def test_evolve_rejects_non_callable_invoke(self) -> None:
        """evolve(invoke=...) with a non-callable raises BadEnvelope."""
        with pytest.raises(envq.BadEnvelope, match="invoke"):
            make().evolve(invoke=3)


class TestEnvelopeIdentity:
    def test_equal_fields_are_not_equal(self) -> None:
        """Two envelopes with identical fields are different (equality is identity)."""
        a = make(id=1, type="t")
        b = make(id=1, type="t")
        assert a != b
        assert a == a  # noqa: PLR0124 - identity equality is the point

    def test_hashable_by_identity(self) -> None:
        """Envelopes are hashable; equal-looking ones are distinct set members."""
        a = make(id=1)
        b = make(id=1)
        assert len({a, b, a}) == 2
        assert {a: 1}[a] == 1

    def test_hash_stable_when_payload_changes(self) -> None:
        """Replacing the payload keeps the envelope's hash and its place in a set."""
        env = make(payload=[1])
        members = {env}
        h = hash(env)
        env.payload = [2]
        assert hash(env) == h
        assert env in members


class TestAsyncCallables:
    """Which callables envq awaits: what a worker does with ``invoke`` and the hooks."""

    @staticmethod
    def _kinds() -> list[tuple[str, object, bool]]:
        async def coro(env: object) -> None:
            """async def."""

        def plain(env: object) -> None:
            """def."""

        class AsyncCall:
            async def __call__(self, env: object) -> None:
                """An object whose __call__ is async def."""

        kinds: list[tuple[str, object, bool]] = [
            ("async def", coro, True),
            ("def", plain, False),
            ("partial of async def", functools.partial(coro), True),
            ("partial of def", functools.partial(plain), False),
            ("object with async __call__", AsyncCall(), True),
            ("class with async __call__", AsyncCall, False),
            ("None", None, False),
        ]
        mark = getattr(inspect, "markcoroutinefunction", None)  # CPython 3.12+
        if mark is not None:

            def marked(env: object) -> Any:
                """A plain function marked as a coroutine function."""

            kinds.append(("def marked as a coroutine function", mark(marked), True))
        return kinds

    def test_each_kind(self) -> None:
        """Each kind of callable is told async or plain as ``inspect`` tells it."""
        told = {name: is_async_callable(fn) for name, fn, _ in self._kinds()}
        assert told == {name: expected for name, _, expected in self._kinds()}
