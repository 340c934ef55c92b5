"""Whether a job is being preempted, for CheckpointManager.reached_preemption.

Under JAX's distributed runtime, JAX's preemption sync point says so, and the processes
agree on the step. A single-process job gets SIGTERM and a grace period, and dying of the
signal would waste that grace period: while a manager watches, the signal is only recorded,
and the training loop saves and exits at its next step.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from tpu_ckpt import cluster


class SigtermRecorder:
    """Records SIGTERM instead of dying of it, while any manager watches.

    There is one per process, because signals belong to the process. The first watcher
    installs it, and the last one to stop puts back the handler it found. A Python handler
    that was installed before it still runs on SIGTERM.
    """

    def __init__(self) -> None:
        self.received = False
        self._watchers = 0
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def watch(self) -> None:
        if self._watchers == 0:
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    "reached_preemption installs a SIGTERM handler, and Python allows that only on the "
                    "main thread: call it there first."
                )
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._watchers += 1

    def unwatch(self) -> None:
        self._watchers -= 1
        if self._watchers == 0:
            if signal.getsignal(signal.SIGTERM) == self._handle:  # unless someone replaced it since
                signal.signal(signal.SIGTERM, self._previous)
            self.received = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if callable(self._previous):
            self._previous(signum, frame)


SIGTERM = SigtermRecorder()


class PreemptionWatch:
    """One manager's question "is this the step to save and exit at?"; see
    ``CheckpointManager.reached_preemption``."""

    def __init__(self) -> None:
        self._watching = False

    def reached(self, step: int) -> bool:
        if cluster.preemption_sync_available():
            return cluster.reached_preemption_sync_point(step)
        if cluster.process_count() > 1:
            raise RuntimeError(
                "reached_preemption needs JAX's preemption service in a multi-process job: leave "
                "jax_enable_preemption_service on (the default) when calling jax.distributed.initialize()."
            )
        if not self._watching:
            SIGTERM.watch()
            self._watching = True
        return SIGTERM.received

    def close(self) -> None:
        """Stops watching: the last watcher puts back the SIGTERM handler it found."""
        if self._watching:
            SIGTERM.unwatch()
            self._watching = False
