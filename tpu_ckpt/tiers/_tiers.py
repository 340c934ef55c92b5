"""What a CheckpointManager with ``local_directory`` adds: the local tier and the uploads.

The manager (manager.py) keeps its rules for the persistent ``directory``; this object owns
the local tier's cadence, its saves (``local_tier.py``), the background uploads of local steps
to ``directory`` (``promote.py``) and the choice, at restore, between the tiers
(``tier_restore.py``). Every call is collective, like the manager's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from tpu_ckpt import cluster, storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError, RemoteProcessError
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.saving import SaveResult, largest_file
from tpu_ckpt.tiers import _local_tier as local_tier
from tpu_ckpt.tiers import _promote as promote
from tpu_ckpt.tiers import _restore as tier_restore
from tpu_ckpt.tiers._cadence import Cadence

logger = logging.getLogger(__name__)


def _fall_back(error: CheckpointError, local_step: int, persistent: Iterable[int], step: int | None) -> int:
    """The persistent step to restore when a damaged local file (crc32c, truncation), on any
    process, failed the local restore: every process raised, this or a
    ``RemoteProcessError`` naming it, so every process falls back alike. A request for a
    step the persistent tier lacks, or another failure, raises ``error``."""
    damaged = isinstance(error, CorruptCheckpointError) or (
        isinstance(error, RemoteProcessError) and error.remote_type == CorruptCheckpointError.__name__
    )
    older = [s for s in persistent if s <= local_step and (step is None or s == step)]
    if not damaged or not older:
        raise error
    logger.warning("tpu_ckpt: local step %d is damaged (%s); restoring persistent step %d instead", local_step, error, max(older))
    return max(older)


class LocalTier:
    """The local tier of one manager: ``root`` on every host's own disk."""

    def __init__(
        self, directory: str | os.PathLike[str], interval_steps: int, max_to_keep: int | None, replicas: int,
        options: CheckpointOptions,
    ):
        loc = storage.location(directory)
        if not loc.is_local:
            raise ValueError(f"local_directory must be a path on each host's own disk, got {loc.url!r}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"local_max_to_keep must be a positive integer or None, got {max_to_keep!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ValueError(f"local_replicas must be an integer >= 0, got {replicas!r}")
        if options.io_device is not None:
            raise ValueError(
                "local_directory cannot be combined with io_device: every process writes its own pieces to "
                "its own disk in the local tier. Drop io_device, or use the persistent directory alone."
            )
        self.root = os.path.abspath(loc.local_path)
        self.cadence = Cadence(interval_steps, False, None)
        self.max_to_keep = max_to_keep
        self.replicas = replicas
        self._uploader = promote.Uploader()

    def save(
        self, step: int, tree: Any, options: CheckpointOptions, metrics: dict[str, float | int] | None,
        upload: promote.Upload | None,
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
                local_tier.prune(self.root, self.max_to_keep, self._uploader.step)
            except OSError as e:  # the step is committed; a step not removed now goes at the next save
                logger.warning("tpu_ckpt: could not remove old local steps in %s: %s", self.root, e)

        # Its files are cut as a save to where they may be uploaded would cut them.
        bound = largest_file(upload.final if upload is not None else storage.location(self.root), options)
        result = local_tier.save_local(
            self.root, step, tree, options, replicas=self.replicas, metrics=metrics, then=then, max_file_bytes=bound
        )
        self.cadence.counts_from(step)
        return result

    def wait_for_upload(self) -> None:
        """Waits for the upload in flight, and raises its failure (once)."""
        self._uploader.wait()

    def choose(self, persistent: Iterable[int], step: int | None, timeout: float) -> tier_restore.Choice:
        """The step the processes would restore, and from which tier (collective)."""
        with cluster.Coordinator(f"choose a step in {self.root}", timeout) as coord:
            return tier_restore.choose(coord, self.root, persistent, step)

    def restore(self, persistent: Iterable[int], step: int | None, target: Any, options: CheckpointOptions) -> tuple[int | None, Any]:
        """Restores ``step`` (None: the newest) from the local tier if some tier-wide copy of
        it is whole and no newer one is in ``persistent``: returns the step and the tree. Else
        returns the persistent step to restore (or None) and no tree (collective)."""
        with cluster.Coordinator(f"restore from {self.root}", options.coordination_timeout) as coord:
            choice = tier_restore.choose(coord, self.root, persistent, step)
            if not choice.local:
                return choice.step, None
            try:
                tree, nbytes = tier_restore.restore_local(coord, self.root, choice, target, options)
            except (CorruptCheckpointError, RemoteProcessError) as error:
                return _fall_back(error, choice.step, persistent, step), None
        logger.info("tpu_ckpt: restored the local step %d (%.1f MB read by this process)", choice.step, nbytes / 1e6)
        self.cadence.counts_from(choice.step)
        return choice.step, tree
