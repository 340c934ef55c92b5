"""Storage: the only module that talks to tensorstore (and to the local filesystem).

A checkpoint lives in one directory (or object-store prefix). Writers put everything into a
staging location and commit it atomically: on a local disk the staging directory is a
sibling ``<name>.tmp-<token>`` renamed onto the final name; on ``memory://``, ``gs://`` and
``s3://``, where there is no rename, files are written in place and the manifest, written
last, is the commit marker. Either way a reader sees a checkpoint only once its manifest
exists at the final location.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any
from urllib.parse import urlparse

import tensorstore as ts

from tpu_ckpt.errors import CheckpointError

# memory:// stores live as long as the process, shared by every open of the same path.
_MEMORY_CONTEXT = ts.Context()
_FILE_IO_CONCURRENCY = 32


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


class Store:
    """Reads and writes the files of one checkpoint directory through a tensorstore kvstore."""

    def __init__(self, loc: Location):
        self.location = loc
        spec = loc.kvstore_spec()
        context = (
            _MEMORY_CONTEXT
            if spec["driver"] == "memory"
            else ts.Context({"file_io_concurrency": {"limit": _FILE_IO_CONCURRENCY}})
        )
        self._kv = ts.KvStore.open(spec, context=context).result()

    def write(self, name: str, data: bytes) -> ts.Future:
        """Starts writing one whole file; the future resolves once it is durable."""
        return self._kv.write(name, data)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> ts.Future:
        """Starts reading ``[start, stop)`` of a file (the whole file by default).

        The future's ``ReadResult`` has ``state == "missing"`` when the file does not exist;
        a range past the end of the file fails with a ``ValueError`` (OUT_OF_RANGE).
        """
        if start is None and stop is None:
            return self._kv.read(name)
        return self._kv.read(name, byte_range=slice(start, stop))

    def read_file(self, name: str) -> bytes | None:
        result = self.read(name).result()
        return None if result.state == "missing" else result.value

    def exists(self, name: str) -> bool:
        return self.read(name, 0, 0).result().state != "missing"

    def list(self) -> list[str]:
        return sorted(k.decode() for k in self._kv.list().result())

    def delete(self, name: str) -> None:
        self._kv.write(name, None).result()

    def delete_all(self) -> None:
        self._kv.delete_range(ts.KvStore.KeyRange()).result()


def is_empty(loc: Location) -> bool:
    """Whether nothing at all is stored at ``loc``."""
    if loc.is_local:
        path = loc.local_path
        return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))
    return not Store(loc).list()


def remove(loc: Location) -> None:
    """Deletes everything at ``loc`` (a failed save's staging area)."""
    if loc.is_local:
        shutil.rmtree(loc.local_path, ignore_errors=True)
        return
    Store(loc).delete_all()


def commit(staging: Location, final: Location) -> None:
    """Makes a fully written staging location visible as ``final``.

    Local: rename the staging directory onto the final name (atomic on POSIX), then fsync
    the parent so the rename survives a power loss. Elsewhere the manifest, written last
    into the final prefix, already was the commit.
    """
    if not final.is_local:
        return
    src, dst = staging.local_path.rstrip("/"), final.local_path.rstrip("/")
    try:
        os.rename(src, dst)
    except OSError as e:
        raise CheckpointError(f"Could not commit checkpoint {dst}: rename from {src} failed: {e}", file=dst) from e
    parent = os.open(os.path.dirname(os.path.abspath(dst)) or ".", os.O_RDONLY)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)
