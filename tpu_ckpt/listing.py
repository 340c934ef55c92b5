"""What a directory of checkpoints holds, and removing the leftovers of interrupted saves.

The rules are CheckpointManager's (manager.py), so ``tpu-ckpt ls``/``gc`` and a manager
agree on what is committed and what may be deleted: a checkpoint is a subdirectory with a
manifest, and a leftover is only ever a name the library itself writes: ``step_<n>``
without a manifest (CheckpointManager's rule) or a ``<name>.tmp-<hex>`` staging directory,
which ``tc.save`` to any path leaves when interrupted on a local disk. Anything else (a
user's own files and directories) is neither listed nor removed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re

from tpu_ckpt import storage
from tpu_ckpt.decode import decode_manifest
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError
from tpu_ckpt.format import MANIFEST_FILE

logger = logging.getLogger(__name__)

INTEGER = re.compile(r"\d+")
STAGING = re.compile(r".+\.tmp-[0-9a-f]+")  # storage.Location.staging of any name
# Only what a CheckpointManager writes is ever removed as its leftover, never a user's directory.
OWN_LEFTOVER = re.compile(r"step_\d+(\.tmp-[0-9a-f]+)?")


@dataclasses.dataclass(frozen=True)
class Listing:
    """What the directory holds: committed steps, and uncommitted leftovers of our saves."""

    committed: dict[int, str]  # step -> directory name
    leftovers: list[str]

    def to_json(self) -> str:
        """What a CheckpointManager's leader tells the other processes (small: names only)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Listing:
        listing = json.loads(text)
        return cls({int(step): name for step, name in listing["committed"].items()}, listing["leftovers"])


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


def scan(directory: str | os.PathLike[str]) -> list[Entry]:
    """The checkpoints and leftovers directly under ``directory``, by step then name.

    Raises CheckpointNotFoundError for a local directory that does not exist, and
    CheckpointError when ``directory`` is itself a checkpoint.
    """
    loc, files = _listed(directory)
    listing = parse_listing(files)
    under: dict[str, list[str]] = collections.defaultdict(list)
    for path in files:
        top, inside, rest = path.partition("/")
        if inside:
            under[top].append(rest)
    leftovers = set(listing.leftovers) | {top for top in under if STAGING.fullmatch(top)}
    entries = [_committed(loc, name, step, len(under[name])) for name, step in checkpoints(files).items()]
    entries += [_leftover(loc, name, under[name]) for name in leftovers]
    return sorted(entries, key=lambda e: (e.step is None, e.step or 0, e.name))


def checkpoints(files: list[str]) -> dict[str, int | None]:
    """The checkpoints directly under a directory, given every file under it: name -> the
    step a CheckpointManager sees it as (None if it sees none), by step then name."""
    steps = {name: step for step, name in parse_listing(files).committed.items()}
    named = {top for top, _, rest in (path.partition("/") for path in files) if rest == MANIFEST_FILE and not STAGING.fullmatch(top)}
    return {name: steps.get(name) for name in sorted(named, key=lambda n: (n not in steps, steps.get(n, 0), n))}


def checkpoints_in(directory: str | os.PathLike[str]) -> dict[str, int | None]:
    """:func:`checkpoints` of ``directory``, from one listing and no manifest read."""
    return checkpoints(_listed(directory)[1])


def nested(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The subdirectories of ``directory`` that hold checkpoints themselves, with how many:
    where to look when ``directory`` holds none (one listing, no manifest read)."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    for path in _listed(directory)[1]:
        parts = path.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_FILE and not any(STAGING.fullmatch(p) for p in parts[:2]):
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


def remove_leftovers(directory: str | os.PathLike[str], names: list[str]) -> None:
    """Deletes the given leftovers of ``directory`` (as found by :func:`scan`)."""
    loc = storage.location(directory)
    for name in names:
        logger.info("tpu_ckpt: removing %s: an uncommitted leftover", loc.child(name))
        storage.remove(storage.Location(loc.child(name)))


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
    return Entry(name, None, False, len(files), nbytes, _mtime(loc, name))


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
    listing of every file (the manager's leader's alone, see manager.py).
    """
    if not loc.is_local:
        with storage.Store(loc, threads=1) as store:
            return parse_listing(store.list())
    root = loc.local_path
    if not os.path.isdir(root):
        return Listing({}, [])
    with os.scandir(root) as entries:  # files directly in the directory are not checkpoints
        names = {e.name for e in entries if e.is_dir(follow_symlinks=False)}
    steps = {n for n in names if len(INTEGER.findall(n)) == 1 and not STAGING.fullmatch(n)}
    return _sort(names, {n for n in steps if os.path.isfile(os.path.join(root, n, MANIFEST_FILE))})


def parse_listing(files: list[str]) -> Listing:
    """Sorts the files under the directory into committed steps and leftovers (see :func:`_sort`)."""
    names: set[str] = set()
    with_manifest: set[str] = set()
    for path in files:
        top, inside, rest = path.partition("/")
        if inside:  # files directly in the directory are not checkpoints
            names.add(top)
            if rest == MANIFEST_FILE:
                with_manifest.add(top)
    return _sort(names, with_manifest)


def _sort(names: set[str], with_manifest: set[str]) -> Listing:
    """The subdirectories ``names``, those in ``with_manifest`` holding one, as steps and leftovers.

    A committed step is a directory with a manifest and exactly one integer in its name.
    Staging directories never count as committed steps, even if a save died after writing
    their manifest.
    """
    committed: dict[int, str] = {}
    for name in sorted(with_manifest):
        numbers = INTEGER.findall(name)
        if len(numbers) == 1 and not STAGING.fullmatch(name):
            committed.setdefault(int(numbers[0]), name)
    leftovers = sorted(
        n for n in names if OWN_LEFTOVER.fullmatch(n) and (n not in with_manifest or STAGING.fullmatch(n))
    )
    return Listing(committed, leftovers)


def list_on_leader(loc: storage.Location, leader: int, timeout: float) -> Listing:
    """What ``loc`` holds, as process ``leader`` sees it (collective).

    The leader lists and tells the others, which never list storage: one listing per call
    for the whole job, and with ``io_device`` the directory may be that process's local
    disk, which only it sees. Every process must therefore make the same manager calls."""
    from tpu_ckpt import distributed  # here: ``tpu-ckpt ls`` and ``gc`` list without importing JAX

    if distributed.process_count() == 1:
        return list_run(loc)
    with distributed.Coordinator(f"list {loc.url}", timeout) as coord:
        if coord.me != leader:
            return Listing.from_json(coord.receive("listing", leader))
        try:
            listing = list_run(loc)
        except BaseException as error:
            coord.report_failure(error)
            raise
        coord.publish("listing", listing.to_json())
        return listing


def remove_step(loc: storage.Location, name: str, why: str) -> None:
    """Deletes one step directory under ``loc``. The manifest goes first, so an interrupted
    delete leaves an uncommitted leftover and never a committed checkpoint with files missing."""
    logger.info("tpu_ckpt: removing %s: %s", loc.child(name), why)
    with storage.Store(storage.Location(loc.child(name)), threads=1) as store:
        with contextlib.suppress(FileNotFoundError):
            store.delete(MANIFEST_FILE)
        store.delete_all()
