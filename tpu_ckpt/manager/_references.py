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
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from tpu_ckpt import saving, storage
from tpu_ckpt.catalog import Listing, read_manifest, remove_step
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE

logger = logging.getLogger(__name__)


def incremental_state(incremental: bool, loc: storage.Location, local_directory: Any) -> saving.Incremental | None:
    """A manager's memory of its last save's pieces (``incremental=True``), or None."""
    if not incremental:
        return None
    if not loc.is_local or local_directory is not None:
        raise ValueError(
            "incremental=True needs a local run directory and no local_directory for now: the references "
            "between steps are read through local paths (FORMAT.md, 'References')"
        )
    return saving.Incremental()


def forget_unless(state: saving.Incremental | None, listing: Listing) -> None:
    """Forgets the last step unless it is still committed (see ``Incremental.forget_unless``)."""
    if state is not None:
        state.forget_unless(listing.committed.values())


def referenced(loc: storage.Location, kept: Iterable[str]) -> dict[str, set[str]] | None:
    """Per sibling step, its files that the manifests of the ``kept`` steps name; None if a
    kept step's manifest cannot be read (then nothing may be deleted: what it names is unknown)."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    for name in kept:
        try:
            manifest = read_manifest(storage.Location(loc.child(name)))
        except CheckpointError as error:
            logger.warning("tpu_ckpt: keeping every old step of %s: %s", loc.url, error)
            return None
        for file in manifest.files:
            if file.startswith("../"):
                _, sibling, rest = file.split("/", 2)
                found[sibling].add(rest)
    return found


def retire(loc: storage.Location, name: str, keep: set[str], why: str) -> None:
    """Makes step ``name`` a retired one keeping only the files ``keep`` (see module docstring)."""
    logger.info("tpu_ckpt: retiring %s (%s); keeping the %d data files newer steps reference", loc.child(name), why, len(keep))
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        store.write(REFERENCED_FILE, [json.dumps({"files": sorted(keep)}).encode()]).result()
        with contextlib.suppress(FileNotFoundError):
            store.delete(MANIFEST_FILE)
        for file in store.list():
            if file not in keep and file != REFERENCED_FILE:
                store.delete(file)


def sweep(loc: storage.Location, refs: dict[str, set[str]], now_retired: Iterable[str]) -> None:
    """Removes what no kept step names any more from the retired steps (all but ``now_retired``)."""
    for name in set(retired_steps(loc)) - set(now_retired):
        keep = refs.get(name, set())
        if not keep:
            remove_step(loc, name, "a retired step no kept step references any more")
            continue
        with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
            for file in store.list():
                if file not in keep and file != REFERENCED_FILE:
                    store.delete(file)


def retired_steps(loc: storage.Location) -> list[str]:
    """The retired steps of a local run directory."""
    root = loc.local_path
    with os.scandir(root) as entries:
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False) and e.name.startswith("step_")]
    return sorted(
        n for n in names
        if os.path.isfile(os.path.join(root, n, REFERENCED_FILE)) and not os.path.isfile(os.path.join(root, n, MANIFEST_FILE))
    )


def removable(loc: storage.Location, committed: dict[int, str], expired: list[int], why: str) -> list[int]:
    """Retires the ``expired`` steps whose files a kept step names, sweeps the retired
    steps, and returns the expired steps to remove whole (none while a kept manifest is
    unreadable: what it names is unknown)."""
    refs = referenced(loc, [name for step, name in committed.items() if step not in expired])
    if refs is None:
        return []
    retiring = [committed[step] for step in expired if refs.get(committed[step])]
    for name in retiring:
        retire(loc, name, refs[name], why)
    sweep(loc, refs, retiring)
    return [step for step in expired if committed[step] not in retiring]
