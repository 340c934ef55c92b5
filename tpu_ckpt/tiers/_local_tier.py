"""What a CheckpointManager with ``local_directory`` adds: the local tier and the uploads.

The manager (manager/_manager.py) keeps its rules for the persistent ``directory``; this object owns
the local tier's saves (``tiers/_local_steps.py``), the background uploads of local steps
to ``directory`` (``tiers/_upload.py``) and the choice, at restore, between the tiers
(``tiers/_choice.py``, ``tiers/_restore.py``). Every call is collective, like the manager's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

from tpu_ckpt import cluster, storage
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.saving import SaveResult, largest_file
from tpu_ckpt.tiers import _choice as tier_choice
from tpu_ckpt.tiers import _fallback as fallback
from tpu_ckpt.tiers import _local_steps as local_steps
from tpu_ckpt.tiers import _placement as placement
from tpu_ckpt.tiers import _restore as tier_restore
from tpu_ckpt.tiers import _slice_copies as slice_copies
from tpu_ckpt.tiers import _upload as uploads

logger = logging.getLogger(__name__)


class FromLocal(NamedTuple):
    """A restore the local tier served: the step and the tree."""

    step: int
    tree: Any


class LocalTier:
    """The local tier of one manager: ``root`` on every host's own disk."""

    def __init__(
        self, directory: str | os.PathLike[str], max_to_keep: int | None, replicas: int, options: CheckpointOptions,
    ):
        loc = storage.location(directory)
        if not loc.is_local:
            raise ValueError(f"local_directory must be a path on each host's own disk, got {loc.url!r}")
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(f"local_max_to_keep must be a positive integer or None, got {max_to_keep!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"local_replicas must be an integer >= 0, got {replicas!r}")
        if options.io_device is not None:
            raise ValueError(
                "local_directory cannot be combined with io_device: every process writes its own pieces to "
                "its own disk in the local tier. Drop io_device, or use the persistent directory alone."
            )
        self.root = os.path.abspath(loc.local_path)
        placement.warn_if_not_in_memory(self.root)
        slice_copies.warn_if_one_slice(cluster.process_count(), replicas)
        self.max_to_keep = max_to_keep
        self.replicas = replicas
        self._uploader = uploads.Uploader()
        self._failed: set[tuple[int, str]] = set()  # local saves (step, token) a restore found damaged

    def save(
        self, step: int, tree: Any, options: CheckpointOptions, metrics: dict[str, float | int] | None,
        upload: uploads.Upload | None,
    ) -> SaveResult:
        """A local save of ``step``, and once it is committed here, ``upload`` of it started
        on the uploader's thread (the previous upload has ended: see :meth:`wait_for_upload`)."""
        def then(error: BaseException | None) -> None:
            if error is not None:
                if upload is not None:
                    upload.abandon(error)
                return
            if upload is not None:
                self._uploader.start(upload, self.root)
            try:
                local_steps.prune(self.root, self.max_to_keep, self._uploader.step)
            except OSError as e:  # the step is committed; a step not removed now goes at the next save
                logger.warning("tpu_ckpt: could not remove old local steps in %s: %s", self.root, e)

        # Its files are cut as a save to where they may be uploaded would cut them.
        bound = largest_file(upload.final if upload is not None else storage.location(self.root), options)
        result = local_steps.save_local(
            self.root, step, tree, options, replicas=self.replicas, metrics=metrics, then=then, max_file_bytes=bound,
            max_to_keep=self.max_to_keep,
        )
        return result

    def wait_for_upload(self) -> None:
        """Waits for the upload in flight, and raises its failure (once)."""
        self._uploader.wait()

    def choose(self, persistent: Iterable[int], step: int | None, timeout: float) -> tier_choice.Choice:
        """The step the processes would restore, and from which tier (collective)."""
        with cluster.Coordinator(f"choose a step in {self.root}", timeout) as coord:
            return tier_choice.choose(coord, self.root, persistent, step, self._failed)

    def restore(
        self, persistent: Iterable[int], step: int | None, target: Any, options: CheckpointOptions
    ) -> FromLocal | int | None:
        """Restores ``step`` (None: the newest) from the local tier if some tier-wide copy of
        it is whole and no newer one is in ``persistent``: returns the step and the tree. Else,
        or when the local restore failed anywhere (``_fallback``), returns the persistent step
        to restore, or None (collective)."""
        persistent = list(persistent)
        choice, restored, failure = None, None, None
        try:
            with cluster.Coordinator(f"restore from {self.root}", options.coordination_timeout) as coord:
                try:
                    choice = tier_choice.choose(coord, self.root, persistent, step, self._failed)
                    if choice.local_step is not None:
                        restored = tier_restore.restore_local(coord, self.root, choice, target, options)
                except Exception as error:
                    coord.report_failure(error)  # wakes whoever waits on this process
                    raise
        except Exception as error:  # noqa: BLE001 - every failure goes to the agreement, then falls back or raises
            failure = error
        verdict = fallback.agree(self.root, failure, options.coordination_timeout)
        if verdict.cause is not None:
            local = None if choice is None else choice.local_step
            if choice is not None and local is not None and verdict.damaged:
                self._failed.add((local, choice.token))  # as on every process: chosen and listed no more
            return fallback.fall_back(self.root, local, verdict, failure, persistent, step)
        if choice is None or choice.local_step is None or restored is None:
            return None if choice is None else choice.step
        tree, nbytes = restored
        logger.info("tpu_ckpt: restored the local step %d (%.1f MB read by this process)",
                    choice.local_step, nbytes / 1e6)
        return FromLocal(choice.local_step, tree)
