"""The storage backend of a checkpoint in an object store (``gs://``, ``s3://``) or in
``memory://``, through tensorstore kvstores; the only module that imports tensorstore.

All kvstores share one process-wide tensorstore context: AWS credentials and the request
limits are then set up once per process, not once per store. Where settings come from:

- ``gs://``: the ``gcs`` driver. ``TENSORSTORE_GCS_HTTP_URL`` (an emulator) is read by
  tensorstore when it opens a bucket that no store has open; Google credentials once per
  process (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's default credentials, GCE metadata).
- ``s3://``: the ``s3`` driver. ``AWS_ENDPOINT_URL`` (read once, by ``settings.py``) is
  passed as ``endpoint`` (tensorstore ignores that variable); credentials come from
  tensorstore's default AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profile
  files, ECS, EC2 metadata); the region from the bucket itself (a HEAD request), never from
  ``AWS_REGION``.

Transient failures (HTTP 408, 429, 5xx, dropped connections) are retried by tensorstore
with exponential backoff under the policy in ``RETRIES``, which we set explicitly rather than
rely on tensorstore's default of 32 retries (a quarter of an hour against an endpoint that is
down): 8 retries, delays doubling from 1 s to at most 32 s plus up to 1 s of jitter, about two
minutes in all. Then the operation fails with a ``CheckpointError`` naming the object:
tensorstore raises ValueError, or NotImplementedError, for whatever went wrong.

Listing a prefix is filtered here as well as by the server: the ``gcs`` driver asks for a key
range (``startOffset``/``endOffset``) and trusts the reply, so a GCS-compatible server that
ignores those parameters (gcp-storage-emulator does) would make a prefix's listing, and its
``delete_range``, cover the whole bucket. A store therefore opens the bucket's root, keeps its
prefix itself, and deletes object by object (which is what ``delete_range`` does anyway).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from tpu_ckpt import safe_reads
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.io_pool import IOPool, PooledStore

if TYPE_CHECKING:  # storage opens this backend: importing it here would be a cycle
    from tpu_ckpt.storage import Location

RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "32s"}

# memory:// stores live in it too, shared by every open of the same path.
_CONTEXT = ts.Context({"gcs_request_retries": RETRIES, "s3_request_retries": RETRIES})


class ObjectStore(PooledStore):
    """The objects under one checkpoint's prefix (``storage.Backend``)."""

    def __init__(self, loc: Location, *, threads: int):
        self.location = loc
        self._pool = IOPool(threads)
        spec = loc.kvstore_spec()
        self._prefix = spec.pop("path").lstrip("/")
        try:
            self._kv = ts.KvStore.open(spec, context=_CONTEXT).result()  # the bucket's root (module docstring)
        except ValueError as e:
            raise CheckpointError(f"Could not open {loc.url}: {e}", file=loc.url) from e

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        data = b"".join(buffers)  # the kvstore API takes bytes only
        return self._pool.submit(lambda: self._wait(self._kv.write(self._prefix + name, data), "Writing", name))

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        return self._pool.submit(self._read_ranges, name, start, lengths, then=then)

    def read_file(self, name: str, max_bytes: int = safe_reads.MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """The server sends the whole object before it can be refused as too large."""
        result = self._wait(self._kv.read(self._key(name)), "Reading", name)
        if result.state == "missing":
            return None
        if len(result.value) > max_bytes:
            where = self.location.child(name)
            raise CorruptCheckpointError(f"{where} is {len(result.value)} bytes, more than {max_bytes}", file=where)
        return result.value

    def list(self) -> list[str]:
        keys = self._wait(self._kv.list(_prefix_range(self._prefix)), "Listing", "")
        prefix = self._prefix.encode()
        return sorted(k[len(prefix) :].decode() for k in keys if k.startswith(prefix))

    def delete(self, name: str) -> None:
        self._wait(self._kv.write(self._prefix + name, None), "Deleting", name)

    def delete_all(self) -> None:
        deletes = [(name, self._kv.write(self._prefix + name, None)) for name in self.list()]
        for name, done in deletes:
            self._wait(done, "Deleting", name)

    def is_empty(self) -> bool:
        return not self.list()

    def unwritten(self, sizes: Mapping[str, int]) -> list[tuple[str, int | None, int]]:
        """One listing, which carries no sizes: a kvstore write stores the whole object or
        nothing, so only absence can happen."""
        present = set(self.list())
        return [(name, None, size) for name, size in sizes.items() if name not in present]

    def _wait(self, future: Any, doing: str, name: str) -> Any:
        """The result of a kvstore operation; its failure as a CheckpointError naming the object."""
        try:
            return future.result()
        except (ValueError, NotImplementedError) as e:
            where = self.location.child(name) if name else self.location.url
            raise CheckpointError(f"{doing} {where} failed: {e}", file=where) from e

    def _key(self, name: str) -> str:
        """Refuses names that lead out of the prefix (an HTTP layer may resolve ``..`` in a URL)."""
        if safe_reads.escapes(name):
            raise safe_reads.outside_error(self.location.url, name)
        return self._prefix + name

    def _read_ranges(self, name: str, start: int, lengths: Sequence[int]) -> list[np.ndarray]:
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
            out.append(safe_reads.aligned_empty(n))
            out[-1][:] = data[offset : offset + n]
            offset += n
        return out


def _prefix_range(prefix: str) -> Any:
    """The keys starting with ``prefix``, which is empty or ends with '/'."""
    if not prefix:
        return ts.KvStore.KeyRange()
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
