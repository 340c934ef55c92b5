"""Where a checkpoint lives, the interface its files are read and written through, and the
commit that makes a save visible.

A checkpoint lives in one directory (or object-store prefix). Writers put everything into a
staging location and commit it atomically: on a local disk the staging directory is a
sibling ``<name>.tmp-<token>`` renamed onto the final name; on ``memory://``, ``gs://`` and
``s3://``, where there is no rename, files are written in place and the manifest, written
last, is the commit marker. Either way a reader sees a checkpoint only once its manifest
exists at the final location.

Save and restore run one code path for every location: they take a :class:`CheckpointStore`,
which :func:`Store` opens on the backend that suits the location (``local_store.py`` for
files, ``object_store.py`` for tensorstore kvstores), and which ``relay.RelayStore``
implements on the processes that reach an ``io_device``'s storage through its relay.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, Self, runtime_checkable
from urllib.parse import urlparse

import numpy as np

from tpu_ckpt import local_store, object_store, safe_reads
from tpu_ckpt.errors import CheckpointError
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

STAGING_MARKER = "staging.json"  # the first file of a save's staging area (:func:`mark_staging`)
STAGING_GRACE_S = 3600.0
"""How long after it started a save's staging area counts as a save in progress, which
``tpu-ckpt gc`` and a CheckpointManager's leftover cleanup leave alone."""


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory or object-store prefix, as given by the user (``url``)."""

    url: str

    @property
    def scheme(self) -> str:
        parsed = urlparse(self.url)
        return parsed.scheme if "://" in self.url else "file"

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def local_path(self) -> str:
        return self.url[len("file://") :] if self.url.startswith("file://") else self.url

    @property
    def write_copies(self) -> int:
        """How many times writing a data file holds its bytes in host memory at most: a
        local file is written from the buffers themselves; an object is joined into one
        ``bytes`` and tensorstore copies that twice more (``object_store.py``)."""
        return 1 if self.is_local else 3

    @property
    def name(self) -> str:
        """The last component of the path: a checkpoint's name in its directory."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def staging(self, token: str) -> Location:
        """Where a save writes before committing (see module docstring)."""
        if self.is_local:
            path = self.local_path.rstrip("/")
            return Location(f"{path}.tmp-{token}")
        return self

    def kvstore_spec(self) -> dict[str, Any]:
        scheme = self.scheme
        if scheme == "file":
            return {"driver": "file", "path": os.path.abspath(self.local_path) + "/"}
        parsed = urlparse(self.url)
        path = (parsed.netloc + parsed.path).strip("/") if scheme == "memory" else parsed.path.strip("/")
        if scheme == "memory":
            return {"driver": "memory", "path": path + "/"}
        if scheme == "gs":
            return {"driver": "gcs", "bucket": parsed.netloc, "path": path + "/"}
        if scheme == "s3":
            spec: dict[str, Any] = {"driver": "s3", "bucket": parsed.netloc, "path": path + "/"}
            if settings().aws_endpoint_url:
                spec["endpoint"] = settings().aws_endpoint_url
            return spec
        raise ValueError(f"Unsupported checkpoint location {self.url!r}: use a local path, gs://, s3:// or memory://")


def new_token() -> str:
    """A fresh staging token: the ``<hex>`` of ``<name>.tmp-<hex>``, which ``tpu-ckpt gc`` and
    the manager recognise as a leftover."""
    return uuid.uuid4().hex[:12]


def location(path: str | os.PathLike[str]) -> Location:
    text = os.fspath(path)
    if not text:
        raise ValueError("Checkpoint path is empty")
    loc = Location(text)
    loc.kvstore_spec()  # validates the scheme
    return loc


@runtime_checkable
class CheckpointStore(Protocol):
    """The files of one checkpoint, as save and restore use them.

    Opened on a location, then any number of ``write``, ``read`` and ``read_file`` calls;
    ``write`` and ``read`` return futures, so callers keep many transfers in flight. Then
    :meth:`close` (or leave a ``with`` block), which waits for the transfers started.
    """

    location: Location

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: Any) -> None: ...

    def close(self) -> None: ...

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        """Starts writing one whole file from ``buffers`` (bytes-like); resolves once durable."""

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        """Starts reading consecutive byte ranges of a file, beginning at ``start``.

        Resolves to one uint8 array per length, after running ``then`` on them in the IO
        thread (e.g. checksums, which thereby run in parallel). Nothing done to the file
        later changes the arrays. From a local file or a relay they are fresh, writable and
        64-byte aligned (one read request for all of them); from an object store they may be
        read-only views of the bytes received, 16-byte aligned (``object_store._chunks``), so
        a caller that writes into one, or hands it to the user, copies it first. Fails with
        ``CorruptCheckpointError`` when the file is missing, too short, not a regular file,
        or named outside the checkpoint (``safe_reads``).
        """

    def read_file(self, name: str) -> bytes | None:
        """A whole small file (the manifest), or None when it does not exist."""


