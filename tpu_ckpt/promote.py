"""The persistent tier: a committed local step uploaded to ``directory`` in the background.

The upload is an ordinary save whose data files already exist: each process copies its own
data files from its local step (no second device-to-host copy, no second snapshot), and the
leader merges the indexes and commits exactly as ``tc.save`` does (``save.SaveJob``, whose
``write_own`` is the one step that differs). The result is an ordinary checkpoint:
``tc.restore``, the CLI and the export script read it like any other.

Its coordinator is made when the manager decides on the upload, on the caller's thread: like
every checkpoint call, coordinated operations are numbered in the order each process makes
them, and background threads finish in no fixed order.
"""

from __future__ import annotations

import logging
import os
import threading

from tpu_ckpt import data_writes, distributed, local_tier, storage
from tpu_ckpt.decode import decode_manifest
from tpu_ckpt.format import Manifest
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.save import SaveJob
from tpu_ckpt.save_plan import SavePlan, index_file
from tpu_ckpt.staging import Staging, prepare

logger = logging.getLogger(__name__)


class Upload:
    """The upload of one local step to ``final`` (a ``step_<n>`` under the manager's directory)."""

    def __init__(self, final: str, options: CheckpointOptions, step: int):
        self.final = storage.location(final)
        self.step = step
        self.options = options
        self.coord = distributed.Coordinator(f"save {self.final.url}", options.coordination_timeout)

    def abandon(self, error: BaseException) -> None:
        """The local save it was to upload failed here: the others stop waiting at once."""
        with self.coord:
            self.coord.report_failure(error, abandoned=True)

    def run(self, root: str) -> None:
        """Uploads this process's part of the committed local step under ``root``, and commits."""
        coord = self.coord
        try:
            source = local_tier.step_dir(root, self.step)
            plan = _decoded(os.path.join(source, local_tier.PLAN_FILE), tiled=False)
            index = _decoded(os.path.join(source, index_file(coord.me)), complete=False)
            staging = prepare(self.final, coord, 0, self.options.coordination_timeout, relayed=False)
        except BaseException as error:
            with coord:
                coord.report_failure(error)
            raise
        _FromLocalFiles(plan, index, source, self.final, coord, self.options, staging).run()


def _decoded(path: str, **how: bool) -> Manifest:
    with open(path, "rb") as f:
        return decode_manifest(f.read(), where=path, **how)


class _FromLocalFiles(SaveJob):
    """An ordinary save's job whose data files are copied from the local step."""

    def __init__(
        self, plan: Manifest, index: Manifest, source: str, final: storage.Location,
        coord: distributed.Coordinator, options: CheckpointOptions, staging: Staging,
    ):
        pieces = sum(len(leaf.pieces) for leaf in index.leaves)
        super().__init__(SavePlan(coord.me, plan, (), pieces), final, coord, 0, options, staging)
        self._index = index
        self._source = source
        self._own_files = (*index.files, index_file(coord.me))

    def write_own(self, store: storage.CheckpointStore) -> Manifest:
        """Copies this process's data files, ``writes_in_flight`` at a time, each mapped
        from the local disk rather than read into memory; returns this process's index."""
        writes = data_writes.Writes(store, None)
        for name in self._index.files:
            writes.copy(name, [local_tier.mapped(os.path.join(self._source, name))])
        writes.drain()
        return self._index


class Uploader:
    """Runs one upload at a time on its own thread, so the next local saves go on meanwhile.
    A failure is raised by the next :meth:`wait` (the manager's next upload,
    ``wait_until_finished`` or ``close``), never swallowed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None  # the step being uploaded: local retention keeps it

    def start(self, upload: Upload, root: str) -> None:
        def run() -> None:
            try:
                upload.run(root)
            except BaseException as error:  # noqa: BLE001 - raised by the next wait()
                logger.warning("tpu_ckpt: uploading the local step %d to %s failed: %s", upload.step, upload.final.url, error)
                self._error = error
            finally:
                self.step = None

        self.step = upload.step
        self._thread = threading.Thread(target=run, name=f"tpu_ckpt upload {upload.final.url}")
        self._thread.start()

    def wait(self) -> None:
        """Waits for the upload in flight; raises its failure (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
