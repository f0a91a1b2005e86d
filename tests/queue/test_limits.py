"""Rate limiters, the Retry policy, and the queue's use of them (docs/retries.md, docs/outcomes.md).

The limiters are checked against client-go's documented behaviour
(``k8s.io/client-go/util/workqueue/default_rate_limiters.go``) and
``golang.org/x/time/rate``'s ``Reserve().Delay()``, on the virtual clock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import envq
from envq import EnvState, Outcome
from envq.testing import run
from tests.support import Starts, gaps, now, raising, running


class Clock:
    """A hand-driven clock for limiters used outside an event loop."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Ends:
    """Collects the terminal event of every envelope of a queue."""

    TERMINAL = frozenset({EnvState.SUCCEEDED, EnvState.FAILED, EnvState.STOPPED})

    def __init__(self, queue: envq.Queue) -> None:
        self.events: dict[envq.Envelope, envq.Event] = {}
        queue.subscribe(self._on)

    def _on(self, event: envq.Event) -> None:
        if event.envelope is not None and event.to_state in self.TERMINAL:
            self.events[event.envelope] = event


# --------------------------------------------------------------------------------------
# The limiters on their own
# --------------------------------------------------------------------------------------


class TestExponentialBackoff:
    def test_doubles_from_base_up_to_cap(self) -> None:
        """when() returns base·2^n for the n-th earlier failure, capped (client-go's
        ItemExponentialFailureRateLimiter)."""
        lim = envq.ExponentialBackoff(1, 30)
        assert [lim.when("a") for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]

    def test_client_go_default_values(self) -> None:
        """The defaults are client-go's controller defaults: 5 ms doubling up to 1000 s."""
        lim = envq.ExponentialBackoff()
        delays = [lim.when("a") for _ in range(20)]
        assert delays[:4] == pytest.approx([0.005, 0.01, 0.02, 0.04])
        assert delays[-1] == 1000.0
        assert max(delays) == 1000.0

    def test_retries_count_and_forget_resets(self) -> None:
        """retries() is the number of failures recorded; forget() starts the envelope over."""
        lim = envq.ExponentialBackoff(1, 100)
        for _ in range(3):
            lim.when("a")
        assert lim.retries("a") == 3
        lim.forget("a")
        assert lim.retries("a") == 0
        assert lim.when("a") == 1

    def test_per_envelope(self) -> None:
        """Each envelope has its own failure count."""
        lim = envq.ExponentialBackoff(1, 100)
        lim.when("a")
        lim.when("a")
        assert lim.when("b") == 1
        assert lim.when("a") == 4
        assert (lim.retries("a"), lim.retries("b")) == (3, 1)

    def test_huge_failure_counts_stay_at_cap(self) -> None:
        """Thousands of failures never overflow: the delay stays at cap."""
        lim = envq.ExponentialBackoff(1, 30)
        for _ in range(5000):
            last = lim.when("a")
        assert last == 30

    @pytest.mark.parametrize(
        ("base", "cap"), [(0, 1), (-1, 1), (math.nan, 1), (1, math.inf), (1, 0), (10**400, 1)]
    )
    def test_bad_values(self, base: Any, cap: Any) -> None:
        """A non-positive, infinite, NaN or too large base or cap raises ValueError."""
        with pytest.raises(ValueError, match="ExponentialBackoff"):
            envq.ExponentialBackoff(base, cap)

    @pytest.mark.parametrize(("base", "cap"), [("1", 2), (True, 2), (1, None)])
    def test_bad_types(self, base: Any, cap: Any) -> None:
        """A base or cap that is not a number (a str, a bool, None) raises TypeError."""
        with pytest.raises(TypeError, match="ExponentialBackoff"):
            envq.ExponentialBackoff(base, cap)


