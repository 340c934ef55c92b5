"""The one background writer of a process, and the SaveResult handed back by ``save``.

An asynchronous save returns once its data is on the host; a single background thread then
writes, commits and runs the write callbacks. One save is in flight at a time (a second
``save`` first waits for the one before), which bounds host memory to one snapshot.

A background failure is never only logged: it is re-raised by ``SaveResult.wait()`` and, if
nobody has seen it yet, by the next ``save`` (and so by ``Checkpoint.sync()`` and
``CheckpointManager.wait_until_finished()``, which wait on their last result). At
interpreter exit the in-flight save is finished (its thread is not a daemon) and a failure
nobody saw is logged at ERROR.

This is module-level state on purpose: "one write in flight" is a property of the process
(its host memory, its disk bandwidth), not of any one object that happens to call ``save``.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SaveResult:
    """The outcome of :func:`tpu_ckpt.save`: ``path``, ``done()`` and ``wait(timeout)``.

    For a synchronous save everything happened before ``save`` returned. ``save`` makes
    these; users only read them.

    Args:
      path: the checkpoint being written, readable as ``.path``.
      thread: the background write of an asynchronous save; ``None`` for a synchronous one.

    Raises:
      CheckpointError: from ``wait()``: the background write failed.
    """

    def __init__(self, path: str, thread: threading.Thread | None = None):
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None
        self._seen = False

    def done(self) -> bool:
        """Whether the save has finished, committed or failed (``wait()`` then does not block).

        Returns:
          ``True`` once nothing is left to write in the background.
        """
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """Blocks until the checkpoint is committed and visible to every process (and its
        write callbacks ran).

        Args:
          timeout: the most seconds to wait; ``None`` waits as long as the save takes.

        Returns:
          The checkpoint's path.

        Raises:
          TimeoutError: the save is still in progress after ``timeout`` seconds.
          CheckpointError: the background write failed (its error, re-raised, also when a
            later ``save`` reported it first).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"The save of {self.path} is still in progress after {timeout}s")
        if self._error is not None:
            self._seen = True
            raise self._error
        return self.path

    def _unseen_error(self) -> BaseException | None:
        """The failure, if nobody has been told about it yet (then it counts as told)."""
        if self._error is None or self._seen:
            return None
        self._seen = True
        return self._error


class _Writer:
    """Runs at most one save job at a time on a background thread."""

    def __init__(self) -> None:
        self._current: SaveResult | None = None
        atexit.register(self._at_exit)

    def settle(self) -> None:
        """Waits for the in-flight save; raises its failure if nobody has seen it yet."""
        _, error = self._finish_current()
        if error is not None:
            raise error

    def start(self, path: str, job: Callable[[], None]) -> SaveResult:
        result = SaveResult(path)

        def run() -> None:
            try:
                job()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits next
                logger.warning("tpu_ckpt: background save of %s failed: %s", path, error)
                result._error = error

        result._thread = threading.Thread(target=run, name=f"tpu_ckpt save {path}")
        self._current = result
        result._thread.start()
        return result

    def _at_exit(self) -> None:
        path, error = self._finish_current()
        if error is not None:
            logger.error("tpu_ckpt: the asynchronous save of %s failed and was never waited on: %s", path, error)

    def _finish_current(self) -> tuple[str, BaseException | None]:
        """Waits for the in-flight save, if any; returns its path and a failure nobody saw yet."""
        current, self._current = self._current, None
        if current is None:
            return "", None
        if current._thread is threading.current_thread():  # a write callback of that save, saving again:
            return "", None  # its checkpoint is committed; its own result reports what follows
        if current._thread is not None:
            current._thread.join()
        return current.path, current._unseen_error()


WRITER = _Writer()
