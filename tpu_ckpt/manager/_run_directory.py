"""A CheckpointManager's run directory: its listing, kept in O(steps), and its removals, run
off the caller's thread.

Object stores list every key under a prefix (tensorstore has no delimiter), so listing a
run of ten steps at 1,536 hosts reads ~500 k keys, once per save and per restore. There the
leader keeps, beside the steps, one empty object per step under ``INDEX_PREFIX``, its state
in its name: ``step_7.started`` before a save of ``step_7`` writes, ``step_7.committed``
once it has committed. A listing lists those (O(steps) keys), and checks the manifest of a
save started and not recorded as committed (a crash between the commit and the record),
then records it. Per-step objects, not one index document: two managers on one run never
overwrite each other's records. The first listing of a run without ``INDEXED`` lists
every key once and records what it finds; :meth:`RunDirectory.reload` does that on request
(after steps were deleted by hand). Local directories are listed as before: one
``scandir`` and a stat per step.

Removals (retention, leftovers) leave the records at once and their files on a thread of
their own: the manifest first, so a crash midway leaves an uncommitted leftover that
``tpu-ckpt gc`` removes. The next listing waits for them, so no listing sees a half-removed
step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable

from tpu_ckpt import storage
from tpu_ckpt.catalog import Listing, list_run, remove_leftover, remove_step
from tpu_ckpt.format import MANIFEST_FILE
from tpu_ckpt.manager._collective_listing import list_on_leader

logger = logging.getLogger(__name__)

INDEX_PREFIX = "tpu_ckpt_steps"
INDEXED = "INDEXED"  # present once every step of the run is recorded
_STARTED, _COMMITTED = ".started", ".committed"


class RunDirectory:
    """The run directory as one manager sees it; only its leader records or removes."""

    def __init__(self, loc: storage.Location, leader: int):
        self.loc, self.leader = loc, leader
        self._records = storage.Location(loc.child(INDEX_PREFIX))
        self._removals = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpu_ckpt-removals")
        self._removing: list[concurrent.futures.Future] = []

    def listing(self, timeout: float) -> Listing:
        """What the run holds, as the leader sees it (collective), after pending removals."""
        self.settle()
        return list_on_leader(self.loc, self.leader, timeout, self._list)

    def reload(self, timeout: float) -> Listing:
        """Lists every key of the run again and records what it holds (collective)."""
        self.settle()
        return list_on_leader(self.loc, self.leader, timeout, self._rebuild)

    def started(self, name: str) -> None:
        """Records, before it writes, a save of ``name`` (leader only)."""
        self._put(name + _STARTED)

    def committed(self, name: str) -> None:
        """Records ``name`` as committed (leader only)."""
        self._put(name + _COMMITTED)
        self._delete(name + _STARTED)

    def remove(self, removals: Iterable[tuple[str, str, bool]]) -> None:
        """Removes steps (``(name, why, committed)``) on the removal thread (leader only).

        A committed step leaves the records at once. A leftover's record goes only once the
        leftover is gone: one that committed since it was listed (another manager's save)
        stays, with its records."""
        for name, why, committed in removals:
            if committed:
                self._delete(name + _COMMITTED)
                self._delete(name + _STARTED)
            self._removing.append(self._removals.submit(self._remove, name, why, committed))

    def _remove(self, name: str, why: str, committed: bool) -> None:
        if committed:
            remove_step(self.loc, name, why)
        elif remove_leftover(self.loc, name, why):
            self._delete(name + _STARTED)

    def settle(self) -> None:
        """Waits for the removals started; one that failed is logged (the step stays, as a
        leftover or still committed, for the next retention or ``tpu-ckpt gc``)."""
        removing, self._removing = self._removing, []
        for done in removing:
            try:
                done.result()
            except Exception as error:  # noqa: BLE001 - a removal's failure must not fail the training step
                logger.warning("tpu_ckpt: could not remove a step of %s: %s", self.loc.url, error)

    def close(self) -> None:
        self.settle()
        self._removals.shutdown()

    def _list(self, loc: storage.Location) -> Listing:
        if loc.is_local:
            return list_run(loc)
        with storage.Store(self._records, threads=1) as store:
            records = set(store.list())
        if INDEXED not in records:
            return self._rebuild(loc)
        committed = {n.removesuffix(_COMMITTED) for n in records if n.endswith(_COMMITTED)}
        started = {n.removesuffix(_STARTED) for n in records if n.endswith(_STARTED)} - committed
        for name in sorted(started):
            if _holds_manifest(loc, name):
                self.committed(name)
                committed.add(name)
        steps = {_step(name): name for name in committed if _step(name) is not None}
        return _with_busy(loc, Listing(steps, sorted(started - committed)))  # type: ignore[arg-type]

    def _rebuild(self, loc: storage.Location) -> Listing:
        listing = list_run(loc)
        if not loc.is_local:
            for name in listing.committed.values():
                self.committed(name)
            for name in listing.leftovers:
                self.started(name)
            self._put(INDEXED)
        return listing

    def _put(self, record: str) -> None:
        if not self.loc.is_local:
            with storage.Store(self._records, threads=1) as store:
                store.write(record, [record.encode()]).result()  # not empty: an emulator refuses empty uploads

    def _delete(self, record: str) -> None:
        if not self.loc.is_local:
            with storage.Store(self._records, threads=1) as store, contextlib.suppress(FileNotFoundError):
                store.delete(record)


def _step(name: str) -> int | None:
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _holds_manifest(loc: storage.Location, name: str) -> bool:
    """Whether the step directory ``name`` holds a manifest now (one read)."""
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        return store.read_file(MANIFEST_FILE) is not None


def _with_busy(loc: storage.Location, listing: Listing) -> Listing:
    """``listing`` with its busy leftovers: one marker read per leftover (there are few)."""
    now = time.time()
    markers = {name: storage.read_marker(storage.Location(loc.child(name))) for name in listing.leftovers}
    busy = [name for name, marker in markers.items() if marker is not None and now < marker.held_until]
    return dataclasses.replace(listing, busy=busy)
