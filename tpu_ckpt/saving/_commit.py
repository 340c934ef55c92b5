"""The leader's commit: every process's index merged into the planned manifest, written last.

The merge (``merge_indexes``) is a pure function from the plan's manifest and the indexes to
a new manifest, so what a commit would write is checked without storage and nobody's dicts
change under them; ``commit`` adds the IO around it: collect the others' indexes, check the
staging area holds the files they claim and the piece tables, write the manifest, make the
checkpoint visible.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import operator
from collections.abc import Iterable, Mapping, Sequence

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    LeafEntry,
    Manifest,
    PieceEntry,
    decode_manifest,
    grids_shared,
    tiling_problem,
    write,
)
from tpu_ckpt.saving._plan import index_file
from tpu_ckpt.settings import settings

_BY_SLICE = operator.itemgetter(0)  # a PieceEntry's slice


def index(pieces: Mapping[str, Sequence[PieceEntry]], files: Mapping[str, int]) -> Manifest:
    """One process's piece locations and data files, in manifest form so one parser reads both."""
    leaves = tuple(LeafEntry(key, [], "array", pieces=tuple(p)) for key, p in pieces.items())
    return Manifest(leaves, dict(files), 0, "")


def merge_indexes(planned: Manifest, indexes: Sequence[Manifest], check: bool = True) -> Manifest:
    """``planned`` completed by the indexes of every process: each leaf's pieces (sorted by
    slice) and every data file. Raises if a leaf's merged pieces miss or repeat a block
    (unless ``check`` is False: the caller asks :func:`uncovered` itself)."""
    pieces: dict[str, list[PieceEntry]] = {}
    files: dict[str, int] = {}
    for one in indexes:
        files.update(one.files)
        for leaf in one.leaves:
            pieces.setdefault(leaf.key, []).extend(leaf.pieces)
    leaves = tuple(
        dataclasses.replace(e, pieces=tuple(sorted(pieces.get(e.key, ()), key=_BY_SLICE))) for e in planned.leaves
    )
    merged = dataclasses.replace(planned, leaves=leaves, files=dict(sorted(files.items())))
    problem = uncovered(merged) if check else None
    if problem is not None:
        raise CheckpointError(
            f"Leaf {problem[0]!r}: {problem[1]}; refusing to commit an inconsistent checkpoint. "
            "Are all processes saving the same tree?",
            key=problem[0],
        )
    return merged


def commit(
    store: storage.Backend, final: storage.Location, planned: Manifest, own: Manifest, others: Iterable[int]
) -> None:
    """The leader: merges its own index with those the ``others`` processes left in the
    staging area (read and deleted ``io_threads`` at a time: at a thousand hosts one at a
    time would cost a thousand round trips), writes the manifest and commits the staging
    area as ``final``."""
    with concurrent.futures.ThreadPoolExecutor(settings().io_threads) as pool:  # one host's latency, not N
        indexes = [own, *pool.map(functools.partial(_take_index, store), others)]
    with grids_shared():  # the tiling check's grids serve the piece table
        write_manifest(store, merge_indexes(planned, indexes))
    storage.publish(store.location, final)


def write_manifest(store: storage.Backend, manifest: Manifest) -> None:
    """Writes ``manifest``'s piece tables, then the manifest, only once every file it names,
    data files and tables alike, is in the staging area: a commit never names a missing file.
    The data files are checked first too, so no table is written into a staging area that is
    gone (a leader that gave up removed it)."""
    storage.check_written(store, manifest.files)

    def every_file(tables: dict[str, int]) -> None:
        storage.check_written(store, {**manifest.files, **tables})

    write(store, manifest, MANIFEST_FILE, check=every_file)


def _take_index(store: storage.Backend, process: int) -> Manifest:
    """Reads another process's index and deletes it: a committed checkpoint holds none."""
    name = index_file(process)
    theirs = decode_manifest(store.read_file(name) or b"", where=store.location.child(name), complete=False)
    store.delete(name)
    return theirs


def uncovered(manifest: Manifest) -> tuple[str, str] | None:
    """The first array leaf whose pieces miss or repeat a block, and what is wrong, or None."""
    for leaf in manifest.leaves:
        problem = None if leaf.kind != "array" else tiling_problem(leaf.shape, [p.slice for p in leaf.pieces])
        if problem:
            return leaf.key, problem
    return None