@runtime_checkable
class Backend(CheckpointStore, Protocol):
    """A store on the storage itself, not through a relay: what also lists, deletes and
    checks a staging area (``tpu-ckpt gc``, ``CheckpointManager``'s retention, the commit)."""

    def read_file(self, name: str, max_bytes: int = safe_reads.MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """Refuses, with ``CorruptCheckpointError``, a file larger than ``max_bytes``."""

    def list(self) -> list[str]:
        """Every file under the location, as paths relative to it."""

    def delete(self, name: str) -> None: ...

    def delete_all(self) -> None: ...

    def is_empty(self) -> bool:
        """Whether nothing at all is stored at the location."""

    def unwritten(self, sizes: Mapping[str, int]) -> list[tuple[str, int | None, int]]:
        """The files of ``sizes`` not here with that many bytes: (name, bytes found or None
        when missing, bytes written)."""


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
    return os.path.isdir(parent) and any(n.startswith(name + ".tmp-") for n in os.listdir(parent))


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
    """Writes the staging marker, before any other file of the save: which checkpoint the
    staging area becomes, when the save started, and for how long cleanups must leave it
    alone. Whether a directory is a leftover is decided by this marker and the manifest,
    never by its name alone: a user's checkpoint may be named ``model.tmp-1``."""
    marker = {"final": final.name, "token": token, "started": time.time(), "grace_s": STAGING_GRACE_S}
    store.write(STAGING_MARKER, [json.dumps(marker).encode()]).result()


@dataclasses.dataclass(frozen=True)
class Marker:
    """A staging marker as read back (see :func:`mark_staging`)."""

    final: str | None  # None: unreadable
    started: float
    grace_s: float

    @property
    def held_until(self) -> float:  # until when the staging area may be a save still running
        return self.started + self.grace_s


def read_marker(loc: Location) -> Marker | None:
    """The staging marker at ``loc``; None when there is none. An unreadable one (written by
    hand, damaged) names no checkpoint, so it makes no manifest beside it uncommitted, and
    holds its directory back for the grace period from its last change (local files), or
    not at all (objects, which no save leaves half-written)."""
    with Store(loc, threads=1) as store:
        try:
            data = store.read_file(STAGING_MARKER, 1 << 16)
        except CheckpointError:
            data = b"{}"
    if data is None:
        return None
    try:
        marker = json.loads(data)
        return Marker(str(marker["final"]), float(marker["started"]), float(marker["grace_s"]))
    except (ValueError, TypeError, KeyError):
        return Marker(None, _changed(loc, STAGING_MARKER), STAGING_GRACE_S)


def _changed(loc: Location, name: str) -> float:
    """When local file ``name`` of ``loc`` last changed; 0 for an object or a file gone."""
    try:
        return os.stat(os.path.join(loc.local_path, name)).st_mtime if loc.is_local else 0.0
    except OSError:
        return 0.0


def remove(loc: Location) -> None:
    """Deletes everything at ``loc`` (a failed save's staging area)."""
    with Store(loc) as store:
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
    must not be committed as a checkpoint without its data.
    """
    wrong = store.unwritten(sizes)
    if not wrong:
        return
    name, found, size = wrong[0]
    where = store.location.child(name)
    what = "is missing" if found is None else f"holds {found} bytes, not the {size} written"
    more = f" (and {len(wrong) - 1} more files)" if len(wrong) > 1 else ""
    raise CheckpointError(
        f"{where} {what}{more}: the staging area {store.location.url} changed while the save ran "
        "(`tpu-ckpt gc`, or another job cleaning the same directory?). Nothing was committed; "
        "keep such cleanups away from running saves and save again.",
        file=where,
    )


def commit(staging: Location, final: Location) -> None:
    """Makes a fully written staging location visible as ``final``.

    Local: fsync the staging directory (its entries), rename it onto the final name (atomic
    on POSIX), then fsync the parent so the rename survives a power loss. Elsewhere the
    manifest, written last into the final prefix, already was the commit.
    """
    if not final.is_local:
        _unmark(final)
        return
    src, dst = staging.local_path.rstrip("/"), final.local_path.rstrip("/")
    local_store.fsync_dir(src)
    try:
        os.rename(src, dst)
    except OSError as e:
        raise CheckpointError(f"Could not commit checkpoint {dst}: rename from {src} failed: {e}", file=dst) from e
    try:
        local_store.fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")
    except CheckpointError:
        shutil.rmtree(dst, ignore_errors=True)  # a save that raises leaves no checkpoint behind
        raise
    _unmark(final)


def _unmark(final: Location) -> None:
    """Deletes the staging marker of a committed checkpoint (after its manifest, so a save
    always holds one or the other). The save stands if this fails: a marker beside the
    manifest of a checkpoint under its own name changes nothing (``listing._staged``)."""
    try:
        with Store(final, threads=1) as store:
            store.delete(STAGING_MARKER)
    except FileNotFoundError:
        pass
    except (CheckpointError, OSError) as error:
        logger.warning("tpu_ckpt: could not delete the staging marker of %s: %s", final.url, error)