class TestTokenBucket:
    def test_starts_full(self) -> None:
        """A fresh bucket lets ``burst`` requests through at once, then each waits 1/rate more
        (x/time/rate's Reserve().Delay())."""
        lim = envq.TokenBucket(rate=5, burst=10, clock=Clock())
        delays = [lim.when() for _ in range(13)]
        assert delays[:10] == [0] * 10
        assert delays[10:] == pytest.approx([0.2, 0.4, 0.6])

    def test_refills_at_rate(self) -> None:
        """Tokens come back at ``rate`` per second."""
        clock = Clock()
        lim = envq.TokenBucket(rate=5, burst=10, clock=clock)
        for _ in range(10):
            lim.when()
        clock.t = 1.0
        assert [lim.when() for _ in range(6)] == pytest.approx([0, 0, 0, 0, 0, 0.2])

    def test_refill_is_capped_at_burst(self) -> None:
        """However long the bucket rests, it holds at most ``burst`` tokens."""
        clock = Clock()
        lim = envq.TokenBucket(rate=5, burst=3, clock=clock)
        lim.when()
        clock.t = 1000.0
        assert [lim.when() for _ in range(4)] == pytest.approx([0, 0, 0, 0.2])

    def test_reservations_borrow_from_the_future(self) -> None:
        """A reservation made while empty pushes later ones back, and time pays it off."""
        clock = Clock()
        lim = envq.TokenBucket(rate=1, burst=1, clock=clock)
        assert [lim.when() for _ in range(3)] == [0, 1, 2]
        clock.t = 0.5
        assert lim.when() == pytest.approx(2.5)

    def test_clock_going_back_adds_nothing(self) -> None:
        """A clock that goes backwards neither adds nor removes tokens."""
        clock = Clock()
        clock.t = 10.0
        lim = envq.TokenBucket(rate=1, burst=2, clock=clock)
        lim.when()
        clock.t = 0.0
        assert lim.when() == 0
        assert lim.when() == pytest.approx(1)

    def test_shared_by_every_envelope(self) -> None:
        """forget() does nothing and retries() is always 0 (client-go's BucketRateLimiter)."""
        lim = envq.TokenBucket(rate=1, burst=1, clock=Clock())
        lim.when("a")
        lim.forget("b")
        assert lim.when("b") == 1
        assert lim.retries("a") == lim.retries("b") == 0

    async def test_long_run_rate_on_the_loop_clock(self) -> None:
        """Honouring every delay, 1000 requests take (1000 − burst) / rate seconds of loop time."""
        lim = envq.TokenBucket(rate=50, burst=20)
        start = now()
        for _ in range(1000):
            await asyncio.sleep(lim.when())
        assert now() - start == pytest.approx((1000 - 20) / 50)

    async def test_burst_after_a_rest(self) -> None:
        """After resting on the loop clock, a full burst passes with no wait."""
        lim = envq.TokenBucket(rate=2, burst=4)
        for _ in range(10):
            await asyncio.sleep(lim.when())
        await asyncio.sleep(60)
        assert [lim.when() for _ in range(5)] == pytest.approx([0, 0, 0, 0, 0.5])

    @pytest.mark.parametrize(
        ("rate", "burst"), [(0, 1), (-1, 1), (math.inf, 1), (math.nan, 1), (1, 0), (1, 10**400)]
    )
    def test_bad_values(self, rate: Any, burst: Any) -> None:
        """A non-positive, NaN or infinite rate, or a burst < 1 or beyond a float's exact
        range, raises ValueError."""
        with pytest.raises(ValueError, match="TokenBucket"):
            envq.TokenBucket(rate, burst)

    @pytest.mark.parametrize(("rate", "burst"), [("5", 1), (1, 1.5), (1, True), (None, 1)])
    def test_bad_types(self, rate: Any, burst: Any) -> None:
        """A rate that is not a number, or a burst that is not an int, raises TypeError."""
        with pytest.raises(TypeError, match="TokenBucket"):
            envq.TokenBucket(rate, burst)


