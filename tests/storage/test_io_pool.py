"""The IO pool's threads start once, whoever submits first, and all of them end at shutdown."""

import sys
import threading

import pytest

from tpu_ckpt.storage._io_pool import IOPool


def _shuts_down(pool: IOPool) -> bool:
    ender = threading.Thread(target=pool.shutdown, daemon=True)
    ender.start()
    ender.join(timeout=10)
    return not ender.is_alive()


@pytest.fixture
def eager_switching():
    """Threads switch every microsecond, so that submits interleave as they do under load."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _first_submits_at_once(submitters: int) -> IOPool:
    """A fresh pool whose first ``submitters`` submits come from as many threads at once,
    each of whose tasks ran on one of the pool's threads."""
    pool, start = IOPool(8), threading.Barrier(submitters)
    futures, lock = [], threading.Lock()

    def submit() -> None:
        start.wait()
        future = pool.submit(threading.current_thread)
        with lock:
            futures.append(future)

    threads = [threading.Thread(target=submit) for _ in range(submitters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [f.result(timeout=10).name for f in futures] == ["tpu_ckpt io"] * submitters
    return pool


def test_first_submits_from_many_threads_start_one_set_of_threads_and_shutdown_ends_them(eager_switching):
    """A restore check submits its first reads from several threads at once. Two sets of IO
    threads started side by side left one set taking the stops meant for the other: the
    pod-scale run hung in ``close`` (issue 21)."""
    for _ in range(30):
        pool = _first_submits_at_once(16)
        assert _shuts_down(pool), "IOPool.shutdown did not return: a thread never got its stop"
        assert len(pool._threads) == 8 and not any(t.is_alive() for t in pool._threads)
