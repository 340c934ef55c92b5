"""Reading a checkpoint's committed manifest, with the errors a user can act on.

Through an open store (``open_checkpoint``: restore, export and the command line), or alone
(``read_manifest``: for callers that keep only the manifest).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NoReturn

from tpu_ckpt import storage
from tpu_ckpt.catalog import _listing as listing
from tpu_ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UncommittedCheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    REFERENCED_FILE,
    Manifest,
    TableSource,
    crc32c,
    decode_manifest,
    left_by_a_save,
)


def read_manifest(loc: storage.Location) -> Manifest:
    """The committed manifest at ``loc``, held alone: its piece tables are read, when its
    pieces are first used, through a store of their own per read (``table_source``)."""
    with storage.Store(loc, threads=1) as store:
        return committed_manifest(store, table_source(loc))


def committed_manifest(store: storage.ReadableStore, tables: TableSource) -> Manifest:
    """The manifest in ``store``, its piece tables read through ``tables``; a typed error if
    there is none or it is unusable. A store on the storage itself tells why there is none
    (one listing) and checks a linked checkpoint's source; a relay's server did both."""
    loc = store.location
    data = store.read_file(MANIFEST_FILE)
    if data is None:
        if isinstance(store, storage.Backend):
            _raise_missing(loc, store.list())
        raise UncommittedCheckpointError(f"{loc.url} lost its {MANIFEST_FILE} during the restore", file=loc.url)
    manifest = decode_manifest(data, where=loc.child(MANIFEST_FILE), tables=tables)
    if manifest.source is not None and isinstance(store, storage.Backend):
        _check_link(loc, manifest.source)
    elif isinstance(store, storage.Backend):
        _check_references(store, manifest)
    return manifest


def table_source(loc: storage.Location) -> TableSource:
    """Reads ranges of the piece tables at ``loc`` (format 2) for a manifest held alone.
    Local files are read in place (a store would start an IO thread per read); an object
    store's through a store of its own per read."""

    def read(name: str, start: int, length: int) -> bytes:
        if loc.is_local:
            root = os.path.abspath(loc.local_path)
            return storage.read_ranges(root, name, start, [length])[0].tobytes()
        with storage.Store(loc, threads=1) as store:
            return store.read(name, start, [length]).result()[0].tobytes()

    return TableSource(read, loc.child)


def store_tables(store: storage.ReadableStore) -> TableSource:
    """Reads ranges of the piece tables through an open store; a local one's in place, as
    :func:`table_source` does: a process of a job reads its own cells of each leaf, a small read
    per leaf, and the hop to an IO thread and back cost more than the read (300 leaves: 109 -> 79
    ms of CPU)."""
    if isinstance(store, storage.Backend) and store.location.is_local:
        return table_source(store.location)
    return TableSource(
        lambda name, start, length: store.read(name, start, [length]).result()[0].tobytes(), store.location.child
    )


def _raise_missing(loc: storage.Location, files: list[str]) -> NoReturn:
    """Why there is no manifest, told from one listing of ``loc``: nothing there, an
    interrupted save, or a directory of checkpoints (a CheckpointManager's) named instead of
    one of them, which is not an interrupted save and must not be reported as one."""
    found = listing.checkpoints(files, listing.staged_in(loc, files))
    if found:
        raise CheckpointNotFoundError(_directory_of_checkpoints(loc, found), file=loc.url)
    if not files and storage.is_empty(loc) and not storage.has_staging_leftover(loc):
        raise CheckpointNotFoundError(f"No checkpoint at {loc.url}", file=loc.url)
    if not any(map(left_by_a_save, files)) and not storage.has_staging_leftover(loc):
        shown = ", ".join(sorted(files)[:3]) + (", ..." if len(files) > 3 else "")
        raise CheckpointNotFoundError(
            f"No checkpoint at {loc.url}: it holds {len(files)} other file(s) ({shown}), none a save's", file=loc.url
        )
    raise UncommittedCheckpointError(
        f"{loc.url} holds an uncommitted checkpoint (no {MANIFEST_FILE}): its save was "
        "interrupted or failed, so it is not restorable. Restore an earlier checkpoint.",
        file=loc.url,
    )


