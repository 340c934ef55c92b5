"""A CheckpointManager's run directory: its listing, kept in O(steps), and its removals, run
off the caller's thread.

Object stores list every key under a prefix (tensorstore has no delimiter), so listing a
run of ten steps at 1,536 hosts reads ~500 k keys, and the manager lists for each save and
each restore. There the leader lists the run once, then keeps the listing: the saves it
starts, the steps it commits and the steps it removes update it, and it checks only the
manifest of a save started and not seen to commit (one read each; there are few). Nothing
is written into the run for it. What others change (``tpu-ckpt gc``, a step deleted by
hand, another job) is seen after :meth:`RunDirectory.reload`, as Orbax's ``reload()``, but
for retention, which before it deletes lists the keys outside the steps it knows
(:meth:`RunDirectory.current`: a step another manager committed since is seen there).
Local directories are listed anew each time: one ``scandir`` and a stat per step.

Removals (retention, leftovers) run on a thread of their own: the manifest first, so a
crash midway leaves an uncommitted leftover that ``tpu-ckpt gc`` removes (retention's order:
manager/_references.py). The next listing waits for them, so no listing sees a half-removed
step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import typing
from collections.abc import Callable, Iterable

from tpu_ckpt import storage
from tpu_ckpt.catalog import Listing, list_run, parse_listing, remove_leftover, remove_step
from tpu_ckpt.format import MANIFEST_FILE
from tpu_ckpt.manager._collective_listing import list_on_leader

logger = logging.getLogger(__name__)

class RunDirectory:
    """The run directory as one manager sees it; only its leader records or removes."""

    def __init__(self, loc: storage.Location, leader: int):
        self.loc, self.leader = loc, leader
        self._committed: dict[str, int] | None = None  # an object store's steps, once listed (leader)
        self._started: set[str] = set()  # saves started and not seen to commit
        self._retired: set[str] = set()  # an object store's retired steps (manager/_references.py)
        self.named: dict[str, dict[str, set[str]]] = {}  # per step, its references, as retention read them
        self.trimmed: dict[str, set[str]] = {}  # per retired step, the files retention left in it
        self._lock = threading.Lock()  # the writer thread records commits while the caller lists
        self._removals = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpu_ckpt-removals")
        self._removing: list[concurrent.futures.Future] = []

    def listing(self, timeout: float) -> Listing:
        """What the run holds, as the leader sees it (collective), after pending removals."""
        self.settle()
        return list_on_leader(self.loc, self.leader, timeout, self._list)

    def reload(self, timeout: float) -> Listing:
        """Lists every key of the run again (collective)."""
        self.settle()
        with self._lock:
            self._committed = None
            self.named, self.trimmed = {}, {}
        return list_on_leader(self.loc, self.leader, timeout, self._list)

    def started(self, name: str) -> None:
        """Notes, before it writes, a save of ``name`` (leader only)."""
        with self._lock:
            self._started.add(name)

    def committed(self, name: str) -> None:
        """Notes ``name`` as committed (leader only)."""
        with self._lock:
            self._started.discard(name)
            step = _step(name)
            if self._committed is not None and step is not None:
                self._committed[name] = step

    def remove(self, removals: Iterable[tuple[str, str, bool]]) -> None:
        """Removes steps (``(name, why, committed)``) on the removal thread (leader only),
        taking them out of the listing at once. A leftover that committed since it was
        listed (another manager's save) stays."""
        for name, why, committed in removals:
            with self._lock:
                if self._committed is not None and committed:
                    self._committed.pop(name, None)
                self._started.discard(name)
            self._removing.append(self._removals.submit(self._remove, name, why, committed))

    def submit(self, work: Callable[[], None]) -> None:
        """Runs ``work`` (retention, manager/_references.py) on the removal thread (leader only)."""
        self._removing.append(self._removals.submit(work))

    def current(self) -> Listing:
        """What the run holds now (on the removal thread, leader only): a local directory listed
        again; on an object store the steps known, the saves started that committed since (a
        read of each manifest), and what a listing of the keys outside all those finds (a step
        another manager committed, a save it started), which it then knows. A save in flight
        is never listed key by key."""
        if self.loc.is_local:
            return list_run(self.loc)
        with self._lock:
            known = None if self._committed is None else [*self._committed, *self._retired, *self._started]
        if known is None:
            return self._list(self.loc)
        with storage.Store(self.loc, threads=1) as store:
            found = parse_listing(typing.cast(storage.ObjectStore, store).list(outside=known))
        for name in [name for name in known if name in self._started and _holds_manifest(self.loc, name)]:
            self.committed(name)
        with self._lock:
            committed = self._committed if self._committed is not None else {}
            committed.update({name: step for step, name in found.committed.items()})
            self._started = (self._started | set(found.leftovers)) - set(found.committed.values())
            self._retired |= set(found.retired)
            leftovers = sorted(self._started)
            return Listing({step: name for name, step in committed.items()}, leftovers, retired=sorted(self._retired))

    def left(self, name: str, *, retired: bool) -> None:
        """Notes that step ``name`` is no longer committed: retired, or gone (removal thread)."""
        with self._lock:
            if self._committed is not None:
                self._committed.pop(name, None)
            self._retired.discard(name)
            if retired:
                self._retired.add(name)
            else:
                self.trimmed.pop(name, None)

    def _remove(self, name: str, why: str, committed: bool) -> None:
        if committed:
            remove_step(self.loc, name, why)
        elif not remove_leftover(self.loc, name, why):
            self.committed(name)  # committed since it was listed

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
        with self._lock:
            known = self._committed
        if known is None:
            listing = list_run(loc)
            with self._lock:
                self._committed = {name: step for step, name in listing.committed.items()}
                self._started |= set(listing.leftovers)
                self._retired = set(listing.retired)
            return listing
        for name in sorted(self._started):
            if _holds_manifest(loc, name):
                self.committed(name)
        with self._lock:
            steps = {step: name for name, step in (self._committed or {}).items()}
            leftovers, retired = sorted(self._started), sorted(self._retired)
        return _with_busy(loc, Listing(steps, leftovers, retired=retired))


def _step(name: str) -> int | None:
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _holds_manifest(loc: storage.Location, name: str) -> bool:
    """Whether the step directory ``name`` holds a manifest now (one read)."""
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        return store.read_file(MANIFEST_FILE) is not None


def _with_busy(loc: storage.Location, listing: Listing) -> Listing:
    """``listing`` with its busy leftovers: a read of each marker of each leftover (there are
    few; on an object store, one per save, found by a listing of its prefix)."""
    now = time.time()
    markers = {name: storage.latest_marker(storage.Location(loc.child(name))) for name in listing.leftovers}
    busy = [name for name, marker in markers.items() if marker is not None and now < marker.held_until]
    return dataclasses.replace(listing, busy=busy)
