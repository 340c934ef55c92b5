"""Where a checkpoint lives, the interface its files are read and written through, and the
commit that makes a save visible.

A checkpoint lives in one directory (or object-store prefix). Writers put everything into a
staging location and commit it atomically: on a local disk the staging directory is a
sibling ``<name>.tmp-<token>`` renamed onto the final name; on ``memory://``, ``gs://`` and
``s3://``, where there is no rename, files are written in place and the manifest, written
last, is the commit marker. Either way a reader sees a checkpoint only once its manifest
exists at the final location.

Save and restore run one code path for every location: they take a :class:`CheckpointStore`,
which :func:`Store` opens on the backend that suits the location (``storage/_local.py`` for
files, ``storage/_objects.py`` for tensorstore kvstores), and which ``relay.RelayStore``
implements on the processes that reach an ``io_device``'s storage through its relay.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable, Mapping

from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.format import MANIFEST_FILE, STAGING_MARKER, is_marker, marker_name, staging_directory
from tpu_ckpt.settings import settings
from tpu_ckpt.storage import _local as local_store
from tpu_ckpt.storage import _objects as object_store
from tpu_ckpt.storage import _writers as writers
from tpu_ckpt.storage._location import Location
from tpu_ckpt.storage._protocols import Backend

logger = logging.getLogger(__name__)

STAGING_GRACE_S = 3600.0
"""How long after it started a save's staging area counts as a save in progress, which
``tpu-ckpt gc`` and a CheckpointManager's leftover cleanup leave alone."""


def Store(loc: Location, *, threads: int | None = None) -> Backend:
    """The backend for ``loc``, with ``threads`` IO threads (default: the ``io_threads``
    setting) started on first use.

    Named like a class: callers open a store with it, and which class depends on ``loc``."""
    threads = settings().io_threads if threads is None else threads
    if loc.is_local:
        return local_store.LocalStore(loc, threads=threads)
    return object_store.ObjectStore(loc, threads=threads, reads_in_flight=settings().object_reads_in_flight)


def is_empty(loc: Location) -> bool:
    with Store(loc, threads=1) as store:
        return store.is_empty()


def has_staging_leftover(loc: Location) -> bool:
    """Whether an interrupted save left its local staging directory next to ``loc``."""
    if not loc.is_local:
        return False
    parent, name = os.path.split(os.path.abspath(loc.local_path.rstrip("/")))
    return os.path.isdir(parent) and any(n.startswith(staging_directory(name, "")) for n in os.listdir(parent))


def open_staging(loc: Location, final: Location | None = None, token: str = "") -> Backend:
    """A store for a new staging area, whose local directory (and any missing parent) is
    created here and only here (see ``local_store.make_directory``); marked as the staging
    area of a save of ``final``, if given (:func:`mark_staging`)."""
    if loc.is_local and final is not None:
        _make_marked(loc, final, token)
    elif loc.is_local:
        local_store.make_directory(os.path.abspath(loc.local_path))
    elif final is not None:
        with Store(loc, threads=1) as marking:
            mark_staging(marking, final, token)  # an object appears whole: never seen half-written
    return Store(loc)


def _make_marked(loc: Location, final: Location, token: str) -> None:
    """A local staging directory that appears under its name with its marker already in it
    (made as ``.<name>`` and renamed), so a cleanup never sees it unmarked, nor its marker
    half-written."""
    path = os.path.abspath(loc.local_path.rstrip("/"))
    hidden = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}")
    local_store.make_directory(hidden)
    try:
        with Store(Location(hidden), threads=1) as store:
            mark_staging(store, final, token)
        os.rename(hidden, path)
    except BaseException as error:
        shutil.rmtree(hidden, ignore_errors=True)
        if isinstance(error, OSError):
            raise local_store.failed("Creating the staging directory", path, error) from error
        raise


def mark_staging(store: Backend, final: Location, token: str) -> None:
    """Writes the staging marker (named by :func:`marker_name`), before any other file of the
    save: which checkpoint the staging area becomes, when the save started, and for how long
    cleanups must leave it alone. Whether a directory is a leftover is decided by this
    marker and the manifest, never by its name alone: a user's checkpoint may be named
    ``model.tmp-1``. It records its writer (host, boot, process: ``_writers.identity``), so
    that a cleanup on the same host knows a dead writer's leftover at once."""
    marker = {
        "final": final.name, "token": token, "started": time.time(), "grace_s": STAGING_GRACE_S, **writers.identity()
    }
    store.write(marker_name(token, local=store.location.is_local), [json.dumps(marker).encode()]).result()


def markers(names: Iterable[str]) -> list[str]:
    """The staging markers among ``names`` (a listing of one staging area)."""
    return sorted(name for name in names if is_marker(name))


@dataclasses.dataclass(frozen=True)
class Marker:
    """A staging marker as read back (see :func:`mark_staging`)."""

    final: str | None  # None: unreadable
    started: float
    grace_s: float
    token: str | None = None  # the save's; None: unreadable
    dead: bool = False  # its writer is provably gone (``_writers.dead``): held no longer

    @property
    def held_until(self) -> float:  # until when the staging area may be a save still running
        return self.started if self.dead else self.started + self.grace_s


