"""Retention of an incremental run: a step's data files go only once no kept step names them.

An incremental save's manifest names data files of earlier steps (``../step_<n>/<file>``,
FORMAT.md "References"). When retention lets go of a step whose files a kept step still
names, the step is *retired*: ``referenced.json`` is written into it first (so no cleanup
ever takes it for a leftover, and readers still accept the references), then its manifest
is deleted (it is no longer a step: not listed, not restorable), then every file no kept
step names. A retired step whose files no kept step names any more is removed whole.

Each of those is safe to interrupt: a step holding both its manifest and ``referenced.json``
is still committed and whole; one holding ``referenced.json`` and no manifest is retired,
and the next retention finishes the job.

Which steps are retired comes from the run's listing (``Listing.retired``): on a local disk
a fresh one, on an object store the one the manager keeps (manager/_run_directory.py), which
saw them when it listed the run and is told of every retirement and removal since; nothing
lists a whole object-store run per save. Retention decides after a commit (reading the kept
steps' manifests), and its writes and deletes run on the run directory's removal thread.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from typing import TYPE_CHECKING, Any

from tpu_ckpt import saving, storage
from tpu_ckpt.catalog import Listing, remove_step
from tpu_ckpt.errors import CheckpointError, CheckpointExistsError
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, decode_manifest

if TYPE_CHECKING:  # the manager hands its run directory in
    from tpu_ckpt.manager._run_directory import RunDirectory

logger = logging.getLogger(__name__)


def incremental_state(incremental: bool, local_directory: Any) -> saving.Incremental | None:
    """A manager's memory of its last save's pieces (``incremental=True``), or None."""
    if not incremental:
        return None
    if local_directory is not None:
        raise ValueError(
            "incremental=True is not combined with local_directory yet: the local tier's saves and their "
            "uploads write every piece, with no references (FORMAT.md, 'References'). Use one or the other."
        )
    return saving.Incremental()


def before_save(state: saving.Incremental | None, listing: Listing, where: str) -> None:
    """Refuses a save into a retired step (its data files are kept steps' data), and forgets
    the last step unless it is still committed (see ``Incremental.forget_unless``)."""
    name = storage.Location(where).name
    if name in listing.retired:
        raise CheckpointExistsError(
            f"{where} is a retired step: newer kept steps still read its data files (FORMAT.md, "
            "'References'), so it cannot be saved again. Save a different step.",
            file=where,
        )
    if state is not None:
        state.forget_unless(listing.committed.values())


def retain(run: RunDirectory, before: Listing, committed: dict[int, str], expired: list[int], why: str) -> list[int]:
    """Lets the ``expired`` steps go in an incremental run: those whose files a kept step
    names are retired, the retired steps ``before`` lists are trimmed to the files kept steps
    name (removed whole when none), on the run's removal thread. Returns the expired steps
    to remove whole (none while a kept manifest is unreadable: what it names is unknown).

    On an object store what it read and did is remembered until ``reload()``: each kept
    step's references (a manifest is never changed), and what each retired step was trimmed
    to (unchanged, it is not listed again)."""
    remembers = not run.loc.is_local
    refs = referenced(run.loc, [name for step, name in committed.items() if step not in expired], run.named if remembers else {})
    if refs is None:
        return []
    retiring = {committed[step]: refs[committed[step]] for step in expired if refs.get(committed[step])}
    left = {name: refs.get(name, set()) for name in before.retired if name not in retiring}
    trimmed = run.trimmed if remembers else {}
    changed = {name: keep for name, keep in left.items() if trimmed.get(name) != keep}
    gone = [name for name, keep in left.items() if not keep]
    run.retire(retiring, gone, functools.partial(_let_go, run.loc, {**changed, **retiring}, trimmed, why))
    return [step for step in expired if committed[step] not in retiring]


def referenced(loc: storage.Location, kept: list[str], named: dict[str, dict[str, set[str]]]) -> dict[str, set[str]] | None:
    """Per sibling step, its files that the manifests of the ``kept`` steps name; None if a
    kept step's manifest cannot be read (then nothing may be deleted: what it names is unknown).
    ``named``: what earlier calls read of each step (kept up to date here). Only the
    manifests' ``files`` are read: no piece table, no check of the references."""
    for name in set(named) - set(kept):
        del named[name]
    found: dict[str, set[str]] = {}
    for name in kept:
        if name not in named:
            where = storage.Location(loc.child(name))
            try:
                with storage.Store(where, threads=1) as store:
                    manifest = decode_manifest(store.read_file(MANIFEST_FILE) or b"", where=where.child(MANIFEST_FILE))
            except CheckpointError as error:
                logger.warning("tpu_ckpt: keeping every old step of %s: %s", loc.url, error)
                return None
            named[name] = {}
            for file in manifest.files:
                if file.startswith("../"):
                    _, sibling, rest = file.split("/", 2)
                    named[name].setdefault(sibling, set()).add(rest)
        for sibling, files in named[name].items():
            found.setdefault(sibling, set()).update(files)
    return found


def _let_go(loc: storage.Location, keep: dict[str, set[str]], trimmed: dict[str, set[str]], why: str) -> None:
    """Makes each step of ``keep`` a retired one holding only those files, or removes it
    whole when it keeps none (on the removal thread); ``trimmed`` records what was done."""
    for name, files in keep.items():
        trimmed.pop(name, None)
        if files:
            retire(loc, name, files, why)
            trimmed[name] = files
        else:
            remove_step(loc, name, "a retired step no kept step references any more")


def retire(loc: storage.Location, name: str, keep: set[str], why: str) -> None:
    """Makes step ``name`` a retired one keeping only the files ``keep`` (see module
    docstring): one listing of the step; a step already retired is only trimmed."""
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        files = store.list()
        if MANIFEST_FILE in files or REFERENCED_FILE not in files:
            logger.info("tpu_ckpt: retiring %s (%s); keeping the %d data files newer steps reference",
                        loc.child(name), why, len(keep))
            store.write(REFERENCED_FILE, [json.dumps({"files": sorted(keep)}).encode()]).result()
            with contextlib.suppress(FileNotFoundError):
                store.delete(MANIFEST_FILE)
        for file in files:
            if file not in keep and file not in (REFERENCED_FILE, MANIFEST_FILE):
                store.delete(file)
