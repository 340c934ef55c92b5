"""The persistent tier: a committed local step uploaded to ``directory`` in the background.

The upload is an ordinary save whose data files already exist: each process copies its own
data files from its local step (no second device-to-host copy, no second snapshot; on an
object store named with the upload's token, as every save there names them), and the
leader merges the indexes and commits exactly as ``tc.save`` does (``saving.SaveJob``, given the
files to copy as ``saving.OwnFiles``: the one step that differs). The result is an ordinary checkpoint:
``tc.restore``, the CLI and the export script read it like any other.

Its coordinator is made when the manager decides on the upload, on the caller's thread: like
every checkpoint call, coordinated operations are numbered in the order each process makes
them, and background threads finish in no fixed order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt import cluster, saving, storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    PLAN_FILE,
    TIER_FILE,
    IndexPlan,
    Manifest,
    PieceEntry,
    crc32c,
    decode_index,
    decode_manifest,
    index_manifest,
    spread,
    staged_index_file,
)
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.saving import OwnFiles, SaveJob, SavePlan, prepare
from tpu_ckpt.tiers import _local_steps as local_steps
from tpu_ckpt.tiers import _local_values as local_values
from tpu_ckpt.tiers import _part_checks as part_checks

logger = logging.getLogger(__name__)


class Upload:
    """The upload of one local step to ``final`` (a ``step_<n>`` under the manager's directory)."""

    def __init__(self, final: str, options: CheckpointOptions, step: int):
        self.final = storage.location(final)
        self.step = step
        self.options = options
        self.coord = cluster.Coordinator(f"save {self.final.url}", options.coordination_timeout)

    def abandon(self, error: BaseException) -> None:
        """The local save it was to upload failed here: the others stop waiting at once."""
        with self.coord:
            self.coord.report_failure(error, abandoned=True)

    def run(self, root: str) -> None:
        """Uploads this process's part of the committed local step under ``root``, and commits."""
        coord = self.coord
        try:
            source = local_steps.step_dir(root, self.step)
            data, where = _read(source, PLAN_FILE)
            plan = local_values.own_values(source, decode_manifest(data, where=where, tiled=False), coord.me)
            parts = part_checks.check_step(source, self.step, None, data)  # the plan and index of this save
            index = _uploaded(source, _own_index(source, plan, coord.me, parts, self.step))
            staging = prepare(self.final, coord, 0, self.options.coordination_timeout, relayed=False)
        except BaseException as error:
            with coord:
                coord.report_failure(error)
            raise
        names = {name: spread(staging.token, name) for name in index.files}
        copies = OwnFiles(tuple(names.values()), lambda writes: _copy(index, source, names, writes))
        pieces = sum(len(leaf.pieces) for leaf in index.leaves)
        SaveJob(
            SavePlan(coord.me, plan, (), pieces), self.final, coord, 0, self.options, staging, own_files=copies
        ).run()


def _read(source: str, name: str) -> tuple[bytes, str]:
    data, where = storage.read_whole(source, name), os.path.join(source, name)
    if data is None:
        raise CorruptCheckpointError(f"{where} is missing", file=where)
    return data, where


def _own_index(source: str, plan: Manifest, me: int, parts: dict[str, Any] | None, step: int) -> Manifest:
    """This process's part's index (binary rows, checked against ``tier.json``'s ``parts`` and
    the plan), in manifest form."""
    data, where = _read(source, staged_index_file(me))
    part_checks.check_index(source, data, me, parts, step)
    rows_plan = IndexPlan.of(plan)
    return index_manifest(decode_index(data, where=where, plan=rows_plan), rows_plan)


def _uploaded(source: str, index: Manifest) -> Manifest:
    """What of this process's part goes up: all of it, or, where each slice wrote a whole
    copy (``_slice_copies``), nothing unless it is of process 0's slice (the copies repeat each
    other's pieces; one is the persistent step)."""
    copy = (storage.read_json(source, TIER_FILE, 1 << 16) or {}).get("copy")
    if copy is None or 0 in copy:
        return index
    leaves = tuple(dataclasses.replace(leaf, pieces=()) for leaf in index.leaves)
    return dataclasses.replace(index, leaves=leaves, files={})


def _copy(index: Manifest, source: str, names: dict[str, str], writes: saving.Writes) -> Manifest:
    """Copies this process's data files from the local step ``source`` as ``names`` says,
    ``writes_in_flight`` at a time (and within ``host_memory_limit``); returns this process's
    index. Each file is read into memory, never mapped (a local file truncated meanwhile would
    kill the process with SIGBUS), and checked as it is read (:func:`_checked`): a damaged
    local file fails the upload rather than being committed to the persistent tier."""
    pieces = _pieces_by_file(index)
    try:
        for name, size in index.files.items():
            writes.make_room(size)
            writes.copy(names[name], [_checked(source, name, size, pieces.get(name, ()))])
    except BaseException:
        writes.settle()  # nothing may land after the staging area is removed
        raise
    writes.drain()
    return _renamed(index, names)


def _renamed(index: Manifest, names: dict[str, str]) -> Manifest:
    """``index`` with its data files named as this upload wrote them: on an object store,
    with the upload's token (``format.spread``), as any save into a shared prefix names them."""
    leaves = tuple(
        dataclasses.replace(leaf, pieces=tuple(p._replace(file=names[p.file]) for p in leaf.pieces))
        for leaf in index.leaves
    )
    return dataclasses.replace(index, leaves=leaves, files={names[name]: size for name, size in index.files.items()})


def _pieces_by_file(index: Manifest) -> dict[str, list[tuple[str, PieceEntry]]]:
    by_file: dict[str, list[tuple[str, PieceEntry]]] = {}
    for leaf in index.leaves:
        for piece in leaf.pieces:
            by_file.setdefault(piece.file, []).append((leaf.key, piece))
    return by_file


def _checked(source: str, name: str, size: int, pieces: Sequence[tuple[str, PieceEntry]]) -> np.ndarray:
    """The ``size`` bytes of local file ``name``, each of its pieces checked against its
    crc32c: a file damaged or cut short on the local disk since its save raises
    :class:`CorruptCheckpointError` naming it."""
    where = os.path.join(source, name)
    try:
        data = storage.read_ranges(source, name, 0, [size])[0]
    except CorruptCheckpointError as error:
        raise CorruptCheckpointError(f"{error}. {_ABANDONED}", file=where) from error
    for key, piece in pieces:
        if crc32c(data[piece.offset : piece.offset + piece.length]) != piece.crc32c:
            raise CorruptCheckpointError(
                f"Leaf {key!r}: the piece at bytes {piece.offset}-{piece.offset + piece.length} of the local file "
                f"{where} does not match its crc32c: the local step was damaged since it was saved. {_ABANDONED}",
                key=key,
                file=where,
            )
    return data


_ABANDONED = (
    "Its upload is abandoned and nothing was committed to the persistent tier; the local step stays "
    "(a restore of it falls back to the persistent tier if it is damaged). Check that disk."
)


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
                logger.warning("tpu_ckpt: uploading the local step %d to %s failed: %s",
                               upload.step, upload.final.url, error)
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
