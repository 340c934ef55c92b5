"""Retention by references: a step's data files go only once no committed step names them.

An incremental save's manifest names data files of earlier steps (``../step_<n>/<file>``,
FORMAT.md "References"). Every manager's retention honours them, whatever its own
``incremental`` (a run may have been saved incrementally before a restart without it, or by
another manager sharing the run). When retention lets go of a step whose files a kept step
still names, the step is *retired*: ``referenced.json`` is written into it first (so no
cleanup ever takes it for a leftover, and readers still accept the references), then its
manifest is deleted (it is no longer a step: not listed, not restorable); its other files go
later. A retired step whose files no kept step names any more is removed whole.

Retention decides from what is committed when it runs, not when its save started: it lists
the run (locally one ``scandir``; on an object store the keys outside the steps it knows,
``RunDirectory.current``), reads the manifests it has not read, and deletes in two rounds:
first the manifests of the leaving steps, newest first; then, the run listed again (what
another manager committed meanwhile counts too), the files no kept step names. A SIGKILL at
any deletion leaves every listed step whole: a step holding its manifest has lost no file
it names; one holding ``referenced.json`` and no manifest is retired, and one holding
neither is a leftover; the next retention, or ``tpu-ckpt gc``, finishes the job. All of it
runs on the run directory's removal thread, on the leader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tpu_ckpt import saving, storage
from tpu_ckpt.catalog import Listing, remove_step, retire_step, trim_step
from tpu_ckpt.errors import CheckpointError, CheckpointExistsError
from tpu_ckpt.format import MANIFEST_FILE, decode_manifest

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
    the pieces whose step is neither committed nor retired (``Incremental.forget_unless``)."""
    name = storage.Location(where).name
    if name in listing.retired:
        raise CheckpointExistsError(
            f"{where} is a retired step: newer kept steps still read its data files (FORMAT.md, "
            "'References'), so it cannot be saved again. Save a different step.",
            file=where,
        )
    if state is not None:
        state.forget_unless([*listing.committed.values(), *listing.retired])


def retain(run: RunDirectory, expire: Callable[[dict[int, str]], list[int]], why: str) -> None:
    """Lets go of the steps ``expire`` picks from the steps committed now (on the removal
    thread), never of a file a committed manifest names: first the manifests of the steps
    leaving, newest first (those whose files a kept step names retired), then, the run listed
    again (a step another manager committed meanwhile keeps what it names too), the files of
    the leaving and retired steps that no kept step names. A SIGKILL at any deletion leaves
    every listed step whole. Nothing goes while a kept manifest is unreadable."""
    listing = run.current()
    leaving = [listing.committed[step] for step in sorted(expire(listing.committed), reverse=True)]
    if not leaving:
        return
    named = run.named if not run.loc.is_local else {}
    refs = referenced(run, [name for name in listing.committed.values() if name not in leaving], named)
    if refs is None:
        return
    for name in leaving:
        _retire(run, name, refs.get(name, set()), why)
    listing = run.current()
    refs = referenced(run, [name for name in listing.committed.values() if name not in leaving], named)
    if refs is None:
        return
    for name in dict.fromkeys([*leaving, *listing.retired]):
        _trim(run, name, refs.get(name, set()), why)


def referenced(run: RunDirectory, kept: list[str], named: dict[str, dict[str, set[str]]]) -> dict[str, set[str]] | None:
    """Per sibling step, its files that the manifests of the ``kept`` steps name; None if a
    kept step's manifest cannot be read (then nothing may be deleted: what it names is unknown).
    A kept step whose manifest is gone (removed since it was listed) names nothing. ``named``:
    what earlier calls read of each step (kept up to date here). Only the manifests' ``files``
    are read: no piece table, no check of the references."""
    for name in set(named) - set(kept):
        del named[name]
    found: dict[str, set[str]] = {}
    for name in kept:
        if name not in named:
            where = storage.Location(run.loc.child(name))
            try:
                with storage.Store(where, threads=1) as store:
                    data = store.read_file(MANIFEST_FILE)
                if data is None:
                    run.left(name, retired=False)
                    continue
                manifest = decode_manifest(data, where=where.child(MANIFEST_FILE))
            except CheckpointError as error:
                logger.warning("tpu_ckpt: keeping every old step of %s: %s", run.loc.url, error)
                return None
            named[name] = {}
            for file in manifest.files:
                if file.startswith("../"):
                    _, sibling, rest = file.split("/", 2)
                    named[name].setdefault(sibling, set()).add(rest)
        for sibling, files in named[name].items():
            found.setdefault(sibling, set()).update(files)
    return found


def _retire(run: RunDirectory, name: str, keep: set[str], why: str) -> None:
    """Takes step ``name`` out of the committed steps: ``referenced.json`` first when kept steps
    name files of it (it becomes a retired step), then its manifest (``catalog.retire_step``)."""
    retire_step(run.loc, name, keep, why)
    run.left(name, retired=bool(keep))


def _trim(run: RunDirectory, name: str, keep: set[str], why: str) -> None:
    """Leaves in a step that is no longer committed only the files ``keep`` (what kept steps
    name), ``referenced.json`` rewritten first; removes it whole when it keeps none. An
    object store's retired step already trimmed to ``keep`` is not listed again."""
    if not keep:
        remove_step(run.loc, name, f"{why}; no kept step references its files")
        run.left(name, retired=False)
        return
    if not run.loc.is_local and run.trimmed.get(name) == keep:
        return
    trim_step(run.loc, name, keep)
    run.trimmed[name] = keep