class TestFastSlow:
    def test_fast_then_slow(self) -> None:
        """The first ``fast_attempts`` failures get ``fast``, later ones ``slow``
        (client-go's ItemFastSlowRateLimiter)."""
        lim = envq.FastSlow(fast=0.1, slow=5, fast_attempts=3)
        assert [lim.when("a") for _ in range(6)] == [0.1, 0.1, 0.1, 5, 5, 5]

    def test_forget_and_retries(self) -> None:
        """retries() counts failures per envelope; forget() makes it fast again."""
        lim = envq.FastSlow(fast=1, slow=9, fast_attempts=1)
        lim.when("a")
        lim.when("a")
        assert lim.retries("a") == 2
        assert lim.when("b") == 1
        lim.forget("a")
        assert lim.retries("a") == 0
        assert lim.when("a") == 1

    def test_zero_fast_attempts_is_always_slow(self) -> None:
        """With fast_attempts=0 every failure gets the slow delay."""
        lim = envq.FastSlow(fast=1, slow=9, fast_attempts=0)
        assert [lim.when("a") for _ in range(3)] == [9, 9, 9]

    @pytest.mark.parametrize(("fast", "slow", "n"), [(-1, 1, 1), (1, math.nan, 1), (1, 2, -1)])
    def test_bad_values(self, fast: Any, slow: Any, n: Any) -> None:
        """Negative or NaN delays and a negative fast_attempts raise ValueError."""
        with pytest.raises(ValueError, match="FastSlow"):
            envq.FastSlow(fast, slow, n)

    @pytest.mark.parametrize(("fast", "slow", "n"), [("1", 1, 1), (1, 2, 1.0), (1, 2, False)])
    def test_bad_types(self, fast: Any, slow: Any, n: Any) -> None:
        """A delay that is not a number or a fast_attempts that is not an int raise TypeError."""
        with pytest.raises(TypeError, match="FastSlow"):
            envq.FastSlow(fast, slow, n)


class TestMaxOf:
    def test_largest_answer_and_every_limiter_records(self) -> None:
        """when() is the largest of all answers, and every limiter counted the failure
        (client-go's MaxOfRateLimiter)."""
        exp = envq.ExponentialBackoff(1, 100)
        fs = envq.FastSlow(fast=3, slow=3, fast_attempts=0)
        lim = envq.MaxOf(exp, fs)
        assert [lim.when("a") for _ in range(4)] == [3, 3, 4, 8]
        assert exp.retries("a") == fs.retries("a") == 4

    def test_retries_is_the_max(self) -> None:
        """retries() is the largest count held by any limiter."""
        bucket = envq.TokenBucket(rate=1, burst=5, clock=Clock())
        exp = envq.ExponentialBackoff(1, 100)
        lim = envq.MaxOf(bucket, exp)
        lim.when("a")
        lim.when("a")
        assert lim.retries("a") == 2

    def test_forget_reaches_every_limiter(self) -> None:
        """forget() forgets the envelope in every limiter."""
        exp = envq.ExponentialBackoff(1, 100)
        fs = envq.FastSlow(fast=1, slow=2, fast_attempts=1)
        lim = envq.MaxOf(exp, fs)
        lim.when("a")
        lim.when("a")
        lim.forget("a")
        assert exp.retries("a") == fs.retries("a") == lim.retries("a") == 0

    def test_needs_limiters(self) -> None:
        """MaxOf() with nothing raises ValueError; with something that is not a limiter
        instance (a class included), TypeError."""
        with pytest.raises(ValueError, match="at least one"):
            envq.MaxOf()
        with pytest.raises(TypeError, match="when/forget/retries"):
            envq.MaxOf(envq.ExponentialBackoff(), object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="instance"):
            envq.MaxOf(envq.TokenBucket)  # type: ignore[arg-type]

    def test_is_a_rate_limiter(self) -> None:
        """Every limiter, MaxOf and FastSlow included, satisfies the RateLimiter protocol."""
        for lim in (
            envq.MaxOf(envq.ExponentialBackoff()),
            envq.FastSlow(1, 2, 3),
            envq.TokenBucket(1),
            envq.ExponentialBackoff(),
            envq.default_limiter(),
        ):
            assert isinstance(lim, envq.RateLimiter)


class TestDefaultLimiter:
    def test_composition(self) -> None:
        """default_limiter() is MaxOf(ExponentialBackoff(1 s, 30 s), TokenBucket(5/s, burst 10))."""
        lim = envq.default_limiter()
        exp, bucket = lim.limiters
        assert isinstance(exp, envq.ExponentialBackoff)
        assert (exp.base, exp.cap) == (1.0, 30.0)
        assert isinstance(bucket, envq.TokenBucket)
        assert (bucket.rate, bucket.burst) == (5.0, 10)

    def test_fresh_each_call(self) -> None:
        """Each call makes new limiter objects (no state shared between queues)."""
        a, b = envq.default_limiter(), envq.default_limiter()
        assert a is not b
        assert a.limiters[0] is not b.limiters[0]

    async def test_one_envelope_backs_off_exponentially(self) -> None:
        """One envelope failing repeatedly waits 1, 2, 4, 8, 16, 30, 30 s."""
        lim = envq.default_limiter()
        delays = []
        for _ in range(7):
            d = lim.when("a")
            delays.append(d)
            await asyncio.sleep(d)
        assert delays == [1, 2, 4, 8, 16, 30, 30]

    async def test_many_envelopes_hit_the_bucket(self) -> None:
        """Twenty envelopes failing at once: the bucket's 5/s takes over after a burst of 10."""
        lim = envq.default_limiter()
        delays = [lim.when(n) for n in range(20)]
        assert delays == pytest.approx([1.0] * 15 + [1.2, 1.4, 1.6, 1.8, 2.0])


