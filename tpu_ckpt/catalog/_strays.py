"""The objects a save leaves inside a checkpoint that another save committed (object stores).

On an object store a save writes into the final prefix, every name but the manifest carrying
its token (``format.token_of``, FORMAT.md "File names"), its staging marker's too, and its
manifest is created only if absent: of two saves of one checkpoint (a zombie process of an
earlier incarnation, two jobs given one run directory) one commits, and the other, once it
learns it lost, deletes exactly its own objects. One that stalled for good never does: its
objects stay in the committed prefix, named by no manifest. Those are *strays*: in a
committed checkpoint, or a retired step of an incremental run (``referenced.json``), the
objects whose name carries a token and which neither its manifest (data files, piece
tables) nor its ``referenced.json`` nor any checkpoint of the directory (``../<step>/<file>``)
names. On a local disk a save's staging directory is its own and renamed whole at commit:
nothing strays there.

Object listings carry no times, so a stray's age is read as a leftover's is: from a staging
marker, that of the save which wrote it (``format.marker_name``: its name carries the
save's token; a plain ``staging.json``, which saves before markers were per save wrote,
holds the objects of the token it names). While that marker is within its grace period, the
save's strays may be a save still writing (one that started before the commit and has not
yet learnt it lost) and are kept; another save's marker holds nothing but that save's. Once
it is over, the marker is itself a stray of its save, removed with its objects (last, so an
interrupted removal leaves them marked). The committing save deletes its own marker, so
beside a committed manifest a save's marker is another save's, or the commit's own when its
deletion failed: a stray of the commit, then, kept for its grace period. A save whose
objects are removed can never commit there (the manifest exists), so removing them changes
only how it fails (``storage.check_written`` reports its files missing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from tpu_ckpt import storage
from tpu_ckpt.catalog._listing import _listed, checkpoints, staged_in
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    REFERENCED_FILE,
    STAGING_MARKER,
    decode_manifest,
    marker_name,
    token_of,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Strays:
    """The stray objects of one save (one token) in one checkpoint (or retired step) directly
    under the directory."""

    name: str  # the checkpoint's (or retired step's) name
    files: list[str]  # its stray objects, relative to it
    held_until: float | None = None  # the save's staging marker's grace period: it may be running

    @property
    def tokens(self) -> list[str]:
        """The saves that wrote them."""
        return sorted({token_of(f) or "" for f in self.files})


def strays(directory: str | os.PathLike[str]) -> list[Strays]:
    """The strays (see module docstring) of the checkpoints directly under ``directory``, by
    name then token: one listing of the directory, one read of each manifest and
    ``referenced.json``, and of each staging marker of a save that left strays. None on a
    local disk, nor in a checkpoint whose manifest (or retired step whose ``referenced.json``)
    cannot be read: what it names is unknown, so all its objects are kept (and a warning
    says so). The others' are found as usual: a file one of them references in a sibling is
    named by that sibling's manifest or ``referenced.json`` too."""
    if storage.location(directory).is_local:
        return []
    loc, files = _listed(directory)
    under: dict[str, set[str]] = {}
    for top, _, rest in (path.partition("/") for path in files):
        under.setdefault(top, set()).add(rest)
    retired = [name for name, names in under.items() if REFERENCED_FILE in names and MANIFEST_FILE not in names]
    named: dict[str, set[str]] = {}
    unreadable: set[str] = set()
    for name in [*checkpoints(files, staged_in(loc, files)), *retired]:
        kept = _named(storage.Location(loc.child(name)), retired=name in retired)
        if kept is None:
            logger.warning("tpu_ckpt: %s cannot be read: keeping every object in it", loc.child(name))
            unreadable.add(name)
            continue
        named.setdefault(name, set()).update(kept)
        for sibling, _, file in (f[3:].partition("/") for f in kept if f.startswith("../")):
            named.setdefault(sibling, set()).add(file)
    found = []
    for name in sorted(set(named) & set(under) - unreadable):
        where = storage.Location(loc.child(name))
        by_token: dict[str, list[str]] = {}
        for file in sorted(under[name] - named[name]):
            token = token_of(file) if "/" not in file else None
            if token is not None:
                by_token.setdefault(token, []).append(file)
        found += [Strays(name, group, _held_until(where, under[name], t)) for t, group in sorted(by_token.items())]
    return found


def _held_until(where: storage.Location, names: set[str], token: str) -> float | None:
    """Until when the objects of the save with ``token`` in ``where`` (listed as ``names``) may
    be that save still writing: the grace period of its own staging marker, or of a plain
    one naming its token; None when neither is there."""
    own = marker_name(token, local=where.is_local)
    held = []
    for name in sorted(names & {own, STAGING_MARKER}):
        marker = storage.read_marker(where, name)
        if marker is not None and (name == own or marker.token == token):
            held.append(marker.held_until)
    return max(held, default=None)


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
        except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: nesting too deep to be ours
            return None
    try:
        manifest = decode_manifest(data or b"", where=where.child(MANIFEST_FILE))
    except CheckpointError:
        return None
    return {*manifest.files, *manifest.tables}
