"""Retrying object-store requests for as long as the ``object_retry_seconds`` budget lasts.

tensorstore retries a failed request itself, a few times and quickly (``_objects.RETRIES``):
most transient errors (a 503 from a busy front end, a reset connection) pass within a second,
and the first retries should not cost tensorstore's default second each. When those give up
(tensorstore then reports ``ABORTED: All N retry attempts failed``), the operation is issued
again here with exponential backoff and jitter, so that a bucket throttling for minutes (its
write rate ramping up, a project's egress quota reached) slows a save or restore down instead
of failing it. Jitter spreads the retries of a thousand hosts, which a storm hits together.

The budget runs from the operation's first attempt; a retry is started only if an attempt twice
as long as the longest so far still ends within it, and a wait never outlasts it: the
operation fails within the budget with a ``CheckpointError`` naming the object and the last
status the store gave.

A store whose budget ran out is taken for dead (by its bucket) until one of its requests
succeeds, for a budget's length at most: its requests are then tried once, not retried, and
those retrying already give up at their next failure. So a save whose writes met a dead store
fails within about one budget, not two (its removal of what it wrote would retry for another),
and a restore's many reads fail together.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

FIRST_WAIT_S = 0.5
"""The longest wait before our first retry (tensorstore's own have failed by then), doubling
per retry up to ``LONGEST_WAIT_S``; each wait is drawn from its upper half."""
LONGEST_WAIT_S = 30.0

_TRANSIENT = ("retry attempts failed", "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
"""What tensorstore's errors start with, or say, when a request may succeed if sent again."""


_dead_until: dict[str, float] = {}  # a bucket ("gs://name") whose budget ran out -> until when it counts as dead
_dead_lock = threading.Lock()


def transient(error: BaseException) -> bool:
    text = str(error)
    return any(mark in text for mark in _TRANSIENT)


def retrying(issue: Callable[[], Any], doing: str, where: str, issued: Any = None) -> Any:
    """The result of the tensorstore future ``issue()`` returns (``issued``: its first one,
    already issued), issued again on transient failures until ``object_retry_seconds`` have
    passed since the first. Raises a ``CheckpointError`` naming ``where`` on any other
    failure, or on the last one."""
    budget, bucket = settings().object_retry_seconds, _bucket(where)
    started = attempted = time.monotonic()
    future = issue() if issued is None else issued
    attempt, longest = 0, 0.0
    while True:
        try:
            result = future.result()
        except (ValueError, NotImplementedError) as error:
            now = time.monotonic()
            longest = max(longest, now - attempted)
            left = started + budget - now - 2 * longest  # room for one more attempt, twice as long
            dead = transient(error) and _dead(bucket, now)
            if not transient(error) or left <= 0 or dead:
                if transient(error) and left <= 0:
                    _mark_dead(bucket, now + budget)
                raise _failed(doing, where, error, attempt, now - started, dead) from error
            wait = min(LONGEST_WAIT_S, FIRST_WAIT_S * 2**attempt)
            attempt += 1
            logger.info("tpu_ckpt: %s %s failed (%s); retry %d in up to %.1f s", doing, where, error, attempt, wait)
            time.sleep(min(left, random.uniform(wait / 2, wait)))
            attempted = time.monotonic()
            future = issue()
        else:
            _mark_dead(bucket, 0.0)
            return result


def _bucket(where: str) -> str:
    scheme, _, rest = where.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _dead(bucket: str, now: float) -> bool:
    return now < _dead_until.get(bucket, 0.0)


def _mark_dead(bucket: str, until: float) -> None:
    """Takes ``bucket`` for dead until ``until`` (0: alive)."""
    if until or bucket in _dead_until:
        with _dead_lock:
            _dead_until[bucket] = until


def _failed(doing: str, where: str, error: BaseException, retries: int, elapsed: float, dead: bool) -> CheckpointError:
    if dead:
        return CheckpointError(
            f"{doing} {where} failed: {error}; not retried, as another request to the object store was refused for "
            "the whole object_retry_seconds budget (TPU_CKPT_OBJECT_RETRY_SECONDS) just before: it is unavailable",
            file=where,
        )
    if not retries:
        return CheckpointError(f"{doing} {where} failed: {error}", file=where)
    return CheckpointError(
        f"{doing} {where} failed after {retries} retries over {elapsed:.0f} s (the object_retry_seconds "
        f"setting, TPU_CKPT_OBJECT_RETRY_SECONDS, allows {settings().object_retry_seconds:g} s); the last "
        f"status was: {error}. The object store is throttling or unavailable: try again later, or ask for "
        "a higher quota (docs/object_stores.md).",
        file=where,
    )
