"""A process-wide cap on the rate of object-store requests (``object_requests_per_second``).

A new bucket accepts about 1,000 writes a second and doubles that every 20 minutes of
sustained load; a project's egress quota caps a pod-wide restore. A thousand hosts that each
issue requests as fast as their threads allow reach those limits together, and then every
host's requests are throttled and retried at once. Retrying survives that
(``_retries.retrying``), but pacing each host to its share of the limit
(``object_requests_per_second`` = the bucket's rate / the number of hosts) avoids the storm.

The pace is a token bucket holding at most one second of requests: a host may burst that
much after a pause, and never exceeds the rate over any longer interval. Every request a
store issues takes a token first, its retries included; ``0`` (the default) takes none.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from tpu_ckpt.settings import settings


class RequestRate:
    """A token bucket of ``per_second`` tokens a second, holding at most one second's worth.
    ``clock`` and ``sleep`` are the time functions it uses (a test passes its own)."""

    def __init__(
        self, per_second: float, clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.per_second = per_second
        self._clock, self._sleep = clock, sleep
        self._tokens = per_second
        self._filled_at = clock()
        self._lock = threading.Lock()
        self.requests = 0  # the requests paced so far
        self.waited_s = 0.0  # the time they spent waiting for a token, in all

    def take(self) -> None:
        """Waits until a request may be issued. Tokens are taken in turn: a caller reserves
        its token under the lock (the balance may go negative) and sleeps outside it."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.per_second, self._tokens + (now - self._filled_at) * self.per_second)
            self._filled_at = now
            self._tokens -= 1
            wait = -self._tokens / self.per_second if self._tokens < 0 else 0.0
            self.requests += 1
            self.waited_s += wait
        if wait:
            self._sleep(wait)


@functools.cache
def _shared(per_second: float) -> RequestRate:
    return RequestRate(per_second)


def paced(kvstore: Any) -> Any:
    """``kvstore`` under the process's request pace (the current settings); itself when unlimited."""
    per_second = settings().object_requests_per_second
    return PacedKvStore(kvstore, _shared(per_second)) if per_second else kvstore


class PacedKvStore:
    """A tensorstore kvstore whose requests (reads, writes, listings, deletes) each take a
    token of ``rate`` first; anything else passes through."""

    _PACED = frozenset({"read", "write", "list", "delete_range"})

    def __init__(self, kvstore: Any, rate: RequestRate):
        self._kvstore = kvstore
        self._rate = rate

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._kvstore, name)
        if name not in self._PACED:
            return attribute

        def issue(*args: Any, **kwargs: Any) -> Any:
            self._rate.take()
            return attribute(*args, **kwargs)

        return issue