def read_marker(loc: Location, name: str = STAGING_MARKER) -> Marker | None:
    """The staging marker ``name`` at ``loc``; None when there is none. An unreadable one
    (written by hand, damaged) names no checkpoint, so it makes no manifest beside it
    uncommitted, and holds its directory back for the grace period from its last change
    (local files), or not at all (objects, which no save leaves half-written). The grace
    period is at most ``_writers.shorter_grace``'s; none once its writer is provably dead."""
    with Store(loc, threads=1) as store:
        try:
            data = store.read_file(name, 1 << 16)
        except CheckpointError:
            data = b"{}"
    if data is None:
        return None
    try:
        marker = json.loads(data)
        started, grace_s = float(marker["started"]), float(marker["grace_s"])
        if math.isnan(started + grace_s):  # no time: it would compare as neither held nor not
            raise ValueError(f"no time: started {started}, grace_s {grace_s}")
        return Marker(
            str(marker["final"]), started, writers.grace(grace_s), str(marker.get("token", "")), writers.dead(marker)
        )
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return Marker(None, _changed(loc, name), writers.grace(STAGING_GRACE_S))


def latest_marker(loc: Location, names: Iterable[str] | None = None) -> Marker | None:
    """Of the staging markers at ``loc`` (among ``names``, its listing, when known), the one
    whose grace period ends last: the prefix of an object store may hold several saves'
    (:func:`marker_name`), and is a save in progress while any of them is. None when there
    is none. Without ``names`` an object store's prefix is listed; a local staging
    directory is not, its only marker being the plain one."""
    if names is None and loc.is_local:
        names = [STAGING_MARKER]
    elif names is None:
        with Store(loc, threads=1) as store:
            names = store.list()
    found = [marker for marker in (read_marker(loc, name) for name in markers(names)) if marker is not None]
    return max(found, key=lambda marker: marker.held_until, default=None)


def _changed(loc: Location, name: str) -> float:
    """When local file ``name`` of ``loc`` last changed; 0 for an object or a file gone."""
    try:
        return os.stat(os.path.join(loc.local_path, name)).st_mtime if loc.is_local else 0.0
    except OSError:
        return 0.0


def remove(loc: Location) -> None:
    """Deletes everything at ``loc`` (a failed save's staging area), unless it holds a
    manifest: on an object store a save's staging area is its final prefix, where a save that
    lost the race to commit (its manifest refused as already there) finds another's
    checkpoint, which it must leave alone."""
    with Store(loc) as store:
        if not loc.is_local and MANIFEST_FILE in store.list():
            logger.warning("tpu_ckpt: %s holds another save's committed checkpoint; deleting nothing there", loc.url)
            return
        store.delete_all()


def remove_files(store: Backend, names: Iterable[str]) -> None:
    """Deletes the files ``names`` that exist (a failed save's own files; the leader may
    already have removed the staging area around them)."""
    for name in names:
        try:
            store.delete(name)
        except FileNotFoundError:
            pass


def check_written(store: Backend, sizes: Mapping[str, int]) -> None:
    """Raises unless every file of ``sizes`` is in ``store``, each with that many bytes.

    What a save checks just before it commits: a staging area emptied or removed while the
    save ran (``tpu-ckpt gc`` at the wrong moment, another job cleaning the same directory)
    must not be committed as a checkpoint without its data; nor an incremental save whose
    referenced files (``../<step>/<file>``) went meanwhile, which the error says apart.
    """
    wrong = store.unwritten(sizes)
    if not wrong:
        return
    own = [entry for entry in wrong if not entry[0].startswith("../")]
    name, found, size = (own or wrong)[0]
    where = store.location.child(name)
    what = "is missing" if found is None else f"holds {found} bytes, not the {size} written"
    more = f" (and {len(wrong) - 1} more files)" if len(wrong) > 1 else ""
    if not own:  # only references of an incremental save (FORMAT.md, "References")
        raise CheckpointError(
            f"{where} {what}{more}: this incremental save references data of {name.split('/')[1]}, which was "
            "deleted or damaged since the save began (by hand, or by another manager's retention). Nothing "
            "was committed; the next save of this manager writes those pieces itself.",
            file=where,
        )
    raise CheckpointError(
        f"{where} {what}{more}: the staging area {store.location.url} changed while the save ran "
        "(`tpu-ckpt gc`, or another job cleaning the same directory?). Nothing was committed; "
        "keep such cleanups away from running saves and save again.",
        file=where,
    )


def publish(staging: Location, final: Location, token: str = "") -> None:
    """Makes a fully written staging location visible as ``final``, and deletes the staging
    marker of the save with ``token`` (:func:`marker_name`; none written without ``final``).

    Local: fsync the staging directory (its entries), rename it onto the final name (atomic
    on POSIX), then fsync the parent so the rename survives a power loss. Elsewhere the
    manifest, written last into the final prefix, already was the commit.
    """
    if not final.is_local:
        _unmark(final, token)
        return
    src, dst = staging.local_path.rstrip("/"), final.local_path.rstrip("/")
    try:
        local_store.rename_durably(src, dst)
    except OSError as e:
        raise CheckpointError(f"Could not commit checkpoint {dst}: rename from {src} failed: {e}", file=dst) from e
    _unmark(final, token)


def _unmark(final: Location, token: str) -> None:
    """Deletes the committing save's staging marker (after its manifest, so a save always
    holds one or the other); on an object store only its own, never that of another save
    still writing into the same prefix. The save stands if this fails: a marker beside the
    manifest of a checkpoint under its own name changes nothing (``listing._staged``), and
    ``tpu-ckpt gc`` removes it once its grace period is over (``catalog/_strays.py``)."""
    try:
        with Store(final, threads=1) as store:
            store.delete(marker_name(token, local=final.is_local))
    except FileNotFoundError:
        pass
    except (CheckpointError, OSError) as error:
        logger.warning("tpu_ckpt: could not delete the staging marker of %s: %s", final.url, error)
