"""CheckpointManager: numbered checkpoints of a training loop in one directory.

A loop calls ``save(step, tree)`` every step. The manager writes a checkpoint when its save rules say so
(manager/_cadence.py: TensorFlow's interval, Orbax's multiples, or continuous saving). It keeps the newest
``max_to_keep`` checkpoints, one every ``keep_checkpoint_every_n_hours``, and the ``keep_best`` best by a metric
(manager/_retention.py), and it tells the loop when the job is being preempted.

The directory is the source of truth: one ``step_<n>`` per committed checkpoint, committed
once its manifest exists (see storage/_stores.py), and no state file, so a new manager (after a
restart, on another host) sees exactly the committed steps, and a crash never leaves a state
file and the checkpoints disagreeing. Metrics live in each step's manifest for the same reason.

Retention and the removal of uncommitted leftovers run as a write callback of each save, after
its commit, on the leader (which alone lists the directory, once per manager call: ``_list``).

With ``local_directory`` a second, local tier saves often to each host's own disk and the persistent steps are uploaded
from it in the background (``tiers/_local_tier.py``); a restore takes the newest step either tier holds whole.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from tpu_ckpt import cluster, storage, tiers
from tpu_ckpt.catalog import Listing, remove_leftover
from tpu_ckpt.errors import CheckpointExistsError
from tpu_ckpt.format import MANIFEST_FILE, metric_values
from tpu_ckpt.manager import _intact as intact
from tpu_ckpt.manager import _references as references
from tpu_ckpt.manager import _retention as retention
from tpu_ckpt.manager._arguments import NO_TREE, check_step, manager_options, refuse_orbax_keywords, restore_arguments
from tpu_ckpt.manager._cadence import Cadence
from tpu_ckpt.manager._preemption import PreemptionWatch
from tpu_ckpt.manager._run_directory import RunDirectory
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import restore
from tpu_ckpt.saving import SaveResult, save


class CheckpointManager:
    """Saves numbered checkpoints into one directory, prunes old ones, and detects preemption.

    Args:
      directory: where the ``step_<n>`` checkpoints live. A local path, or a ``memory://``, ``gs://`` or ``s3://`` URL.
      max_to_keep: how many of the newest checkpoints to keep. ``None`` keeps all of them.
      keep_checkpoint_every_n_hours: also keep, forever, each checkpoint that leaves the newest ``max_to_keep`` at least
        this many hours after the last one kept this way (TF's rule), by manifest mtimes: local directories only (copy
        with ``cp -p``). The clock starts at creation on an empty directory (as in TF), else at the oldest step.
      save_interval_steps: ``save`` writes only when ``step`` is at least this many steps past the last step this
        manager saved or restored (TF's ``checkpoint_interval``). A manager's first save is always due, as in TF.
      save_on_multiples: instead, write the steps that are multiples of ``save_interval_steps`` (Orbax's rule: 0, 10,
        20, ...), past the last step saved or restored. A job interrupted at a multiple then loses no step.
      save_interval_seconds: continuous saving (Orbax's ``ContinuousCheckpointingPolicy``):
        also require that this manager's last save has finished (no longer writing in the
        background) and at least this many seconds have passed since it started, or since
        the last ``restore``; 0: whenever no save is in flight. The io process decides for all.
      keep_best: also keep this many steps, those whose ``best_fn`` score is best.
      best_fn: a step's score, from the metrics given to its ``save``; see manager/_retention.py.
      best_mode: ``"max"`` (the highest score is best) or ``"min"``.
      options: the :class:`CheckpointOptions` of every save, and the default for ``restore``.
      local_directory: a path on each host's own disk (local SSD, RAM disk), the local tier, where each process saves
        its own pieces; persistent steps are uploaded to ``directory`` from those files in the background
        (tiers/_local_tier.py).
      local_interval_steps: the local tier saves every this many steps (and every persistent one).
      local_max_to_keep: how many of its newest local steps each host keeps.
      local_replicas: how many other hosts get a copy of each process's local pieces.
      incremental: pieces equal to the last step's are referenced, not written (manager/_references.py).

    Raises:
      ValueError: a retention, interval or local-tier argument is out of range.
      TypeError: ``options`` is not a :class:`CheckpointOptions` (Orbax's options are keywords here).

    Every process of a multi-process job creates the manager and makes the same calls (SPMD:
    ``save``, ``restore``, ``latest_step``, ``all_steps``), as one process lists for all.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        save_interval_steps: int = 1,
        save_on_multiples: bool = False,
        save_interval_seconds: float | None = None,
        keep_best: int | None = None,
        best_fn: retention.BestFn | None = None,
        best_mode: str = "max",
        options: CheckpointOptions | None = None,
        local_directory: str | os.PathLike[str] | None = None,
        local_interval_steps: int = 1,
        local_max_to_keep: int | None = 2,
        local_replicas: int = 1,
        incremental: bool = False,
    ):
        self._location = storage.location(directory)
        self.directory = self._location.url
        self._retention = retention.Retention.checked(
            self._location, max_to_keep, keep_checkpoint_every_n_hours, keep_best, best_fn, best_mode
        )
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = self._retention.every_n_hours
        self._cadence = Cadence(save_interval_steps, save_on_multiples, save_interval_seconds)
        self.save_interval_steps = save_interval_steps
        self._options = manager_options(options)
        self._pending: SaveResult | None = None
        self._scores: dict[str, float | None] = {}  # step directory -> its best_fn score
        self._run = RunDirectory(self._location, self._leader())
        self._checks = intact.Checks(self._location, self._leader())  # which newest steps fail their checks
        # TF's last_preserved_timestamp, which TF reads from its state file (see Args).
        self._preserved_since = time.time() - 1 if not self._list().committed else -math.inf
        self._preemption = PreemptionWatch()
        self._tier = None if local_directory is None else tiers.LocalTier(
            local_directory, local_max_to_keep, local_replicas, self._options
        )
        self._local_cadence = (
            None if local_directory is None else Cadence(local_interval_steps, False, None, "local_interval_steps")
        )
        self._incremental = references.incremental_state(incremental, local_directory)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def save(
        self, step: int, tree: Any = NO_TREE, *, metrics: Mapping[str, Any] | None = None, force: bool = False,
        **orbax: Any,
    ) -> bool:
        """Saves ``tree`` as step ``step`` if :meth:`should_save` says so, or if ``force`` is set.

        ``metrics`` (name -> number, e.g. ``{"loss": loss}``) are stored in the step's manifest: ``tpu-ckpt ls`` shows
        them, and ``keep_best`` ranks steps by them. Returns whether a save was started. With asynchronous options the
        save is started but not yet committed; it is committed once :meth:`wait_until_finished` returns. A save first
        waits for the one before it and raises that one's failure, if any. After a restart, resume with :meth:`restore`.
        That also sets the step from which the interval counts. With ``local_directory`` a step is saved locally when
        either tier is due, and uploaded to ``directory`` in the background when the persistent tier is (see
        tiers/_local_tier.py); ``force`` saves to both.

        Raises:
          CheckpointExistsError: step ``step`` is already committed (nothing is ever overwritten).
          TypeError: no ``tree``, or Orbax's keywords (``**orbax``, e.g. ``args=``) instead of it.
        """
        refuse_orbax_keywords("save(step, state)", orbax, missing=tree is NO_TREE)
        step = check_step(step, "save(step, tree)")
        persistent = force or self.should_save(step)
        if not persistent and (self._local_cadence is None or not self._local_cadence.steps_due(step)):
            return False
        metrics = None if metrics is None else metric_values(metrics)
        score = None if metrics is None else self._retention.score(metrics, step)  # a broken best_fn fails here
        self._wait_for_save()
        if self._tier is None or self._local_cadence is None:
            path, options = self._persistent(step, score)
            self._pending = save(path, tree, options=options, metrics=metrics, incremental=self._incremental)
        else:
            upload = None
            if persistent:
                self._tier.wait_for_upload()  # one upload at a time
                upload = tiers.Upload(*self._persistent(step, score), step)
            self._pending = self._tier.save(step, tree, self._options, metrics, upload)
            self._local_cadence.counts_from(step)
        if persistent:
            self._cadence.counts_from(step)
        return True

    def _persistent(self, step: int, score: float | None) -> tuple[str, CheckpointOptions]:
        """Where the persistent step goes and its save's options (retention after the commit); raises if committed."""
        listing = self._list()
        if step in listing.committed:
            raise CheckpointExistsError(
                f"Step {step} is already committed in {self.directory} as {listing.committed[step]!r}; "
                "tpu_ckpt never overwrites a checkpoint. Save a different step, or delete that one first.",
                file=self._location.child(listing.committed[step]),
            )
        name = f"step_{step}"
        references.before_save(self._incremental, listing, self._location.child(name))  # never into a retired step
        if name in listing.leftovers and cluster.process_index() == self._leader():
            # An interrupted save of this step: in a local save's way; an object store's, in its grace period, may be a
            # zombie writing.
            why = "an uncommitted leftover of an earlier save of this step"
            remove_leftover(self._location, name, why, even_busy=self._location.is_local)
        if cluster.process_index() == self._leader():
            self._run.started(name)
        retain = functools.partial(self._after_commit, step, name, score, listing)
        options = self._options.replace(write_callbacks=(*self._options.write_callbacks, retain))
        return self._location.child(name), options

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would write ``step`` now (without ``force``): see manager/_cadence.py.

        With ``save_interval_seconds`` in a multi-process job this is collective (the io process decides for all, as the
        others' clocks and background writes differ), so every process must call it, or ``save``, at the same steps.
        """
        step = check_step(step, "should_save(step)")
        if not self._cadence.steps_due(step):
            return False
        if self._cadence.every_seconds is None:
            return True
        in_flight = self._pending is not None and not self._pending.done()
        if cluster.process_count() == 1:
            return self._cadence.time_due(in_flight)
        what = f"should_save({step}) in {self.directory}"
        with cluster.Coordinator(what, self._options.coordination_timeout) as coord:
            if coord.me != self._leader():
                return coord.receive("due", self._leader()) == "yes"
            due = self._cadence.time_due(in_flight)
            coord.publish("due", "yes" if due else "no")
            return due

    def restore(
        self, step: Any = None, target: Any = None, *, options: CheckpointOptions | None = None, fallback: bool = False,
        **orbax: Any,
    ) -> Any:
        """Restores step ``step`` (``None``: the latest committed one) into ``target``, with
        ``options`` (default: the manager's); see :func:`tpu_ckpt.restore`. ``restore(target)``,
        Orbax's habit, is ``restore(None, target)``: a first argument that is no integer is the target.

        The latest step's manifest is checked first (its seal, crc32c, and fields): if it fails, the restore raises
        ``CorruptCheckpointError`` naming the step, unless ``fallback`` is set: then each step failing its check, or
        whose data fails them on any process as it is read, is skipped with a warning naming it, and the newest intact
        step is restored.

        With ``local_directory``: from the local tier when every process's part of the step is on some live host (its
        own disk or a replica) and ``directory`` has no newer step; else from ``directory``. First waits for a save in
        flight, and raises its failure like :meth:`wait_until_finished`. The restored step then counts as the last saved
        step for the save rules, as after TF's ``restore_or_initialize``.

        Raises:
          CheckpointNotFoundError: no committed checkpoint, or none for ``step``.
          CorruptCheckpointError: the latest step is damaged (without ``fallback``), or ``step`` is.
          TypeError: Orbax's keywords (``**orbax``, e.g. ``args=``), or a non-integer step and a target.
        """
        step, target = restore_arguments(step, target, orbax)  # checked, before any wait or listing
        self.wait_until_finished()
        committed = self._list().committed
        options = options if options is not None else self._options
        tier = None if self._tier is None else functools.partial(self._tier.restore, step=step, target=target,
                                                                 options=options)
        found = self._checks.restorable(self.directory, committed, step, fallback, options.coordination_timeout, tier)
        if isinstance(found, tiers.FromLocal):
            step, tree = found
        else:  # a step asked for by number is restored, or refused, as it is: no fallback
            step, tree = self._checks.restored(
                self.directory, committed, found, fallback and step is None, options.coordination_timeout,
                lambda s: restore(self._location.child(committed[s]), target, options=options))
        for cadence in (self._cadence, self._local_cadence):
            if cadence is not None:
                cadence.counts_from(step)
        return tree

    def latest_step(self) -> int | None:
        """The highest committed step whose manifest is intact, or ``None``: what
        ``restore(fallback=True)`` restores. A save still in flight does not count.
        With ``local_directory``: the step :meth:`restore` would restore, from either tier."""
        timeout = self._options.coordination_timeout
        tier = None if self._tier is None else lambda listed: self._tier.choose(listed, None, timeout).step  # type: ignore[union-attr]
        return self._checks.latest(self._list().committed, timeout, tier)

    def all_steps(self) -> list[int]:
        """Every committed step (of ``directory``, the persistent tier), in ascending order,
        but those above the newest intact one that fail their checks (see :meth:`restore`)."""
        return self._checks.intact(self._list().committed, self._options.coordination_timeout)

    def wait_until_finished(self) -> None:
        """Waits until the save in flight (and an upload to ``directory``) is committed; raises its failure (once)."""
        self._wait_for_save()
        if self._tier is not None:
            self._tier.wait_for_upload()
        self._run.settle()

    def _wait_for_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def close(self) -> None:
        """Waits for the save in flight, and stops watching for SIGTERM (see :meth:`reached_preemption`)."""
        try:
            self.wait_until_finished()
        finally:
            self._preemption.close()
            self._run.close()

    def reload(self) -> None:
        """Lists ``directory`` anew (collective), as after steps were deleted by other means.

        On an object store the leader lists every object of the run once and then keeps the listing up to date with its
        own saves and removals (see manager/_run_directory.py); what others changed since is seen after this."""
        self._run.reload(self._options.coordination_timeout)

    def reached_preemption(self, step: int) -> bool:
        """Whether the job is being preempted and ``step`` is where every process saves and exits.

        Under JAX's distributed runtime this is JAX's preemption sync point
        (``multihost_utils.reached_preemption_sync_point``). The processes agree on the step, and every process must
        call this at every step. In a single-process run it is True once the process has received SIGTERM; the first
        call (on the main thread) installs a handler recording it, which :meth:`close` removes. A typical loop::

            if manager.reached_preemption(step):
                manager.save(step, state, force=True)
                manager.wait_until_finished()
                break
        """
        return self._preemption.reached(check_step(step, "reached_preemption(step)"))

    def _after_commit(self, step: int, name: str, score: float | None, before: Listing) -> None:
        """Removes ``before``'s leftovers (each checked again first) and lets retention go on the removal
        thread, deciding from what is committed then (manager/_references.py); on the leader only."""
        if cluster.process_index() != self._leader():
            return
        self._scores[name] = score
        self._run.committed(name)
        leftovers = [n for n in before.leftovers if n != name and n not in before.busy]
        self._run.remove((n, "an uncommitted leftover", False) for n in leftovers)
        why = f"retention ({self._retention.rules})"
        expired = functools.partial(self._expired, step, name)
        self._run.submit(functools.partial(references.retain, self._run, expired, why))
        if not self._options.enable_async:
            self._run.settle()  # a synchronous save returns with the directory as retention leaves it

    def _expired(self, step: int, name: str, committed: dict[int, str]) -> list[int]:
        """The steps of ``committed`` (what the run holds now) that retention lets go after
        ``step``: never the newest intact one, though newer steps fail their checks (``_intact``)."""
        committed = {**committed, step: name}
        expired = self._checks.spare(committed, step, self._retention.expired(
            list(committed), step, preserved_since=self._preserved_since,
            commit_time=lambda s: self._commit_time(committed[s]),
            score=lambda s: self._score(committed[s], s),
        ))
        for old in expired:
            self._scores.pop(committed[old], None)
        return expired

    def _score(self, name: str, step: int) -> float | None:
        """A step's ``best_fn`` score, read once (``retention.saved_score``)."""
        if name not in self._scores:
            where = storage.Location(self._location.child(name))
            self._scores[name] = retention.saved_score(self._retention, where, step)
        return self._scores[name]

    def _commit_time(self, name: str) -> float:
        """When a step was committed: the mtime of its manifest, which is written last."""
        return os.stat(os.path.join(self._location.local_path, name, MANIFEST_FILE)).st_mtime

    def _list(self) -> Listing:
        """What the directory holds, as the leader sees it (collective; see RunDirectory)."""
        return self._run.listing(self._options.coordination_timeout)

    def _leader(self) -> int:
        """The process that removes old steps and leftovers: the one that writes storage."""
        return self._options.io_device if self._options.io_device is not None else 0
