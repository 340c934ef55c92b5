"""The threads a store's transfers run on, so a caller keeps many of them in flight.

Not a ``ThreadPoolExecutor``: that refuses new work once the interpreter begins to shut
down, which is exactly when an in-flight asynchronous save must still be finished.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class IOPool:
    """A few IO threads handing back ``concurrent.futures.Future``s."""

    def __init__(self, threads: int):
        self._size = threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._starting = threading.Lock()

    def submit(
        self, fn: Callable[..., Any], *args: Any, then: Callable[[Any], Any] | None = None
    ) -> concurrent.futures.Future:
        """Runs ``fn(*args)``, then ``then`` on its result, in an IO thread: work such as
        checksums thereby runs in parallel, next to the transfers."""
        with self._starting:  # started on first use (listing and manifest reads need none), once
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._work, name="tpu_ckpt io", daemon=True) for _ in range(self._size)
                ]
                for thread in self._threads:
                    thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn, args, then))
        return future

    def shutdown(self) -> None:
        """Ends every thread: one stop per thread, taken by exactly those threads (two first
        submits at once starting two sets would leave a set that takes stops meant for the
        other, and a join that never returns)."""
        with self._starting:
            threads = self._threads
        for _ in threads:
            self._tasks.put(None)
        for thread in threads:
            thread.join()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, job = task[0], task[1:]
            del task  # a job's buffers (a file's host bytes) go before its caller hears it is done
            if future.set_running_or_notify_cancel():
                result, error = _run(*job)
                del job
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                del result, error
            del future  # an idle thread must not keep its last read's bytes alive (nor its future)


def _run(
    fn: Callable[..., Any], args: tuple[Any, ...], then: Callable[[Any], Any] | None
) -> tuple[Any, BaseException | None]:
    try:
        result = fn(*args)
        if then is not None:
            then(result)
        return result, None
    except BaseException as error:  # noqa: BLE001 - delivered through the future
        return None, error


class PooledStore:
    """What every store shares: IO on an :class:`IOPool` (``self._pool``), shut down on
    :meth:`close`, and ``with`` closing it."""

    _pool: IOPool

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()
