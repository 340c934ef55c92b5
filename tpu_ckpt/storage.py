"""Storage: the only module that touches files and object stores.

A checkpoint lives in one directory (or object-store prefix). Writers put everything into a
staging location and commit it atomically: on a local disk the staging directory is a
sibling ``<name>.tmp-<token>`` renamed onto the final name; on ``memory://``, ``gs://`` and
``s3://``, where there is no rename, files are written in place and the manifest, written
last, is the commit marker. Either way a reader sees a checkpoint only once its manifest
exists at the final location.

Object stores go through tensorstore kvstores. Local files do not: measured here,
tensorstore's kvstore holds two extra copies of every value it writes (a 512 MB write peaks
at +1 GB of RSS) and three while reading one, and it only accepts ``bytes``. Writing local
files with ``os.writev`` straight from the arrays' buffers costs no copy at all. Reads
``preadv`` into fresh aligned arrays, which JAX's CPU backend adopts without a copy, through
``safe_reads``, which trusts no file or name it is given: no FIFO, device or oversized
manifest, nothing outside the checkpoint, and never a mapping a later edit could change.

All kvstores share one process-wide tensorstore context: AWS credentials and the request
limits are then set up once per process, not once per Store. Where settings come from:

- ``gs://``: the ``gcs`` driver. ``TENSORSTORE_GCS_HTTP_URL`` (an emulator) is read by
  tensorstore when it opens a bucket that no Store has open; Google credentials once per
  process (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's default credentials, GCE metadata).
- ``s3://``: the ``s3`` driver. ``AWS_ENDPOINT_URL`` is read here and passed as ``endpoint``
  (tensorstore ignores that variable); credentials come from tensorstore's default AWS chain
  (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profile files, ECS, EC2 metadata); the
  region from the bucket itself (a HEAD request), never from ``AWS_REGION``.

Transient failures (HTTP 408, 429, 5xx, dropped connections) are retried by tensorstore
with exponential backoff under the policy in ``RETRIES``, which we set explicitly rather than
rely on tensorstore's default of 32 retries (a quarter of an hour against an endpoint that is
down): 8 retries, delays doubling from 1 s to at most 32 s plus up to 1 s of jitter, about two
minutes in all. Then the operation fails with a ``CheckpointError`` naming the object.

Listing a prefix is filtered here as well as by the server: the ``gcs`` driver asks for a key
range (``startOffset``/``endOffset``) and trusts the reply, so a GCS-compatible server that
ignores those parameters (gcp-storage-emulator does) would make a prefix's listing, and its
``delete_range``, cover the whole bucket. A Store therefore opens the bucket's root, keeps its
prefix itself, and deletes object by object (which is what ``delete_range`` does anyway).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import os
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import numpy as np
import tensorstore as ts

from tpu_ckpt import safe_reads
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.safe_reads import IOV_MAX, advance, aligned_empty

# Retries of transient gcs and s3 request failures, by tensorstore (see module docstring).
RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "32s"}

# One for the whole process (see module docstring); memory:// stores live in it, shared by
# every open of the same path.
_CONTEXT = ts.Context({"gcs_request_retries": RETRIES, "s3_request_retries": RETRIES})


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
            if os.environ.get("AWS_ENDPOINT_URL"):
                spec["endpoint"] = os.environ["AWS_ENDPOINT_URL"]
            return spec
        raise ValueError(f"Unsupported checkpoint location {self.url!r}: use a local path, gs://, s3:// or memory://")


def location(path: str | os.PathLike[str]) -> Location:
    text = os.fspath(path)
    if not text:
        raise ValueError("Checkpoint path is empty")
    loc = Location(text)
    loc.kvstore_spec()  # validates the scheme
    return loc


class IOPool:
    """A few IO threads handing back ``concurrent.futures.Future``s.

    Not a ``ThreadPoolExecutor``: that refuses new work once the interpreter begins to shut
    down, which is exactly when an in-flight asynchronous save must still be finished.
    """

    def __init__(self, threads: int):
        self._size = threads
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if not self._threads:  # started on first use: listing and manifest reads need none
            self._threads = [threading.Thread(target=self._work, name="tpu_ckpt io", daemon=True) for _ in range(self._size)]
            for thread in self._threads:
                thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:  # noqa: BLE001 - delivered through the future
                    future.set_exception(error)


class Store:
    """Reads and writes the files of one checkpoint directory.

    ``write`` and ``read`` return ``concurrent.futures.Future``s so callers keep many
    transfers in flight. Call :meth:`close` (or use ``with``) when done.
    """

    def __init__(self, loc: Location, *, threads: int = 8):
        self.location = loc
        self._pool = IOPool(threads)
        # Object stores: the bucket's root and this directory's key prefix (see module docstring).
        self._kv, self._prefix = (None, "") if loc.is_local else _open_kvstore(loc)
        self._root = os.path.abspath(loc.local_path) if loc.is_local else ""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        """Starts writing one whole file from ``buffers`` (bytes-like); resolves once durable."""
        if self._kv is None:
            return self._pool.submit(self._write_local, name, buffers)
        data = b"".join(buffers)  # the kvstore API takes bytes only
        return self._pool.submit(lambda: self._wait(self._kv.write(self._prefix + name, data), "Writing", name))

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        """Starts reading consecutive byte ranges of a file, beginning at ``start``.

        Resolves to one writable uint8 array per length (one read request for all of them),
        after running ``then`` on them in the IO thread (e.g. checksums, which thereby run in
        parallel). The arrays are fresh and 64-byte aligned: nothing done to the file later
        changes them. Fails with :class:`CorruptCheckpointError` when the file is missing,
        too short, not a regular file, or named outside the checkpoint (``safe_reads``).
        """
        reader = self._read_kv if self._kv is not None else self._read_local

        def read_and_then() -> list[np.ndarray]:
            chunks = reader(name, start, lengths)
            if then is not None:
                then(chunks)
            return chunks

        return self._pool.submit(read_and_then)

    def read_file(self, name: str, max_bytes: int = safe_reads.MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """A whole small file (the manifest), or None when it does not exist.

        A local file larger than ``max_bytes`` is refused before it is read (a manifest
        symlinked to ``/dev/zero`` is refused as a device); an object store serves the whole
        object, then it is refused."""
        if self._kv is None:
            return safe_reads.read_whole(safe_reads.confine(self._root, name), max_bytes)
        result = self._wait(self._kv.read(self._key(name)), "Reading", name)
        if result.state == "missing":
            return None
        if len(result.value) > max_bytes:
            where = self.location.child(name)
            raise CorruptCheckpointError(f"{where} is {len(result.value)} bytes, more than {max_bytes}", file=where)
        return result.value

    def list(self) -> list[str]:
        """Every file under the directory, as paths relative to it."""
        if self._kv is None:
            if not os.path.isdir(self._root):
                return []
            return sorted(
                os.path.relpath(os.path.join(d, f), self._root) for d, _, files in os.walk(self._root) for f in files
            )
        keys = self._wait(self._kv.list(_prefix_range(self._prefix)), "Listing", "")
        prefix = self._prefix.encode()
        return sorted(k[len(prefix) :].decode() for k in keys if k.startswith(prefix))

    def delete(self, name: str) -> None:
        if self._kv is None:
            os.unlink(os.path.join(self._root, name))
        else:
            self._wait(self._kv.write(self._prefix + name, None), "Deleting", name)

    def delete_all(self) -> None:
        if self._kv is None:
            shutil.rmtree(self._root, ignore_errors=True)
            return
        deletes = [(name, self._kv.write(self._prefix + name, None)) for name in self.list()]
        for name, done in deletes:
            self._wait(done, "Deleting", name)

    def check_written(self, sizes: dict[str, int]) -> None:
        """Raises unless every file of ``sizes`` is here, each with that many bytes.

        What a save checks just before it commits: a staging area emptied or removed while
        the save ran (``tpu-ckpt gc`` at the wrong moment, another job cleaning the same
        directory) must not be committed as a checkpoint without its data. One stat per file
        on a local disk; one listing on an object store, whose listings carry no sizes (a
        kvstore write stores the whole object or nothing, so there only absence can happen).
        """
        if self._kv is None:
            wrong = []
            for name, size in sizes.items():
                path = os.path.join(self._root, name)
                try:
                    found = os.stat(path).st_size
                except FileNotFoundError:
                    found = None
                except OSError as e:
                    raise _failed("Checking", path, e) from e
                if found != size:
                    wrong.append((name, found, size))
        else:
            present = set(self.list())
            wrong = [(name, None, size) for name, size in sizes.items() if name not in present]
        if wrong:
            name, found, size = wrong[0]
            where = self.location.child(name)
            what = "is missing" if found is None else f"holds {found} bytes, not the {size} written"
            more = f" (and {len(wrong) - 1} more files)" if len(wrong) > 1 else ""
            raise CheckpointError(
                f"{where} {what}{more}: the staging area {self.location.url} changed while the save ran "
                "(`tpu-ckpt gc`, or another job cleaning the same directory?). Nothing was committed; "
                "keep such cleanups away from running saves and save again.",
                file=where,
            )

    def _wait(self, future: Any, doing: str, name: str) -> Any:
        """The result of a kvstore operation; its failure as a CheckpointError naming the object
        (tensorstore raises ValueError, or NotImplementedError, for whatever went wrong)."""
        try:
            return future.result()
        except (ValueError, NotImplementedError) as e:
            where = self.location.child(name) if name else self.location.url
            raise CheckpointError(f"{doing} {where} failed: {e}", file=where) from e

    def _write_local(self, name: str, buffers: Sequence[Any]) -> None:
        """Creates no directory: a staging area removed under a running save must make its
        next write fail, not come back holding part of the files (see ``open_staging``)."""
        path = os.path.join(self._root, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
                while views:
                    written = os.writev(fd, views[:IOV_MAX])
                    views = advance(views, written)
                os.fsync(fd)
            finally:
                os.close(fd)  # a network file system may report a lost write only here
        except OSError as e:
            raise _failed("Writing", path, e) from e

    def _read_local(self, name: str, start: int, lengths: Sequence[int]) -> list[np.ndarray]:
        return safe_reads.read_ranges(safe_reads.confine(self._root, name), start, lengths)

    def _key(self, name: str) -> str:
        """The object-store key of file ``name``; refuses names that lead out of the prefix
        (an HTTP layer may resolve ``..`` in a URL)."""
        if safe_reads.escapes(name):
            raise safe_reads.outside_error(self.location.url, name)
        return self._prefix + name

    def _read_kv(self, name: str, start: int, lengths: Sequence[int]) -> list[np.ndarray]:
        where = self.location.child(name)
        stop = start + sum(lengths)
        try:
            result = self._kv.read(self._key(name), byte_range=slice(start, stop)).result()
        except ValueError as e:
            if "OUT_OF_RANGE" not in str(e):
                raise CheckpointError(f"Reading {where} failed: {e}", file=where) from e
            # The object is shorter than the manifest says.
            raise CorruptCheckpointError(f"{where} is truncated ({e})", file=where) from None
        if result.state == "missing":
            raise CorruptCheckpointError(f"data file {where} is missing", file=where)
        if len(result.value) != stop - start:
            raise CorruptCheckpointError(f"{where} is truncated", file=where)
        data, out, offset = np.frombuffer(result.value, np.uint8), [], 0
        for n in lengths:
            out.append(aligned_empty(n))
            out[-1][:] = data[offset : offset + n]
            offset += n
        return out


def _open_kvstore(loc: Location) -> tuple[Any, str]:
    """The kvstore at the root of ``loc``'s bucket, and ``loc``'s key prefix in it."""
    spec = loc.kvstore_spec()
    prefix = spec.pop("path").lstrip("/")
    try:
        return ts.KvStore.open(spec, context=_CONTEXT).result(), prefix
    except ValueError as e:
        raise CheckpointError(f"Could not open {loc.url}: {e}", file=loc.url) from e


def _prefix_range(prefix: str) -> Any:
    """The keys starting with ``prefix``, which is empty or ends with '/'."""
    if not prefix:
        return ts.KvStore.KeyRange()
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def is_empty(loc: Location) -> bool:
    """Whether nothing at all is stored at ``loc``."""
    if loc.is_local:
        path = loc.local_path
        return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))
    with Store(loc, threads=1) as store:
        return not store.list()


def has_staging_leftover(loc: Location) -> bool:
    """Whether an interrupted save left its local staging directory next to ``loc``."""
    if not loc.is_local:
        return False
    parent, name = os.path.split(os.path.abspath(loc.local_path.rstrip("/")))
    return os.path.isdir(parent) and any(n.startswith(name + ".tmp-") for n in os.listdir(parent))


def open_staging(loc: Location) -> Store:
    """A Store for a new staging area, whose local directory (and any missing parent) is
    created here and only here: writes create no directory (see ``Store._write_local``)."""
    if loc.is_local:
        path = os.path.abspath(loc.local_path)
        try:
            os.makedirs(path)
        except OSError as e:
            raise _failed("Creating the staging directory", path, e) from e
    return Store(loc)


def remove(loc: Location) -> None:
    """Deletes everything at ``loc`` (a failed save's staging area)."""
    with Store(loc) as store:
        store.delete_all()


def commit(staging: Location, final: Location) -> None:
    """Makes a fully written staging location visible as ``final``.

    Local: fsync the staging directory (its entries), rename it onto the final name (atomic
    on POSIX), then fsync the parent so the rename survives a power loss. Elsewhere the
    manifest, written last into the final prefix, already was the commit.
    """
    if not final.is_local:
        return
    src, dst = staging.local_path.rstrip("/"), final.local_path.rstrip("/")
    _fsync_dir(src)
    try:
        os.rename(src, dst)
    except OSError as e:
        raise CheckpointError(f"Could not commit checkpoint {dst}: rename from {src} failed: {e}", file=dst) from e
    try:
        _fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")
    except CheckpointError:
        shutil.rmtree(dst, ignore_errors=True)  # a save that raises leaves no checkpoint behind
        raise


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise _failed("Syncing the directory", path, e) from e


def _failed(doing: str, path: str, error: OSError) -> CheckpointError:
    """An OSError of a save's storage as a CheckpointError naming the file and the system's
    reason: ``os.writev`` and ``os.fsync`` name neither (a bare ``[Errno 28]``)."""
    reason = error.strerror or str(error)
    code = errno.errorcode.get(error.errno or 0)
    if code:
        reason = f"{reason} ({code})"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = "free space there or save elsewhere"
    elif error.errno == errno.EFBIG:
        advice = "raise the file size limit (`ulimit -f`) or save elsewhere"
    elif error.errno == errno.ENOENT:
        advice = "something removed the staging area while the save ran (`tpu-ckpt gc`, another job's cleanup?)"
    else:
        advice = "check that file system"
    return CheckpointError(f"{doing} {path} failed: {reason}. Nothing was committed: {advice}, then save again.", file=path)
