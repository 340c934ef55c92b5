"""What a directory of checkpoints holds: its checkpoints, and the leftovers of interrupted saves.

The rules are CheckpointManager's (manager/_manager.py), so ``tpu-ckpt ls``/``gc`` and a manager
agree on what is committed and what may be deleted. What a directory holds decides, not its
name: a checkpoint is a subdirectory with a manifest (a user's ``model.tmp-1`` too), unless
its staging marker (``storage.mark_staging``) says it is the staging area of another name,
a local save that died before its rename. A leftover is a subdirectory without such a
manifest that is ours: it holds a staging marker (plain, or on an object store one per save,
``format.marker_name``), or it bears a name the library writes (``step_<n>``,
CheckpointManager's rule, or ``<name>.tmp-<hex>``, which older saves left unmarked). A
leftover whose marker is younger than its grace period (of several, the one that ends last)
may be a save still running: it is "busy", and neither ``gc`` nor a manager's cleanup
removes it (``_removal``). Anything else (a user's own files and directories) is neither listed nor removed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import time
from collections.abc import Collection, Iterable

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, STAGING_DIRECTORY, STAGING_MARKER, decode_manifest

INTEGER = re.compile(r"\d+")
# Only what a CheckpointManager writes is ever removed as its leftover, never a user's directory.
OWN_LEFTOVER = re.compile(r"step_\d+(\.tmp-[0-9a-f]+)?")


@dataclasses.dataclass(frozen=True)
class Listing:
    """What the directory holds: committed steps, and uncommitted leftovers of our saves."""

    committed: dict[int, str]  # step -> directory name
    leftovers: list[str]
    busy: list[str] = dataclasses.field(default_factory=list)  # leftovers that may be saves running
    retired: list[str] = dataclasses.field(default_factory=list)  # steps kept for files others reference

    def to_json(self) -> str:
        """What a CheckpointManager's leader tells the other processes (small: names only)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Listing:
        listing = json.loads(text)
        committed = {int(step): name for step, name in listing["committed"].items()}
        return cls(committed, listing["leftovers"], listing["busy"], listing["retired"])


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint, or one leftover, directly under the listed directory."""

    name: str
    step: int | None  # the step a CheckpointManager sees it as, if any
    committed: bool
    files: int  # files stored under it
    nbytes: int | None  # committed: data files + manifest, from the manifest; a leftover: its files
    # on a local disk; None if unreadable, or a leftover on an object store
    mtime: float | None  # commit time (manifest mtime) or last change; local directories only
    error: str | None = None  # why a manifest that exists could not be read
    metrics: dict[str, float | int] | None = None  # as saved with the checkpoint (its manifest)
    held_until: float | None = None  # a leftover: until when it may be a save still running


def scan(directory: str | os.PathLike[str]) -> list[Entry]:
    """The checkpoints and leftovers directly under ``directory``, by step then name.

    Raises CheckpointNotFoundError for a local directory that does not exist, and
    CheckpointError when ``directory`` is itself a checkpoint.
    """
    loc, files = _listed(directory)
    staged = staged_in(loc, files)
    under: dict[str, list[str]] = collections.defaultdict(list)
    for path in files:
        top, inside, rest = path.partition("/")
        if inside:
            under[top].append(rest)
    found = checkpoints(files, staged)
    entries = [_committed(loc, name, step, len(under[name])) for name, step in found.items()]
    entries += [_leftover(loc, name, under[name]) for name in under if name not in found and _ours(name, under[name])]
    entries += [_leftover(loc, name, under[name]) for name in _orphans(loc, under, found)]
    return sorted(entries, key=lambda e: (e.step is None, e.step or 0, e.name))


def _orphans(loc: storage.Location, under: dict[str, list[str]], found: Collection[str]) -> list[str]:
    """The retired steps (``referenced.json``, no manifest) whose files no checkpoint of the
    directory references any more: leftovers then. None while a manifest cannot be read."""
    retired = sorted(n for n, files in under.items() if REFERENCED_FILE in files and MANIFEST_FILE not in files)
    referenced: set[str] = set()
    for name in found if retired else ():
        where = storage.Location(loc.child(name))
        try:
            with storage.Store(where, threads=1) as store:
                manifest = decode_manifest(store.read_file(MANIFEST_FILE) or b"", where=where.child(MANIFEST_FILE))
        except CheckpointError:
            return []
        referenced.update(f.split("/")[1] for f in manifest.files if f.startswith("../"))
    return [n for n in retired if n not in referenced]


def _ours(name: str, files: list[str]) -> bool:
    """Whether an uncommitted subdirectory is a leftover of ours (see module docstring); a
    retired step (``referenced.json``: data files newer steps reference) is none."""
    if REFERENCED_FILE in files and MANIFEST_FILE not in files:
        return False
    return bool(storage.markers(files) or OWN_LEFTOVER.fullmatch(name) or STAGING_DIRECTORY.fullmatch(name))


def checkpoints(files: list[str], staged: Collection[str] = ()) -> dict[str, int | None]:
    """The checkpoints directly under a directory, given every file under it and which of its
    subdirectories are staging areas (:func:`_staged`): name -> the step a CheckpointManager
    sees it as (None if it sees none), by step then name."""
    steps = {name: step for step, name in parse_listing(files, staged).committed.items()}
    named = {top for top, _, rest in (path.partition("/") for path in files) if rest == MANIFEST_FILE} - set(staged)
    return {name: steps.get(name) for name in sorted(named, key=lambda n: (n not in steps, steps.get(n, 0), n))}


def checkpoints_in(directory: str | os.PathLike[str]) -> dict[str, int | None]:
    """:func:`checkpoints` of ``directory``, from one listing (and the staging markers of
    subdirectories holding one beside a manifest), no manifest read."""
    loc, files = _listed(directory)
    return checkpoints(files, staged_in(loc, files))


def staged_in(loc: storage.Location, files: list[str]) -> set[str]:
    """The subdirectories, in a listing of ``loc``, holding a manifest that commits nothing:
    none on an object store, where a save writes into its final prefix, so a manifest there
    commits whatever marker lies beside it (a plain one naming another checkpoint: copied
    there with it, or written by hand)."""
    if not loc.is_local:
        return set()
    return _staged(loc, [top for top, names in _by_top(files).items() if {MANIFEST_FILE, STAGING_MARKER} <= names])


def _by_top(files: list[str]) -> dict[str, set[str]]:
    """The files of a listing by subdirectory, relative to it."""
    tops: dict[str, set[str]] = collections.defaultdict(set)
    for top, _, rest in (path.partition("/") for path in files):
        tops[top].add(rest)
    return tops


def _staged(loc: storage.Location, marked: Iterable[str]) -> set[str]:
    """Those of ``marked`` (subdirectories holding a manifest and a plain staging marker) that
    are the staging area of another name: a local save that wrote its manifest and died
    before its rename. On an object store the staging area is the checkpoint, committed by
    the manifest even before its marker is deleted; the markers there are per save
    (``format.marker_name``), so one beside a manifest (another save, still writing or
    stalled) is never read here: it leaves the checkpoint committed."""
    staged = set()
    for name in marked:
        marker = storage.read_marker(storage.Location(loc.child(name)))
        if marker is not None and marker.final is not None and marker.final != name:
            staged.add(name)
    return staged


def nested(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The subdirectories of ``directory`` that hold checkpoints themselves, with how many:
    where to look when ``directory`` holds none (one listing, no manifest read)."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    for path in _listed(directory)[1]:
        parts = path.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_FILE and not any(STAGING_DIRECTORY.fullmatch(p) for p in parts[:2]):
            found[parts[0]].add(parts[1])
    return {name: len(found[name]) for name in sorted(found)}


def _listed(directory: str | os.PathLike[str]) -> tuple[storage.Location, list[str]]:
    """The directory and every file under it; typed errors when it is none, or a checkpoint."""
    loc = storage.location(directory)
    if loc.is_local and not os.path.isdir(loc.local_path):
        raise CheckpointNotFoundError(f"{loc.url} is not a directory", file=loc.url)
    with storage.Store(loc, threads=1) as store:
        files = store.list()
    if MANIFEST_FILE in files:
        raise CheckpointError(
            f"{loc.url} is a checkpoint, not a directory of checkpoints; try `tpu-ckpt inspect {loc.url}`",
            file=loc.url,
        )
    return loc, files


def _committed(loc: storage.Location, name: str, step: int | None, files: int) -> Entry:
    """A checkpoint's entry; its size is what it stores itself (a link's data lives elsewhere)."""
    where = loc.child(name)
    mtime = _mtime(loc, name, MANIFEST_FILE)
    with storage.Store(storage.Location(where), threads=1) as store:
        data = store.read_file(MANIFEST_FILE) or b""
    try:
        manifest = decode_manifest(data, where=storage.Location(where).child(MANIFEST_FILE))
    except CheckpointError as e:
        return Entry(name, step, True, files, None, mtime, str(e))
    own = sum(size for file, size in manifest.files.items() if not file.startswith(".."))
    return Entry(name, step, True, files, own + len(data), mtime, metrics=manifest.metrics)


def _leftover(loc: storage.Location, name: str, files: list[str]) -> Entry:
    """A leftover's entry; its size is what its files take on a local disk (object store
    listings carry no sizes, and reading every object to learn one would cost too much)."""
    nbytes = sum(_local_size(loc, name, file) for file in files) if loc.is_local else None
    return Entry(name, None, False, len(files), nbytes, _mtime(loc, name), held_until=_held_until(loc, name, files))


def _held_until(loc: storage.Location, name: str, files: Collection[str] | None = None) -> float | None:
    """Until when subdirectory ``name`` may be a save still running: the latest grace period
    of its staging markers (among ``files``, its listing, when known)."""
    marker = storage.latest_marker(storage.Location(loc.child(name)), files)
    return None if marker is None else marker.held_until


def busy(entry: Entry, now: float | None = None) -> bool:
    """Whether a leftover may be a save still running (its staging marker's grace period)."""
    return entry.held_until is not None and (time.time() if now is None else now) < entry.held_until


def _local_size(loc: storage.Location, *parts: str) -> int:
    try:
        return os.lstat(os.path.join(loc.local_path, *parts)).st_size
    except FileNotFoundError:  # removed since the listing
        return 0


def _mtime(loc: storage.Location, *parts: str) -> float | None:
    """A local file's mtime (the storage layer has no such notion for object stores)."""
    if not loc.is_local:
        return None
    try:
        return os.stat(os.path.join(loc.local_path, *parts)).st_mtime
    except FileNotFoundError:
        return None


def list_run(loc: storage.Location) -> Listing:
    """What a CheckpointManager's directory holds, without listing inside the checkpoints.

    On a local disk: the directory's entries, and one stat per possible step (its manifest),
    so a listing costs the number of steps, not the number of files they hold. Object stores
    have no directories, and tensorstore lists every key under a prefix: there it is one
    listing of every file (the manager's leader's alone, see manager/_manager.py).
    """
    if not loc.is_local:
        with storage.Store(loc, threads=1) as store:
            files = store.list()
        return _with_busy(loc, parse_listing(files, staged_in(loc, files)), _by_top(files))
    root = loc.local_path
    if not os.path.isdir(root):
        return Listing({}, [])
    with os.scandir(root) as entries:  # files directly in the directory are not checkpoints
        names = {e.name for e in entries if e.is_dir(follow_symlinks=False)}
    wanted = {
        n for n in names
        if OWN_LEFTOVER.fullmatch(n) or (len(INTEGER.findall(n)) == 1 and not STAGING_DIRECTORY.fullmatch(n))
    }
    with_manifest = {n for n in wanted if os.path.isfile(os.path.join(root, n, MANIFEST_FILE))}
    retired = {n for n in wanted - with_manifest if os.path.isfile(os.path.join(root, n, REFERENCED_FILE))}
    marked = {
        n for n in with_manifest
        if STAGING_DIRECTORY.fullmatch(n) and os.path.isfile(os.path.join(root, n, STAGING_MARKER))
    }
    return _with_busy(loc, _sort(names - retired, with_manifest, _staged(loc, marked), retired))


def _with_busy(loc: storage.Location, listing: Listing, under: dict[str, set[str]] | None = None) -> Listing:
    """``listing`` with its busy leftovers: a read of each marker of each leftover (there are
    few), found in ``under`` (its files by subdirectory, when listed)."""
    now = time.time()
    held = {
        name: _held_until(loc, name, None if under is None else under.get(name, set())) for name in listing.leftovers
    }
    return dataclasses.replace(listing, busy=[n for n, until in held.items() if until is not None and now < until])


def parse_listing(files: list[str], staged: Collection[str] = ()) -> Listing:
    """Sorts the files under the directory into committed steps and leftovers (see :func:`_sort`)."""
    names: set[str] = set()
    with_manifest: set[str] = set()
    retired: set[str] = set()  # steps kept only for the data files newer steps reference
    for path in files:
        top, inside, rest = path.partition("/")
        if inside:  # files directly in the directory are not checkpoints
            names.add(top)
            if rest == MANIFEST_FILE:
                with_manifest.add(top)
            elif rest == REFERENCED_FILE:
                retired.add(top)
    return _sort(names - (retired - with_manifest), with_manifest, staged, retired - with_manifest)


def _sort(names: set[str], with_manifest: set[str], staged: Collection[str], retired: Collection[str] = ()) -> Listing:
    """The subdirectories ``names``, those in ``with_manifest`` holding one and those of them
    in ``staged`` staging areas nonetheless (:func:`_staged`), as steps and leftovers.

    A committed step is a directory with a manifest and exactly one integer in its name, but
    never a ``<name>.tmp-<hex>`` one, a name a CheckpointManager never gives a step. A
    leftover is a name a manager writes (``step_<n>``, ``step_<n>.tmp-<hex>``) without a
    manifest that commits it; a user's ``step_3.tmp-1`` holding one is neither.
    """
    committed: dict[int, str] = {}
    for name in sorted(set(with_manifest) - set(staged)):
        numbers = INTEGER.findall(name)
        if len(numbers) == 1 and not STAGING_DIRECTORY.fullmatch(name):
            committed.setdefault(int(numbers[0]), name)
    leftovers = sorted(n for n in names if OWN_LEFTOVER.fullmatch(n) and (n not in with_manifest or n in staged))
    return Listing(committed, leftovers, retired=sorted(retired))
