"""Schedule arithmetic: where a periodic envelope's next run falls."""

from __future__ import annotations

import math
from typing import Final

__all__ = ["MIN_INTERVAL", "fixed_rate_slot"]

#: The smallest interval accepted (seconds). A shorter one is a busy loop, and past
#: 2**33 s of loop time (272 years) the clock could not tell one run from the next.
MIN_INTERVAL: Final = 1e-6


def fixed_rate_slot(origin: float, interval: float, last: int, now: float) -> int:
    """The first grid point after ``now`` and after slot ``last``: the smallest
    ``n > last`` with ``origin + n × interval > now``.

    The quotient is only a first guess: ``(5.1 - 2.1) / 1`` is 2.9999999999999996, and
    flooring it would give a slot equal to ``now``, which would run at once.
    """
    n = max(last + 1, math.floor((now - origin) / interval) + 1)
    while n > last + 1 and origin + (n - 1) * interval > now:
        n -= 1
    while origin + n * interval <= now:
        n += 1
    return n
