"""CheckpointManager: numbered checkpoints of a training loop in one directory.

A loop calls ``save(step, tree)`` every step. The manager writes a checkpoint once
``save_interval_steps`` have passed. It keeps the newest ``max_to_keep`` checkpoints, plus
one every ``keep_checkpoint_every_n_hours`` (TensorFlow's rules), and it tells the loop when
the job is being preempted.

The directory is the source of truth. Each committed checkpoint is a directory ``step_<n>``
directly under it, and it counts as committed once its manifest exists (see storage.py).
There is no state file, so a new manager (after a restart, or on another host) sees exactly
the committed steps, and a crash can never leave a state file and the checkpoints
disagreeing. The manager itself remembers only the last step it saved or restored (for the
interval) and the save in flight.

Retention and the removal of uncommitted leftovers run as a write callback of each save.
They therefore run after that save is committed: on the background thread for asynchronous
saves, and only on the process that commits (process 0, or the ``io_device`` process).
Nothing else can be in flight at that moment. A process has one save in flight at a time, and
the other processes cannot start their next save until that process has named its staging
area. With ``io_device`` the directory may be that process's local disk: it lists the
directory for everyone (see ``_list``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import operator
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType
from typing import Any

from tpu_ckpt import distributed, storage
from tpu_ckpt.background import SaveResult
from tpu_ckpt.errors import CheckpointExistsError, CheckpointNotFoundError
from tpu_ckpt.format import MANIFEST_FILE
from tpu_ckpt.listing import Listing, parse_listing
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restore import restore
from tpu_ckpt.save import save

logger = logging.getLogger(__name__)

class CheckpointManager:
    """Saves numbered checkpoints into one directory, prunes old ones, and detects preemption.

    Args:
      directory: where the ``step_<n>`` checkpoints live. A local path, or a
        ``memory://``, ``gs://`` or ``s3://`` URL.
      max_to_keep: how many of the newest checkpoints to keep. ``None`` keeps all of them.
      keep_checkpoint_every_n_hours: also keep, forever, each checkpoint that leaves the
        newest ``max_to_keep`` at least this many hours after the last one kept this way
        (TF's rule). The times are the mtimes of the manifests, so this needs a local
        directory (tensorstore's kvstores do not report when an object was written, so a
        ``gs://``, ``s3://`` or ``memory://`` directory is refused here), and copying
        checkpoints without preserving mtimes (``cp -r`` without ``-p``) changes them. On an empty directory the clock starts when the manager is
        created, as in TF. On a directory that already holds steps, the oldest step starts
        the clock. TF reads that time from its state file, and we keep no state file.
      save_interval_steps: ``save`` writes only when ``step`` is at least this many steps
        past the last step this manager saved or restored (TF's ``checkpoint_interval``).
        A manager's first save is always due, as in TF.
      options: the :class:`CheckpointOptions` for every save (``enable_async`` included).
        They are also the default for ``restore``.

    Every process of a multi-process job creates the manager and calls ``save`` with the
    same steps (SPMD).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        save_interval_steps: int = 1,
        options: CheckpointOptions | None = None,
    ):
        self._location = storage.location(directory)
        self.directory = self._location.url
        self.max_to_keep = _check_max_to_keep(max_to_keep)
        self.keep_checkpoint_every_n_hours = _check_hours(keep_checkpoint_every_n_hours, self._location)
        self.save_interval_steps = _check_interval(save_interval_steps)
        self._options = options if options is not None else CheckpointOptions()
        self._pending: SaveResult | None = None
        self._last_step: int | None = None  # saved or restored; None: the next save is due
        # TF's last_preserved_timestamp, which TF reads from its state file (see Args).
        self._preserved_since = time.time() - 1 if self.latest_step() is None else -math.inf
        self._watching_sigterm = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def save(self, step: int, tree: Any, *, force: bool = False) -> bool:
        """Saves ``tree`` as step ``step`` if the interval says so, or if ``force`` is set.

        Returns whether a save was started. With asynchronous options the save is started
        but not yet committed; it is committed once :meth:`wait_until_finished` returns.
        A save first waits for the one before it and raises that one's failure, if any.
        After a restart, resume with :meth:`restore`. That also sets the step from which
        the interval counts.

        Raises:
          CheckpointExistsError: step ``step`` is already committed. Checkpoints are never
            overwritten.
        """
        step = _check_step(step)
        if not force and not self._due(step):
            return False
        self.wait_until_finished()
        listing = self._list()
        if step in listing.committed:
            raise CheckpointExistsError(
                f"Step {step} is already committed in {self.directory} as {listing.committed[step]!r}; "
                "tpu_ckpt never overwrites a checkpoint. Save a different step, or delete that one first.",
                file=self._location.child(listing.committed[step]),
            )
        name = f"step_{step}"
        if name in listing.leftovers and distributed.process_index() == self._leader():
            # An interrupted save of this step, written in place (object stores): in the way.
            self._remove(name, "an uncommitted leftover of an earlier save of this step")
        self._pending = save(self._location.child(name), tree, options=self._save_options(step))
        self._last_step = step
        return True

    def restore(self, step: int | None = None, target: Any = None, *, options: CheckpointOptions | None = None) -> Any:
        """Restores step ``step`` (``None``: the latest committed one). See :func:`tpu_ckpt.restore`.

        First waits for a save in flight, and raises its failure like
        :meth:`wait_until_finished`. The restored step then counts as the last saved step
        for ``save_interval_steps``, as after TF's ``restore_or_initialize``.

        Raises:
          CheckpointNotFoundError: no committed checkpoint, or none for ``step``.
        """
        self.wait_until_finished()
        committed = self._list().committed
        if step is None:
            if not committed:
                raise CheckpointNotFoundError(f"No committed checkpoint in {self.directory}", file=self.directory)
            step = max(committed)
        else:
            step = _check_step(step)
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"No committed checkpoint for step {step} in {self.directory}; "
                    f"the committed steps are {sorted(committed)}",
                    file=self.directory,
                )
        options = options if options is not None else self._options
        tree = restore(self._location.child(committed[step]), target, options=options)
        self._last_step = step
        return tree

    def latest_step(self) -> int | None:
        """The highest committed step, or ``None``. A save still in flight does not count."""
        return max(self._list().committed, default=None)

    def all_steps(self) -> list[int]:
        """Every committed step, in ascending order."""
        return sorted(self._list().committed)

    def wait_until_finished(self) -> None:
        """Waits until the save in flight is committed, and raises its failure (once)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Waits for the save in flight, and stops watching for SIGTERM (see :meth:`reached_preemption`)."""
        try:
            self.wait_until_finished()
        finally:
            if self._watching_sigterm:
                _SIGTERM.unwatch()
                self._watching_sigterm = False

    def reached_preemption(self, step: int) -> bool:
        """Whether the job is being preempted and ``step`` is where every process saves and exits.

        Under JAX's distributed runtime this is JAX's preemption sync point
        (``multihost_utils.reached_preemption_sync_point``). The processes agree on the
        step, and every process must call this at every step. In a single-process run it is
        True once the process has received SIGTERM. The first call installs a handler that
        records SIGTERM instead of dying of it, so that must happen on the main thread.
        :meth:`close` of the last manager watching puts the previous handler back. A
        typical loop::

            if manager.reached_preemption(step):
                manager.save(step, state, force=True)
                manager.wait_until_finished()
                break
        """
        step = _check_step(step)
        if distributed.preemption_sync_available():
            return distributed.reached_preemption_sync_point(step)
        if distributed.process_count() > 1:
            raise RuntimeError(
                "reached_preemption needs JAX's preemption service in a multi-process job: leave "
                "jax_enable_preemption_service on (the default) when calling jax.distributed.initialize()."
            )
        if not self._watching_sigterm:
            _SIGTERM.watch()
            self._watching_sigterm = True
        return _SIGTERM.received

    def _due(self, step: int) -> bool:
        """TF's interval rule: a step less than ``save_interval_steps`` after the last one saved
        or restored is skipped, and so is that same step again."""
        return self._last_step is None or step >= self._last_step + self.save_interval_steps

    def _save_options(self, step: int) -> CheckpointOptions:
        """The manager's options with retention appended to the write callbacks (after the user's)."""
        retention = functools.partial(self._after_commit, step)
        return self._options.replace(write_callbacks=(*self._options.write_callbacks, retention))

    def _after_commit(self, step: int) -> None:
        """Removes leftovers and the checkpoints that retention lets go (on the leader only)."""
        if distributed.process_index() != self._leader():
            return
        listing = self._list_here()
        for name in listing.leftovers:
            self._remove(name, "an uncommitted leftover")
        for old in self._expired(listing.committed, step):
            self._remove(listing.committed[old], f"retention (max_to_keep={self.max_to_keep}, "
                         f"keep_checkpoint_every_n_hours={self.keep_checkpoint_every_n_hours})")

    def _expired(self, committed: Mapping[int, str], just_saved: int) -> list[int]:
        """The steps that retention lets go: TF's ``_sweep``, with the directory as its state.

        The just-saved step counts as the newest, even if its number is lower, so it is
        never removed. Steps kept under the n-hour rule are older than the newest
        ``max_to_keep``, so every sweep walks them again and keeps them again.
        """
        if self.max_to_keep is None:
            return []
        order = [s for s in sorted(committed) if s != just_saved] + [just_saved]
        old = order[: -self.max_to_keep]
        if self.keep_checkpoint_every_n_hours is None:
            return old
        expired, last_kept = [], self._preserved_since
        for s in old:
            committed_at = self._commit_time(committed[s])
            if committed_at - self.keep_checkpoint_every_n_hours * 3600 >= last_kept:
                last_kept = committed_at
            else:
                expired.append(s)
        return expired

    def _commit_time(self, name: str) -> float:
        """When a step was committed: the mtime of its manifest, which is written last."""
        return os.stat(os.path.join(self._location.local_path, name, MANIFEST_FILE)).st_mtime

    def _list(self) -> Listing:
        """What the directory holds, as the process that owns storage sees it.

        With ``io_device`` only that process can see the directory (it may be its local
        disk), so it lists and tells the others: listing is then collective, like ``save``
        and ``restore``, and every process must make the same manager calls.
        """
        io = self._leader()
        if self._options.io_device is None or distributed.process_count() == 1:
            return self._list_here()
        coord = distributed.Coordinator(f"list {self.directory}", self._options.coordination_timeout)
        if coord.me != io:
            listing = json.loads(coord.receive("listing", io))
            return Listing({int(step): name for step, name in listing["committed"].items()}, listing["leftovers"])
        try:
            listing = self._list_here()
        except BaseException as error:
            coord.report_failure(error)
            raise
        coord.publish("listing", json.dumps(dataclasses.asdict(listing)))
        return listing

    def _list_here(self) -> Listing:
        with storage.Store(self._location, threads=1) as store:
            files = store.list()
        return parse_listing(files)

    def _leader(self) -> int:
        """The process that removes old steps and leftovers: the one that writes storage."""
        return self._options.io_device if self._options.io_device is not None else 0

    def _remove(self, name: str, why: str) -> None:
        """Deletes one step directory. The manifest goes first, so an interrupted delete
        leaves an uncommitted leftover and never a committed checkpoint with files missing."""
        logger.info("tpu_ckpt: removing %s: %s", self._location.child(name), why)
        with storage.Store(storage.Location(self._location.child(name)), threads=1) as store:
            with contextlib.suppress(FileNotFoundError):
                store.delete(MANIFEST_FILE)
            store.delete_all()


class _SigtermRecorder:
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


_SIGTERM = _SigtermRecorder()


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer, got {step!r}")
    try:
        value = operator.index(step)  # int, numpy and jax integer scalars
    except TypeError:
        raise TypeError(f"step must be an integer, got {step!r} of type {type(step).__name__}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def _check_max_to_keep(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"Expected a positive integer or `None` for `max_to_keep`, got {value!r}.")
    return value


def _check_hours(value: Any, loc: storage.Location) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"keep_checkpoint_every_n_hours must be a positive number of hours or None, got {value!r}")
    if not loc.is_local:
        raise ValueError(
            f"keep_checkpoint_every_n_hours needs commit times, read from manifest mtimes on a local "
            f"disk; {loc.url} is not local, and object stores (through tensorstore) report no "
            "modification times. Use max_to_keep alone there."
        )
    return float(value)


def _check_interval(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"save_interval_steps must be a positive integer, got {value!r}")
    return value