# --------------------------------------------------------------------------------------
# The Retry policy
# --------------------------------------------------------------------------------------


class TestRetry:
    def test_contract_defaults(self) -> None:
        """Retry() is attempts=3, base=1, cap=1800, jitter=True."""
        r = envq.Retry()
        assert (r.attempts, r.base, r.cap, r.jitter) == (3, 1.0, 1800.0, True)

    def test_formula(self) -> None:
        """The delay after the k-th failure is min(cap, base·2^(k−1))."""
        r = envq.Retry(attempts=-1, base=0.5, cap=100, jitter=False)
        assert [r.delay(k) for k in range(1, 11)] == [
            min(100, 0.5 * 2 ** (k - 1)) for k in range(1, 11)
        ]

    def test_no_overflow(self) -> None:
        """Any number of failures gives at most cap (no OverflowError)."""
        r = envq.Retry(attempts=-1, base=1, cap=10, jitter=False)
        assert r.delay(1025) == r.delay(10**6) == 10

    def test_attempts_count_the_first(self) -> None:
        """attempts counts every attempt, the first included; -1 is unlimited."""
        r = envq.Retry(attempts=3)
        assert [r.allows(k) for k in (1, 2, 3)] == [True, True, False]
        assert envq.Retry(attempts=1).allows(1) is False
        assert envq.Retry(attempts=-1).allows(10**9) is True

    def test_jitter_bounds_with_seeded_rng(self) -> None:
        """With jitter every delay is in [d/2, d], and the same seed gives the same draws."""
        a = envq.Retry(attempts=-1, base=1, cap=60, rng=random.Random(7))
        b = envq.Retry(attempts=-1, base=1, cap=60, rng=random.Random(7))
        for k in range(1, 12):
            d = min(60.0, 2.0 ** (k - 1))
            for _ in range(50):
                got = a.delay(k)
                assert d / 2 <= got <= d
                assert b.delay(k) == got

    def test_jitter_spreads(self) -> None:
        """Jittered delays are not all the nominal value."""
        r = envq.Retry(base=8, rng=random.Random(1))
        assert len({r.delay(1) for _ in range(20)}) > 1

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"attempts": 0},
            {"attempts": -2},
            {"base": -1},
            {"cap": math.nan},
            {"cap": math.inf},
            {"cap": 10**400},
        ],
    )
    def test_bad_values(self, kwargs: dict[str, Any]) -> None:
        """Bad attempts, base or cap raise ValueError naming the field."""
        with pytest.raises(ValueError, match="Retry"):
            envq.Retry(**kwargs)

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"attempts": True},
            {"attempts": 2.0},
            {"base": "1"},
            {"cap": True},
            {"jitter": "no"},
            {"jitter": None},
            {"rng": 42},
        ],
    )
    def test_bad_types(self, kwargs: dict[str, Any]) -> None:
        """Values of the wrong type raise TypeError naming the field; nothing is coerced
        (``base="1"`` is not 1, ``jitter="no"`` is not True)."""
        with pytest.raises(TypeError, match="Retry"):
            envq.Retry(**kwargs)

    async def test_unlimited_in_a_queue(self) -> None:
        """Retry(attempts=-1) keeps an envelope retrying until it succeeds."""
        invoke = Starts(fails=12)
        env = envq.Envelope(
            invoke=invoke, retry=envq.Retry(attempts=-1, base=1, cap=8, jitter=False)
        )
        async with running() as (q, _):
            ends = Ends(q)
            q.send(env)
            await q.run_until_empty()
        assert ends.events[env].to_state is EnvState.SUCCEEDED
        assert gaps(invoke.times) == [1, 2, 4] + [8] * 9


# --------------------------------------------------------------------------------------
# The queue's limiters
# --------------------------------------------------------------------------------------


