"""Where a checkpoint lives: a local directory or an object-store prefix, named by a URL
(a path, ``gs://``, ``s3://`` or ``memory://``), and the tensorstore kvstore that reaches it."""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any
from urllib.parse import urlparse

from tpu_ckpt.format import staging_directory
from tpu_ckpt.settings import settings


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
        local file is written from the buffers themselves, through a bounce buffer no
        larger than the file (``storage/_direct_writes.py``); an object is joined into one
        ``bytes`` and tensorstore copies that twice more (``storage/_objects.py``)."""
        return 2 if self.is_local else 3

    @property
    def name(self) -> str:
        """The last component of the path: a checkpoint's name in its directory."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def sibling(self, name: str) -> Location:
        """The location beside this one called ``name``: another step of the same run
        directory (an incremental save's references, FORMAT.md "References")."""
        if self.is_local:
            return Location(os.path.normpath(os.path.join(self.local_path, os.pardir, name)))
        parent, _, own = self.url.rstrip("/").rpartition("/")
        if not own or parent.endswith(":/"):  # a bucket itself
            raise ValueError(f"{self.url} is the root of its store: nothing lies beside it")
        return Location(f"{parent}/{name}")

    def staging(self, token: str) -> Location:
        """Where a save writes before committing (see module docstring)."""
        if self.is_local:
            return Location(staging_directory(self.local_path.rstrip("/"), token))
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
    if loc.scheme in ("gs", "s3"):
        _check_object_url(loc.url)
    return loc


def _check_object_url(url: str) -> None:
    """An object-store URL names a bucket and a prefix of plain segments: an object store has
    no directories, so ``..``, ``.`` and an empty segment would name other keys than the
    prefix's (``a/../b`` is not ``b``), which a save writes and then cannot find or remove."""
    parsed = urlparse(url)
    if not parsed.netloc:
        raise ValueError(f"{url!r} names no bucket: give {parsed.scheme}://BUCKET/PATH")
    prefix = parsed.path.strip("/")
    bad = [s for s in (prefix.split("/") if prefix else []) if s in ("", ".", "..")]
    if bad:
        raise ValueError(
            f"{url!r} has a path segment {bad[0]!r}: an object-store prefix is made of plain names (no '.', '..' "
            "or empty segments); write the prefix it should be"
        )
