"""The leader's commit: every process's index merged into the planned manifest, written last.

Each process but the leader leaves its index in the staging area as binary rows
(``format.encode_index``); the leader reads and checks them, merges them
(``saving/_merge.py``: array operations, no Python object per piece), writes the piece
tables and then the manifest, once the staging area holds every file they name, and makes
the checkpoint visible.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence

from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    IndexPlan,
    IndexRows,
    LeafEntry,
    Manifest,
    PieceEntry,
    decode_index,
    encode_index,
    grids_shared,
    staged_index_file,
    table_prefix,
    write,
)
from tpu_ckpt.saving._merge import Grids, merge_rows
from tpu_ckpt.settings import settings


def index(pieces: Mapping[str, Sequence[PieceEntry]], files: Mapping[str, int]) -> Manifest:
    """One process's piece locations and data files, in manifest form so one parser reads both."""
    leaves = tuple(LeafEntry(key, [], "array", pieces=tuple(p)) for key, p in pieces.items())
    return Manifest(leaves, dict(files), 0, "")


def commit(
    store: storage.Backend, final: storage.Location, planned: Manifest, own: Manifest | bytes, others: Iterable[int],
    progress: Callable[[str], None] = lambda note: None, token: str = "",
    finish: Callable[[Manifest], Manifest] | None = None,
) -> None:
    """The leader: merges its own index with those the ``others`` processes left in the
    staging area (read and checked ``io_threads`` at a time: at a thousand hosts one at a
    time would cost a thousand round trips), writes the piece tables and the manifest and
    commits the staging area as ``final``.

    The indexes are deleted while the merge runs, on the same threads, and the manifest
    waits for them: a committed checkpoint holds none, and a crash before its manifest
    leaves an uncommitted prefix that the next save or ``tpu-ckpt gc`` removes.

    ``progress`` hears how far it got (the coordinator's note to the processes waiting for
    the commit, so that a long one is not taken for a dead leader). ``token``: the one this
    save's object names carry (``Staging.token``). ``finish``: what the merged manifest still
    needs (the per-process values, ``saving/_per_process.py``). ``own``: the leader's index,
    or it encoded (``encode_index``), which lets a save drop its objects per piece first."""
    others = list(others)
    plan = IndexPlan.of(planned)
    encoded = own if isinstance(own, bytes) else encode_index(own, plan)
    mine = decode_index(encoded, where="the leader's own index", plan=plan)
    with concurrent.futures.ThreadPoolExecutor(settings().io_threads) as pool:  # one host's latency, not N
        indexes = [mine]
        for index in pool.map(functools.partial(_read_index, store, plan, token), others):
            indexes.append(index)
            progress(f"committing: read {len(indexes) - 1} of {len(others)} indexes")
        deleting = [pool.submit(store.delete, staged_index_file(process, token)) for process in others]
        with grids_shared():  # a leaf kept inline is gridded once, for its check and its encoding
            merged, grids = merge_rows(planned, plan, indexes)
            progress(f"committing: merged {len(others) + 1} indexes, writing the piece tables and the manifest")
            for deleted in deleting:
                deleted.result()
            write_manifest(store, merged if finish is None else finish(merged), grids, token)
    storage.publish(store.location, final, token)


def write_manifest(
    store: storage.Backend, manifest: Manifest, grids: Grids | None = None, token: str = ""
) -> None:
    """Writes ``manifest``'s piece tables, then the manifest, only once every file it names,
    data files and tables alike, is in the staging area: a commit never names a missing file.
    The data files are checked first too, so no table is written into a staging area that is
    gone (a leader that gave up removed it). ``grids``: per leaf, its rows ready (``merge_rows``);
    ``token``: the one the tables' names carry, like the data files' (``spread``).

    On an object store the manifest is created only if absent (``ObjectStore.create``): the
    save's staging area is the final prefix, which another save of the same checkpoint may
    share, and of two such saves exactly one commits; the other gets CheckpointExistsError.
    A local staging directory is the save's own, committed by its rename (``storage.publish``)."""
    storage.check_written(store, manifest.files)

    def every_file(tables: dict[str, int]) -> None:
        storage.check_written(store, {**manifest.files, **tables})

    create = store.create if isinstance(store, storage.ObjectStore) else None
    write(
        store, manifest, MANIFEST_FILE, check=every_file, grids=grids, table_prefix=table_prefix(token), commit=create
    )


def _read_index(store: storage.Backend, plan: IndexPlan, token: str, process: int) -> IndexRows:
    """Reads another process's index and checks it (``commit`` deletes it)."""
    name = staged_index_file(process, token)
    where = store.location.child(name)
    data = store.read_file(name)
    if not data:
        raise CorruptCheckpointError(
            f"{where}: process {process}'s index is missing or empty; the save cannot commit.", file=where
        )
    return decode_index(data, where=where, plan=plan)