def retry_now_hook(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
    return envq.retry_now()


class TestQueueLimiter:
    async def test_limiter_spaces_retry_now(self) -> None:
        """A "retry now" waits what the limiter says."""
        invoke = Starts(fails=3)
        env = envq.Envelope(invoke=invoke, on_failure=retry_now_hook)
        async with running(limiter=envq.ExponentialBackoff(2, 100)) as (q, _):
            q.send(env)
            await q.run_until_empty()
        assert invoke.times == [0, 2, 6, 14]

    async def test_limiter_spaces_a_timed_out_retry(self) -> None:
        """A "retry now" after a TIMEOUT waits what the limiter says too (the TIMEOUT row
        is a failure retry, like ERROR's)."""
        starts: list[float] = []

        async def slow_then_quick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())
            if len(starts) <= 3:
                await asyncio.sleep(10)  # past the deadline: TIMEOUT

        env = envq.Envelope(invoke=slow_then_quick, deadline=1, on_failure=retry_now_hook)
        async with running(limiter=envq.ExponentialBackoff(2, 100)) as (q, _):
            q.send(env)
            await q.run_until_empty()
        assert starts == [0, 3, 8, 17]

    async def test_larger_decided_delay_wins(self) -> None:
        """A retry waits max(decided delay, limiter.when(env))."""
        invoke = Starts(fails=3)
        retry = envq.Retry(attempts=5, base=3, jitter=False)
        env = envq.Envelope(invoke=invoke, retry=retry)
        async with running(limiter=envq.FastSlow(fast=1, slow=20, fast_attempts=2)) as (q, _):
            q.send(env)
            await q.run_until_empty()
        assert gaps(invoke.times) == [3, 6, 20]

    async def test_periodic_error_waits_at_least_the_limiter(self) -> None:
        """A periodic envelope's error reschedules after max(interval, limiter.when(env))."""
        invoke = Starts(fails=3)
        env = envq.Envelope(invoke=invoke, interval=5)
        async with running(limiter=envq.ExponentialBackoff(2, 100)) as (q, _):
            q.send(env)
            await asyncio.sleep(40)
        assert gaps(invoke.times)[:4] == [5, 5, 8, 5]

    async def test_periodic_timeout_waits_at_least_the_limiter(self) -> None:
        """A periodic envelope's TIMEOUT reschedules after max(interval,
        limiter.when(env)), as its ERROR does."""
        starts: list[float] = []

        async def slow_then_quick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())
            if len(starts) <= 3:
                await asyncio.sleep(10)  # past the deadline: TIMEOUT

        env = envq.Envelope(invoke=slow_then_quick, interval=5, deadline=1)
        async with running(limiter=envq.ExponentialBackoff(2, 100)) as (q, _):
            q.send(env)
            await asyncio.sleep(27)
        assert starts[:5] == [0, 6, 12, 21, 26]

    async def test_forget_on_success_and_on_failure(self) -> None:
        """The limiter forgets an envelope when it succeeds and when it fails for good."""
        lim = envq.ExponentialBackoff(1, 100)
        ok = envq.Envelope(invoke=Starts(fails=2), retry=envq.Retry(attempts=5, jitter=False))
        bad = envq.Envelope(invoke=Starts(fails=9), retry=envq.Retry(attempts=2, jitter=False))
        async with running(limiter=lim, workers=2) as (q, _):
            seen: list[int] = []
            q.subscribe(
                lambda e: (
                    seen.append(lim.retries(e.envelope))
                    if e.envelope is ok and e.to_state is EnvState.DELAYED
                    else None
                )
            )
            q.send(ok, bad)
            await q.run_until_empty()
        assert seen == [1, 2]
        assert lim.retries(ok) == lim.retries(bad) == 0

    async def test_forget_after_periodic_success(self) -> None:
        """A periodic envelope's success clears its failures, so backoff starts over."""
        invoke = Starts()
        outcomes = iter([True, True, False, True, True, True, True])

        async def flaky(env: envq.Envelope) -> None:
            await invoke(env)
            if next(outcomes):
                raise ValueError("flaky")

        env = envq.Envelope(invoke=flaky, interval=1)
        async with running(limiter=envq.ExponentialBackoff(4, 100)) as (q, _):
            q.send(env)
            await asyncio.sleep(45)
        assert gaps(invoke.times)[:6] == [4, 8, 1, 4, 8, 16]

    async def test_rate_throttles_dispatch(self) -> None:
        """Queue(rate=TokenBucket(5, burst=10)) starts 10 envelopes at once, then one per 0.2 s."""
        starts: list[float] = []

        async def work(env: envq.Envelope) -> None:
            starts.append(now())

        async with running(rate=envq.TokenBucket(rate=5, burst=10), workers=4) as (q, _):
            q.send(*(envq.Envelope(invoke=work) for _ in range(30)))
            await q.run_until_empty()
        assert starts[:10] == [0] * 10
        assert gaps(starts[9:]) == pytest.approx([0.2] * 20)

    async def test_rate_long_run(self) -> None:
        """Over a long run the dispatch rate converges to the bucket's rate."""
        starts: list[float] = []

        async def work(env: envq.Envelope) -> None:
            starts.append(now())

        async with running(rate=envq.TokenBucket(rate=10, burst=5), workers=3) as (q, _):
            q.send(*(envq.Envelope(invoke=work) for _ in range(505)))
            await q.run_until_empty()
        assert starts[-1] - starts[0] == pytest.approx(50.0)


