"""Retrying object-store requests for as long as the ``object_retry_seconds`` budget lasts.

tensorstore retries a failed request itself, a few times and quickly (``_objects.RETRIES``):
most transient errors (a 503 from a busy front end, a reset connection) pass within a second,
and the first retries should not cost tensorstore's default second each. When those give up
(tensorstore then reports ``ABORTED: All N retry attempts failed``), the operation is issued
again here with exponential backoff and jitter, so that a bucket throttling for minutes (its
write rate ramping up, a project's egress quota reached) slows a save or restore down instead
of failing it. Jitter spreads the retries of a thousand hosts, which a storm hits together.

The budget runs from the operation's first attempt; a retry is started only if an attempt as
long as the last one still ends within it, and a wait never outlasts it: the operation fails
within the budget, give or take one attempt's variation, with a ``CheckpointError`` naming the
object and the last status the store gave.
"""

from __future__ import annotations

import logging
import random
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


def transient(error: BaseException) -> bool:
    text = str(error)
    return any(mark in text for mark in _TRANSIENT)


def retrying(issue: Callable[[], Any], doing: str, where: str, issued: Any = None) -> Any:
    """The result of the tensorstore future ``issue()`` returns (``issued``: its first one,
    already issued), issued again on transient failures until ``object_retry_seconds`` have
    passed since the first. Raises a ``CheckpointError`` naming ``where`` on any other
    failure, or on the last one."""
    budget = settings().object_retry_seconds
    started = attempted = time.monotonic()
    future = issue() if issued is None else issued
    attempt = 0
    while True:
        try:
            return future.result()
        except (ValueError, NotImplementedError) as error:
            now = time.monotonic()
            left = started + budget - now - (now - attempted)  # room for one more attempt as long
            if not transient(error) or left <= 0:
                raise _failed(doing, where, error, attempt, now - started) from error
            wait = min(LONGEST_WAIT_S, FIRST_WAIT_S * 2**attempt)
            attempt += 1
            logger.info("tpu_ckpt: %s %s failed (%s); retry %d in up to %.1f s", doing, where, error, attempt, wait)
            time.sleep(min(left, random.uniform(wait / 2, wait)))
            attempted = time.monotonic()
            future = issue()


def _failed(doing: str, where: str, error: BaseException, retries: int, elapsed: float) -> CheckpointError:
    if not retries:
        return CheckpointError(f"{doing} {where} failed: {error}", file=where)
    return CheckpointError(
        f"{doing} {where} failed after {retries} retries over {elapsed:.0f} s (the object_retry_seconds "
        f"setting, TPU_CKPT_OBJECT_RETRY_SECONDS, allows {settings().object_retry_seconds:g} s); the last "
        f"status was: {error}. The object store is throttling or unavailable: try again later, or ask for "
        "a higher quota (docs/object_stores.md).",
        file=where,
    )
