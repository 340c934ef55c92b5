"""Reading a checkpoint's committed manifest, with the errors a user can act on.

Through an open store (``open_checkpoint``: restore, export and the command line), or alone
(``read_manifest``: for callers that keep only the manifest).
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

from tpu_ckpt import storage
from tpu_ckpt.catalog import _listing as listing
from tpu_ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UncommittedCheckpointError
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, Manifest, TableSource, crc32c, decode_manifest


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
    """Reads ranges of the piece tables through an open store."""
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
    size; on an object store only ``../step_<digits>/<file>`` is read at all, each sibling is
    listed once, and one-byte reads tell a file's size (``ObjectStore.sized_unlike``)."""
    loc = store.location
    references = {name: size for name, size in manifest.files.items() if name.startswith("../")}
    if not references:
        return
    wrong: list[tuple[str, str, str | None]] = []
    if isinstance(store, storage.ObjectStore):
        wrong += _objects_unlike(store, references)
    else:
        wrong += [(name, *_local_unlike(loc, name, size)) for name, size in references.items()]
    for name, where, what in wrong:
        if what is not None:
            raise CorruptCheckpointError(
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


def _objects_unlike(store: storage.ObjectStore, references: dict[str, int]) -> list[tuple[str, str, str]]:
    """What is wrong with an object store's references: a sibling that is no step (neither a
    manifest nor ``referenced.json``, FORMAT.md "References": one listing of each), a file
    missing there or of another size (``sized_unlike``, which refuses every other name)."""
    loc, wrong = store.location, store.sized_unlike(references)
    for step in sorted({name.split("/")[1] for name in references}):
        with storage.Store(loc.sibling(step), threads=1) as sibling:
            if set(sibling.list()) & {MANIFEST_FILE, REFERENCED_FILE}:
                continue
        name = min(n for n in references if n.split("/")[1] == step)
        wrong.insert(0, (name, loc.sibling(step).child(name.split("/")[2]), "lies in no step of the run"))
    return wrong
