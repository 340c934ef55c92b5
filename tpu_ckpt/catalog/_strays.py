"""The objects a save leaves inside a checkpoint that another save committed (object stores).

On an object store a save writes into the final prefix, every name but the manifest and its
staging marker carrying its token (``format.token_of``, FORMAT.md "File names"), and its
manifest is created only if absent: of two saves of one checkpoint (a zombie process of an
earlier incarnation, two jobs given one run directory) one commits, and the other, once it
learns it lost, deletes exactly its own objects. One that stalled for good never does: its
objects stay in the committed prefix, named by no manifest. Those are *strays*: in a
committed checkpoint, or a retired step of an incremental run (``referenced.json``), the
objects whose name carries a token and which neither its manifest (data files, piece
tables) nor its ``referenced.json`` nor any checkpoint of the directory (``../<step>/<file>``)
names. On a local disk a save's staging directory is its own and renamed whole at commit:
nothing strays there.

Object listings carry no times, so a stray's age is read as a leftover's is: from the
staging marker. While the checkpoint holds one within its grace period (a save started on
it since it was committed, or the commit has not yet deleted it), its strays may be a save
still writing and are kept. The committing save deletes the marker it finds; a save whose
marker it deleted can never commit there (the manifest exists), so removing its objects
changes only how it fails (``storage.check_written`` reports its files missing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from tpu_ckpt import storage
from tpu_ckpt.catalog._listing import _held_until, _listed, checkpoints, staged_in
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, decode_manifest, token_of


@dataclasses.dataclass(frozen=True)
class Strays:
    """The stray objects of one checkpoint (or retired step) directly under the directory."""

    name: str  # the checkpoint's (or retired step's) name
    files: list[str]  # its stray objects, relative to it
    held_until: float | None = None  # its staging marker's grace period: they may be a save running

    @property
    def tokens(self) -> list[str]:
        """The saves that wrote them."""
        return sorted({token_of(f) or "" for f in self.files})


def strays(directory: str | os.PathLike[str]) -> list[Strays]:
    """The strays (see module docstring) of the checkpoints directly under ``directory``, by
    name: one listing of the directory, and one read of each manifest and ``referenced.json``.
    None on a local disk, nor while any manifest cannot be read (what it names is unknown)."""
    if storage.location(directory).is_local:
        return []
    loc, files = _listed(directory)
    under: dict[str, set[str]] = {}
    for top, _, rest in (path.partition("/") for path in files):
        under.setdefault(top, set()).add(rest)
    retired = [name for name, names in under.items() if REFERENCED_FILE in names and MANIFEST_FILE not in names]
    named: dict[str, set[str]] = {}
    for name in [*checkpoints(files, staged_in(loc, files)), *retired]:
        kept = _named(storage.Location(loc.child(name)), retired=name in retired)
        if kept is None:
            return []
        named.setdefault(name, set()).update(kept)
        for sibling, _, file in (f[3:].partition("/") for f in kept if f.startswith("../")):
            named.setdefault(sibling, set()).add(file)
    found = []
    for name in sorted(set(named) & set(under)):
        stray = sorted(f for f in under[name] - named[name] if "/" not in f and token_of(f) is not None)
        if stray:
            held = _held_until(loc, name) if storage.STAGING_MARKER in under[name] else None
            found.append(Strays(name, stray, held))
    return found


def _named(where: storage.Location, *, retired: bool) -> set[str] | None:
    """The files a checkpoint's manifest names (data files, ``../`` references, piece tables),
    or those a retired step's ``referenced.json`` keeps; None when it cannot be read."""
    with storage.Store(where, threads=1) as store:
        try:
            data = store.read_file(REFERENCED_FILE if retired else MANIFEST_FILE)
        except CheckpointError:
            return None
    if retired:
        try:
            return {str(f) for f in json.loads(data or b"")["files"]}
        except (ValueError, TypeError, KeyError):
            return None
    try:
        manifest = decode_manifest(data or b"", where=where.child(MANIFEST_FILE))
    except CheckpointError:
        return None
    return {*manifest.files, *manifest.tables}


def remove_strays(directory: str | os.PathLike[str], found: list[Strays]) -> list[Strays]:
    """Deletes the strays ``found`` (by :func:`strays`, and not held) that still are; returns
    those deleted."""
    loc = storage.location(directory)
    return [s for s in found if _remove(loc, s)]


def _remove(loc: storage.Location, found: Strays) -> bool:
    """Deletes one checkpoint's strays unless, since they were listed, a save marked it (one
    that may be writing), or it stopped being a checkpoint or retired step, or what it
    names came to include one of them: one listing of its prefix, and a read of each file
    that decides."""
    where = storage.Location(loc.child(found.name))
    with storage.Store(where, threads=1) as store:
        names = set(store.list())
        held = _held_until(loc, found.name) if storage.STAGING_MARKER in names else None
        if held is not None and time.time() < held:
            return False
        retired = MANIFEST_FILE not in names
        kept = _named(where, retired=retired) if not retired or REFERENCED_FILE in names else None
        if kept is None or kept & set(found.files):
            return False
        storage.remove_files(store, [f for f in found.files if f in names])
    return True
