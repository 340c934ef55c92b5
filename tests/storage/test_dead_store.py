"""A dead object store (every connection closed unanswered) fails a save within
1.1 x object_retry_seconds and a restore within 1 x, with a CheckpointError naming an object
(issue #39): before, a save spent one budget on its failed write and another on removing
what it had written."""

import time

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.object_stores import DROP

pytestmark = [pytest.mark.emulator]

STATE = {"w": np.arange(4096, dtype=np.float32), "step": 3}


def dead(proxy, match=lambda method, path: True) -> None:
    """The store stops answering: every (matching) request's connection is closed unanswered."""
    proxy.storm(DROP, 600, match)


def after_the_marker():
    """Matches every request but a save's first write (its staging marker): the store dies
    once the save has started, so its data writes fail, and so does their removal."""
    written = []

    def match(method: str, path: str) -> bool:
        if written:
            return True
        if method != "GET":
            written.append(path)
        return False

    return match


@pytest.mark.parametrize("enable_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("when", ["before", "while writing"])
def test_a_save_to_a_dead_store_fails_within_the_budget(faulty, small_budget, enable_async, when):
    """Dead from the start (the save's first listing fails), or once it writes (its data
    write fails, and so does the removal of what it wrote)."""
    proxy, bucket = faulty
    dead(proxy, after_the_marker() if when == "while writing" else lambda method, path: True)
    started = time.monotonic()
    with pytest.raises(tc.CheckpointError) as raised:
        tc.save(bucket.url("c"), STATE, options=tc.CheckpointOptions(enable_async=enable_async)).wait()
    elapsed = time.monotonic() - started
    assert elapsed <= small_budget * 1.1, elapsed
    assert raised.value.file is not None and raised.value.file.startswith(bucket.url("c"))


def test_a_restore_from_a_dead_store_fails_within_the_budget(faulty, small_budget):
    proxy, bucket = faulty
    tc.save(bucket.url("c"), STATE).wait()
    dead(proxy)
    started = time.monotonic()
    with pytest.raises(tc.CheckpointError) as raised:
        tc.restore(bucket.url("c"))
    elapsed = time.monotonic() - started
    assert elapsed <= small_budget, elapsed
    assert raised.value.file is not None and raised.value.file.startswith(bucket.url("c"))