def _directory_of_checkpoints(loc: storage.Location, found: dict[str, int | None]) -> str:
    names = list(found)
    shown = ", ".join(names if len(names) <= 6 else [*names[:3], "...", *names[-2:]])
    counted = "" if len(names) <= 6 else f" ({len(names)} checkpoints)"
    steps = {step: name for name, step in found.items() if step is not None}
    latest = steps[max(steps)] if steps else names[-1]
    manager = f' or tc.CheckpointManager("{loc.url}").restore({max(steps)})' if steps else ""
    return (
        f"{loc.url} is a directory of checkpoints, not a checkpoint: it holds {shown}{counted}. "
        f'Name one of them, e.g. tc.restore("{loc.child(latest)}"){manager}.'
    )


def _check_link(loc: storage.Location, source: dict[str, Any]) -> None:
    """A linked checkpoint is valid only while the checkpoint holding its data is unchanged."""
    src = storage.location(os.path.normpath(os.path.join(loc.local_path, source["path"])))
    with storage.Store(src, threads=1) as store:
        data = store.read_file(MANIFEST_FILE)
    if data is None:
        raise CheckpointNotFoundError(
            f"{loc.url} is a linked checkpoint whose data lives in {src.url}, which no longer exists. "
            "Export it again without --link, or restore the source checkpoint.",
            file=src.url,
        )
    if crc32c(data) != source["manifest_crc32c"]:
        raise CorruptCheckpointError(
            f"{loc.url} is a linked checkpoint, but its source {src.url} has changed since the link "
            "was made. Export it again.",
            file=src.url,
        )


def _check_references(store: storage.Backend, manifest: Manifest) -> None:
    """The data files of other steps an incremental save's manifest names (``../step_<n>/<file>``,
    FORMAT.md "References") are files of a sibling step, there with the size it recorded.
    Locally ``storage.open_confined`` refuses anything else, and one ``fstat`` each tells the
    size, now. On an object store each costs requests (one-byte reads tell a size, a listing
    tells a step), so each is checked before its first read through this store
    (``ObjectStore.check_before_reading``): a process pays for the references it reads, not
    for every one of the checkpoint, and only ``../step_<digits>/<file>`` is read at all."""
    loc = store.location
    references = {name: size for name, size in manifest.files.items() if name.startswith("../")}
    if isinstance(store, storage.ObjectStore):
        store.check_before_reading(references, _object_reference_check(store, references))
        return
    for name, size in references.items():
        where, what = _local_unlike(loc, name, size)
        if what is not None:
            raise _reference_error(loc, name, where, what)


def _reference_error(loc: storage.Location, name: str, where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{loc.url} references data file {name} of another step, which {what}: this checkpoint cannot "
        "be restored. Restore another step, or put the file back.",
        file=where,
    )


def _local_unlike(loc: storage.Location, name: str, size: int) -> tuple[str, str | None]:
    """The path of a local reference, and what is wrong with it (None: nothing)."""
    root = os.path.abspath(loc.local_path)
    path = os.path.normpath(os.path.join(root, name))
    try:
        fd = storage.open_confined(root, name)
    except FileNotFoundError:
        return path, "is missing (deleted by hand?)"
    try:
        found = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return path, None if found == size else f"holds {found} bytes, not the {size} recorded"


def _object_reference_check(store: storage.ObjectStore, references: dict[str, int]) -> Callable[[str], None]:
    """The check of one of an object store's references: a name out of the run refused
    (``sized_unlike`` refuses every name but ``../step_<digits>/<file>``), its sibling a step
    (a manifest or ``referenced.json`` there: one listing per sibling), the object there with
    the size recorded."""
    loc = store.location

    @functools.cache
    def is_step(step: str) -> bool:
        with storage.Store(loc.sibling(step), threads=1) as sibling:
            return bool(set(sibling.list()) & {MANIFEST_FILE, REFERENCED_FILE})

    def check(name: str) -> None:
        wrong = store.sized_unlike({name: references[name]})
        _, step, file = name.split("/")
        if not is_step(step):
            wrong.insert(0, (name, loc.sibling(step).child(file), "lies in no step of the run"))
        for _, where, what in wrong[:1]:
            raise _reference_error(loc, name, where, what)

    return check