class Recording:
    """A limiter proxy that records, per envelope, (loop time of the call, its answer)."""

    def __init__(self, inner: envq.RateLimiter) -> None:
        self.inner = inner
        self.calls: dict[object, list[tuple[float, float]]] = {}

    def when(self, env: object) -> float:
        d = self.inner.when(env)
        self.calls.setdefault(env, []).append((now(), d))
        return d

    def forget(self, env: object) -> None:
        self.inner.forget(env)

    def retries(self, env: object) -> int:
        return self.inner.retries(env)


small = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0])
limiters: st.SearchStrategy[Callable[[], envq.RateLimiter]] = st.recursive(
    st.one_of(
        st.builds(
            lambda b, c: lambda: envq.ExponentialBackoff(b, c),
            st.sampled_from([0.25, 0.5, 1.0]),
            st.sampled_from([1.0, 4.0, 30.0]),
        ),
        st.builds(lambda f, s, n: lambda: envq.FastSlow(f, s, n), small, small, st.integers(0, 3)),
        st.builds(
            lambda r, b: lambda: envq.TokenBucket(r, b),
            st.sampled_from([0.5, 1.0, 4.0]),
            st.integers(1, 3),
        ),
    ),
    lambda inner: st.lists(inner, min_size=1, max_size=3).map(
        lambda makers: lambda: envq.MaxOf(*(m() for m in makers))
    ),
    max_leaves=4,
)
decisions = st.one_of(
    st.just(envq.retry_now()), small.filter(bool).map(envq.retry_after), st.just(None)
)


class TestLimiterProperty:
    @given(
        make=limiters,
        envs=st.lists(
            st.tuples(st.integers(0, 5), st.lists(decisions, min_size=5, max_size=5)),
            min_size=1,
            max_size=4,
        ),
        workers=st.integers(1, 3),
    )
    def test_retry_never_sooner_than_the_limiter(
        self,
        make: Callable[[], envq.RateLimiter],
        envs: list[tuple[int, list[envq.Decision | None]]],
        workers: int,
    ) -> None:
        """A retry never starts sooner than the limiter (or the decision) said when it failed."""

        async def scenario() -> None:
            lim = Recording(make())
            runs: dict[envq.Envelope, list[tuple[float, float]]] = {}
            decided: dict[envq.Envelope, list[float]] = {}

            def build(fails: int, plan: list[envq.Decision | None]) -> envq.Envelope:
                async def invoke(env: envq.Envelope) -> None:
                    runs[env].append((now(), 0.0))
                    await asyncio.sleep(0.125)
                    start, _ = runs[env][-1]
                    runs[env][-1] = (start, now())
                    if len(runs[env]) <= fails:
                        raise ValueError("fail")

                def on_failure(
                    env: envq.Envelope, exc: BaseException, attempt: int
                ) -> envq.Decision | None:
                    d = plan[(attempt - 1) % len(plan)]
                    decided[env].append(d.delay if d is not None else 0.0)
                    return d

                env = envq.Envelope(invoke=invoke, on_failure=on_failure)
                runs[env] = []
                decided[env] = []
                return env

            batch = [build(fails, plan) for fails, plan in envs]
            async with running(limiter=lim, workers=workers) as (q, _):
                q.send(*batch)
                async with asyncio.timeout(10_000):
                    await q.run_until_empty()
            for env in batch:
                attempts = runs[env]
                calls = lim.calls.get(env, [])
                assert len(calls) == len(attempts) - 1
                for k, (called_at, wait) in enumerate(calls):
                    next_start = attempts[k + 1][0]
                    assert next_start >= called_at + wait - 1e-9
                    assert next_start >= attempts[k][1] + decided[env][k] - 1e-9

        run(scenario())


