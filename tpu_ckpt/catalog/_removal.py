"""Removing what a run directory holds: the one module of the library that deletes checkpoints' files.

What may go is decided elsewhere: by the listing's rules (``_listing``: a leftover, busy or
not), by the strays' (``_strays``), and, for a manager, by its retention (``manager``). Each
removal here re-checks, just before it deletes, what could have changed since that decision
(a leftover committed or marked busy meanwhile, a stray now named), and deletes in the order
that leaves every step whole or an uncommitted leftover if it is interrupted: a step's
manifest first (``remove_step``), ``referenced.json`` before the manifest of a step retired
(``retire_step``), a save's staging marker after its strays (``remove_strays``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from tpu_ckpt import storage
from tpu_ckpt.catalog._strays import Strays, _held_until, _named
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, is_marker

logger = logging.getLogger(__name__)


def remove_leftovers(directory: str | os.PathLike[str], names: list[str]) -> list[str]:
    """Deletes the given leftovers of ``directory`` (as found by ``_listing.scan``, and not busy)
    that still are (:func:`remove_leftover`); returns those deleted."""
    loc = storage.location(directory)
    return [name for name in names if remove_leftover(loc, name, "an uncommitted leftover")]


def remove_leftover(loc: storage.Location, name: str, why: str, *, even_busy: bool = False) -> bool:
    """Deletes the leftover ``name`` of ``loc`` unless, since it was listed, it became a save
    in progress (unless ``even_busy``) or was committed; returns whether it did.

    The marker is read before the manifest is looked for, the reverse of the order in which
    a commit writes the manifest and then deletes the marker: a save committing meanwhile is
    seen by one or the other (a listing, however recent, may predate the commit). On an
    object store a manifest is the commit whatever its marker names (``staged_in``)."""
    where = storage.Location(loc.child(name))
    marker = storage.latest_marker(where)
    if marker is not None and not even_busy and time.time() < marker.held_until:
        logger.info("tpu_ckpt: keeping %s: a save that may still be running", where.url)
        return False
    if _has_manifest(where) and (marker is None or marker.final in (None, name) or not loc.is_local):
        logger.info("tpu_ckpt: keeping %s: committed since it was listed", where.url)
        return False
    remove_step(loc, name, why)
    return True


def _has_manifest(where: storage.Location) -> bool:
    """Whether ``where`` holds a manifest now: a stat, or a listing of its prefix (an object
    store's read would fetch the whole manifest)."""
    if where.is_local:
        return os.path.isfile(os.path.join(where.local_path, MANIFEST_FILE))
    with storage.Store(where, threads=1) as store:
        return MANIFEST_FILE in store.list()


def remove_step(loc: storage.Location, name: str, why: str) -> None:
    """Deletes one step directory under ``loc``. The manifest goes first, so an interrupted
    delete leaves an uncommitted leftover and never a committed checkpoint with files missing."""
    logger.info("tpu_ckpt: removing %s: %s", loc.child(name), why)
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        with contextlib.suppress(FileNotFoundError):
            store.delete(MANIFEST_FILE)
        store.delete_all()


def remove_strays(directory: str | os.PathLike[str], found: list[Strays]) -> list[Strays]:
    """Deletes the strays ``found`` (by ``_strays.strays``, and not held) that still are; returns
    those deleted."""
    loc = storage.location(directory)
    return [s for s in found if _remove(loc, s)]


def _remove(loc: storage.Location, found: Strays) -> bool:
    """Deletes one save's strays in one checkpoint unless, since they were listed, that save
    marked it (it may be writing: a marker found now, or renewed), or it stopped being a
    checkpoint or retired step, or what it names came to include one of them: one listing
    of its prefix, and a read of each file that decides. Its staging marker goes last."""
    where = storage.Location(loc.child(found.name))
    with storage.Store(where, threads=1) as store:
        names = set(store.list())
        held = [_held_until(where, names, token) for token in found.tokens]
        if any(until is not None and time.time() < until for until in held):
            return False
        retired = MANIFEST_FILE not in names
        kept = _named(where, retired=retired) if not retired or REFERENCED_FILE in names else None
        if kept is None or kept & set(found.files):
            return False
        storage.remove_files(store, sorted((f for f in found.files if f in names), key=is_marker))
    return True


def retire_step(loc: storage.Location, name: str, keep: set[str], why: str) -> None:
    """Takes step ``name`` under ``loc`` out of the committed steps: ``referenced.json`` first
    when kept steps name files ``keep`` of it (it becomes a retired step), then its manifest."""
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        if keep:
            logger.info("tpu_ckpt: retiring %s (%s); keeping the %d data files newer steps reference",
                        loc.child(name), why, len(keep))
            store.write(REFERENCED_FILE, [json.dumps({"files": sorted(keep)}).encode()]).result()
        else:
            logger.info("tpu_ckpt: removing %s: %s", loc.child(name), why)
        with contextlib.suppress(FileNotFoundError):
            store.delete(MANIFEST_FILE)


def trim_step(loc: storage.Location, name: str, keep: set[str]) -> None:
    """Leaves in the step ``name`` under ``loc``, no longer committed, only the files ``keep``
    (and ``referenced.json``, rewritten first, naming them)."""
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        files = store.list()
        extra = [file for file in files if file not in keep and file not in (REFERENCED_FILE, MANIFEST_FILE)]
        if extra or REFERENCED_FILE not in files:
            store.write(REFERENCED_FILE, [json.dumps({"files": sorted(keep)}).encode()]).result()
        storage.remove_files(store, extra)