# --------------------------------------------------------------------------------------
# dead_letter and run_until_empty
# --------------------------------------------------------------------------------------


class TestDeadLetter:
    async def test_every_failed_envelope_with_its_last_error(self) -> None:
        """dead_letter gets every FAILED envelope once, with its last error; others never."""
        got: list[tuple[envq.Envelope, BaseException | None]] = []
        boom = ValueError("boom")
        no = envq.DoNotRetry("no")

        async def slow(env: envq.Envelope) -> None:
            await asyncio.sleep(10)

        exhausted = envq.Envelope(
            invoke=Starts(fails=9), retry=envq.Retry(attempts=3, base=1, jitter=False)
        )
        dropped = envq.Envelope(invoke=raising(boom), on_failure=lambda e, x, n: None)
        refused = envq.Envelope(invoke=raising(no))
        timed_out = envq.Envelope(invoke=slow, deadline=1)
        fine = envq.Envelope(invoke=Starts())
        stopped = envq.Envelope(invoke=raising(envq.StopEnvelope()))
        async with running(dead_letter=lambda e, x: got.append((e, x)), workers=3) as (q, _):
            q.send(exhausted, dropped, refused, timed_out, fine, stopped)
            await q.run_until_empty()
        errors = dict(got)
        assert len(got) == 4
        assert set(errors) == {exhausted, dropped, refused, timed_out}
        last = errors[exhausted]
        assert isinstance(last, envq.MaxRetriesExceeded)
        assert isinstance(last.__cause__, ValueError)
        assert str(last.__cause__) == "failure 3"
        assert errors[dropped] is boom
        assert errors[refused] is no
        assert isinstance(errors[timed_out], TimeoutError)

    async def test_async_dead_letter(self) -> None:
        """An async dead_letter runs as a task and receives the envelope and its error."""
        got: list[tuple[envq.Envelope, BaseException | None]] = []

        async def sink(env: envq.Envelope, exc: BaseException | None) -> None:
            await asyncio.sleep(1)
            got.append((env, exc))

        env = envq.Envelope(invoke=Starts(fails=1))
        async with running(dead_letter=sink) as (q, _):
            q.send(env)
            await q.run_until_empty()
            await asyncio.sleep(2)
        assert [e for e, _ in got] == [env]
        assert isinstance(got[0][1], ValueError)

    async def test_failing_dead_letter_is_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        """A dead_letter that raises is logged and the queue keeps running."""

        def sink(env: envq.Envelope, exc: BaseException | None) -> None:
            raise RuntimeError("sink down")

        a, b = envq.Envelope(invoke=Starts(fails=1)), envq.Envelope(invoke=Starts())
        with caplog.at_level(logging.ERROR, logger="envq"):
            async with running(dead_letter=sink) as (q, _):
                ends = Ends(q)
                q.send(a, b)
                await q.run_until_empty()
        assert ends.events[b].to_state is EnvState.SUCCEEDED
        assert "dead_letter failed" in caplog.text


class TestRunUntilEmpty:
    async def test_runs_retries_to_the_end_then_stops(self) -> None:
        """run_until_empty() waits for every envelope, retries included, then stops."""
        invoke = Starts(fails=2)
        env = envq.Envelope(invoke=invoke, retry=envq.Retry(attempts=5, base=4, jitter=False))
        q = envq.Queue("bootstrap")
        ends = Ends(q)
        q.send(env)
        report = await q.run_until_empty()
        assert report.complete
        assert q.state is envq.QueueState.STOPPED
        assert invoke.times == [0, 4, 12]
        assert now() == 12
        assert ends.events[env].outcome is Outcome.OK
        await q.terminate()

    async def test_empty_queue(self) -> None:
        """On an empty queue it starts, stops at once and reports complete."""
        q = envq.Queue("empty")
        report = await q.run_until_empty()
        assert report.complete
        assert now() == 0
        assert await q.terminate() == []
