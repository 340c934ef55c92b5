"""The storage backend of a checkpoint in an object store (``gs://``, ``s3://``) or in
``memory://``, through tensorstore kvstores; the only module that imports tensorstore.

All kvstores share one process-wide tensorstore context: AWS credentials and the retry
policy are then set up once per process, not once per store (each store brings its own
request limit, below). Where settings come from:

- ``gs://``: the ``gcs`` driver. ``TENSORSTORE_GCS_HTTP_URL`` (an emulator) is read by
  tensorstore when it opens a bucket that no store has open; Google credentials once per
  process (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's default credentials, GCE metadata).
- ``s3://``: the ``s3`` driver. ``AWS_ENDPOINT_URL`` (read once, by ``settings.py``) is
  passed as ``endpoint`` (tensorstore ignores that variable); credentials come from
  tensorstore's default AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profile
  files, ECS, EC2 metadata); the region from the bucket itself (a HEAD request), never from
  ``AWS_REGION``.

Transient failures (HTTP 408, 429, 5xx, dropped connections) are retried by tensorstore a
few times, quickly (``RETRIES``: 2 retries after 0.1 s and 0.2 s), then issued again by
``_retries.retrying`` with exponential backoff and jitter until the ``object_retry_seconds``
setting (15 minutes) has passed: a throttling bucket slows a save down instead of failing it.
Each request waits first for its turn under ``object_requests_per_second`` (``_request_rate``).
Then, or at once for any other error, the operation fails with a ``CheckpointError`` naming
the object: tensorstore raises ValueError, or NotImplementedError, for whatever went wrong.

``write`` replaces an object; ``create`` writes one only if it is absent, which a save's commit
asks for when it writes its manifest (``saving/_commit.py``): ``ifGenerationMatch=0`` on Cloud
Storage, a check tensorstore makes before the PUT on S3; a failed precondition comes back from
tensorstore as a success with no generation, which ``create`` turns into an error.

Writes: a data file arrives as buffers, which the kvstore API takes only joined into one
``bytes`` value, and which tensorstore copies (twice: its binding makes a ``std::string``,
then a Cord of it) into a request of its own before ``write`` returns. The write is issued
at once and the join dropped, so a write in flight holds one copy of its object, three
while it is being issued; ``plan_save`` keeps objects to ``object_bytes``
(``sharding/_bounded_files.py``), which a retried request re-sends at most.

Reads: a ranged read is cut into requests of at most ``REQUEST_BYTES``, and a store keeps
``object_reads_in_flight`` (a setting, default 32) requests in flight: it has that many IO
threads (or ``io_threads``, if more), each issuing one read's requests together, and a
request limit as high of its own in tensorstore, whose default limit (32) is shared by every
store of the process. A range comes back as a numpy view into the ``bytes`` tensorstore
returned, copied only when it spans several requests (``request_chunks``). Sizes a manifest claims
are checked against the object's real size first (``PROBE_FROM_BYTES``, ``read_file``). Reads
may name a sibling step's ``../step_<n>/<file>``, and nothing else out of the prefix (``_read_key``).

Listing a prefix is filtered here as well as by the server: the ``gcs`` driver asks for a key
range (``startOffset``/``endOffset``) and trusts the reply, so a GCS-compatible server that
ignores those parameters (gcp-storage-emulator does) would make a prefix's listing, and its
``delete_range``, cover the whole bucket. A store therefore opens the bucket's root, keeps its
prefix itself, and deletes object by object (which is what ``delete_range`` does anyway).
"""

from __future__ import annotations

import builtins
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tpu_ckpt.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from tpu_ckpt.storage import _safe_reads as safe_reads
from tpu_ckpt.storage._first_reads import FirstReadChecks
from tpu_ckpt.storage._io_pool import IOPool, PooledStore
from tpu_ckpt.storage._request_chunks import request_chunks
from tpu_ckpt.storage._request_rate import paced
from tpu_ckpt.storage._retries import retrying

if TYPE_CHECKING:  # storage opens this backend: importing it here would be a cycle
    from tpu_ckpt.storage._location import Location

logger = logging.getLogger(__name__)

RETRIES = {"max_retries": 2, "initial_delay": "100ms", "max_delay": "1s"}
_NO_VALUE = b"\x02"  # tensorstore's generation of a missing key: if_equal=_NO_VALUE writes only if absent


@functools.cache
def _context() -> Any:
    """The one tensorstore context; memory:// stores live in it too, shared by every open of
    the same path. Built, and tensorstore imported, on the first open of an object store: the
    commands that read local checkpoints never pay for it."""
    import tensorstore as ts

    return ts.Context({"gcs_request_retries": RETRIES, "s3_request_retries": RETRIES})


class ObjectStore(PooledStore):
    """The objects under one checkpoint's prefix (``storage.Backend``)."""

    def __init__(self, loc: Location, *, threads: int, reads_in_flight: int):
        import tensorstore as ts  # here: reading local checkpoints never imports it (``_context``)

        self.location = loc
        self._pool = IOPool(max(threads, reads_in_flight))  # a thread waits on each read or write
        spec = loc.kvstore_spec()
        self._prefix = spec.pop("path").lstrip("/")
        self._referenced: set[bytes] = set()  # sibling steps' keys ``unwritten`` found
        self._first_reads = FirstReadChecks()
        if spec["driver"] in ("gcs", "s3"):  # memory:// has no requests
            spec[f"{spec['driver']}_request_concurrency"] = {"limit": max(threads, reads_in_flight)}
        try:
            self._kv = paced(ts.KvStore.open(spec, context=_context()).result())  # the bucket's root (module docstring)
        except ValueError as e:
            raise CheckpointError(f"Could not open {loc.url}: {e}", file=loc.url) from e

    def write(self, name: str, buffers: Sequence[Any]) -> concurrent.futures.Future:
        """Issues the write here, so that only tensorstore's copy of the object outlives this
        call (module docstring); an IO thread waits for it."""
        key, where = self._prefix + name, self.location.child(name)
        issue = lambda: self._kv.write(key, b"".join(buffers))  # noqa: E731 (the kvstore API takes bytes only)
        # A retry joins the buffers again: the caller keeps them until the write is done.
        return self._pool.submit(retrying, issue, "Writing", where, issue())

    def create(self, name: str, data: bytes) -> None:
        """Writes object ``name`` only if it does not exist: two saves of one checkpoint commit one manifest, and the
        other learns that it lost. A retry of ours that finds the object may have found our first attempt's, whose
        answer was lost: then the object holds ``data`` (another save's manifest of the same tree may too, which only a
        first attempt can tell apart). tensorstore's own retries are not seen here: one that finds our object reports a
        loss, and leaves the checkpoint committed."""
        key, where = self._key(name), self.location.child(name)
        attempts: builtins.list[int] = []

        def issue() -> Any:
            attempts.append(1)
            return self._kv.write(key, data, if_equal=_NO_VALUE)

        if retrying(issue, "Writing", where).generation:
            return
        if len(attempts) > 1 and self._read_whole(key, where) == data:
            return
        raise CheckpointExistsError(
            f"{where} already exists: another save committed {self.location.url} while this one ran "
            "(two jobs, or a stale process, saving to the same path?). This save's manifest was not written.",
            file=where,
        )

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        return self._pool.submit(self._read_ranges, name, start, lengths, then=then)

    def check_before_reading(self, names: Iterable[str], check: Callable[[str], None]) -> None:
        """Runs ``check(name)`` before the first read of each of ``names`` through this store,
        once, and raises its error from every read of that name: each process pays for the
        objects it reads, not for every object a checkpoint names (a pod's restore would
        otherwise probe every referenced object from every host: ``catalog``'s references)."""
        self._first_reads.add(names, check)

    def check_unread(self, name: str) -> None:
        """Runs now, without reading ``name``, what its first read would check first (``check_before_reading``):
        ``tc.check_restore`` reads no data, yet must fail where the restore would."""
        self._first_reads.before_reading(name)

    def read_file(self, name: str, max_bytes: int = safe_reads.MAX_WHOLE_FILE_BYTES) -> bytes | None:
        """Refuses an object larger than ``max_bytes`` from one byte past that bound, which
        only such an object has, before reading it whole."""
        key, where = self._key(name), self.location.child(name)
        if self._has_byte(key, max_bytes, where):
            raise CorruptCheckpointError(f"{where} is more than the {max_bytes} bytes it may be", file=where)
        value = self._read_whole(key, where)
        if value is None:
            return None
        if len(value) > max_bytes:  # replaced since
            raise CorruptCheckpointError(f"{where} is {len(value)} bytes, more than {max_bytes}", file=where)
        return value

    def _read_whole(self, key: str, where: str) -> bytes | None:
        result = retrying(lambda: self._kv.read(key), "Reading", where)
        return None if result.state == "missing" else result.value  # a new copy at every access

    def _has_byte(self, key: str, at: int, where: str) -> bool:
        """Whether the object holds byte ``at``: one request of one byte, which tells a size claimed by a manifest from
        the object's real size. A range past the end is answered 416 (``OUT_OF_RANGE``), or by some GCS-compatible
        servers with a reply whose Content-Range ends before it starts, which tensorstore refuses as unexpected."""
        try:
            result = retrying(lambda: self._kv.read(key, byte_range=slice(at, at + 1)), "Reading", where)
        except CheckpointError as e:
            if "OUT_OF_RANGE" in str(e.__cause__) or "Unexpected Content-Range" in str(e.__cause__):
                return False
            raise
        return result.state != "missing" and len(result.value) == 1

    def list(self, outside: Iterable[str] = ()) -> list[str]:
        """The names under the prefix, but for those an HTTP layer would resolve elsewhere
        (:func:`unsafe_key`): they are logged as refused, and never read nor deleted. Those under
        its subdirectories ``outside`` (a run's known steps) are not listed at all (:func:`_around`)."""
        keys = [
            k for r in _around(self._prefix, outside)
            for k in retrying(functools.partial(self._kv.list, r), "Listing", self.location.url)
        ]
        prefix = self._prefix.encode()
        names = sorted(k[len(prefix) :].decode(errors="replace") for k in keys if k.startswith(prefix))
        refused = [name for name in names if unsafe_key(self._prefix + name)]
        if refused:
            logger.warning(
                "tpu_ckpt: refused %d objects under %s whose names hold '.', '..' or empty segments (%s): "
                "a request for one may reach another object, or another bucket, so tpu_ckpt never reads or "
                "deletes them; remove them with your object store's own tools",
                len(refused), self.location.url, ", ".join(map(repr, refused[:5])),
            )
        return [name for name in names if not unsafe_key(self._prefix + name)]

    def delete(self, name: str) -> None:
        self._delete(name, None)

    def delete_all(self) -> None:
        """Deletes the listed objects by their exact keys, never a key range: a range's
        request may cover more than the prefix (module docstring). All are issued at once."""
        for name, issued in [(name, self._kv.write(self._key(name), None)) for name in self.list()]:
            self._delete(name, issued)

    def _delete(self, name: str, issued: Any) -> None:
        key = self._key(name)
        retrying(lambda: self._kv.write(key, None), "Deleting", self.location.child(name), issued)

    def is_empty(self) -> bool:
        return not self.list()

    def unwritten(self, sizes: Mapping[str, int]) -> builtins.list[tuple[str, int | None, int]]:
        """One listing, which carries no sizes: a kvstore write stores the whole object or
        nothing, so only absence can happen; and one of each sibling step referenced (``_read_key``)."""
        keys = {name: self._read_key(name)[0].encode() for name in sizes}
        listed, own = set(self._referenced), self._prefix.encode()
        for prefix in {key[: key.rfind(b"/") + 1] for key in keys.values() if key not in listed}:
            listed.update(
                retrying(functools.partial(self._kv.list, _prefix_range(prefix.decode())), "Listing", self.location.url)
            )
        self._referenced.update(key for key in listed if not key.startswith(own))  # a commit checks twice: listed once
        return [(name, None, size) for name, size in sizes.items() if keys[name] not in listed]

    def _key(self, name: str) -> str:
        """Refuses names that lead out of the prefix, or onto another key under it: an HTTP
        layer may resolve ``..``, ``.`` and ``//`` in a URL (:func:`unsafe_key`)."""
        if safe_reads.escapes(name) or unsafe_key(self._prefix + name):
            raise safe_reads.outside_error(self.location.url, name)
        return self._prefix + name

    def _read_key(self, name: str) -> tuple[str, str]:
        """The key of a data file a read may name, and the URL errors name: the checkpoint's
        own, or a sibling step's that an incremental save references (``../step_<n>/<file>``,
        FORMAT.md "References"): the key beside the prefix, never further out."""
        reference = safe_reads.step_reference(name)
        if reference is None:
            return self._key(name), self.location.child(name)
        parent = self._prefix.rstrip("/").rpartition("/")[0]
        key = "/".join(filter(None, (parent, *reference)))
        if not self._prefix or unsafe_key(key):
            raise safe_reads.outside_error(self.location.url, name)
        return key, self.location.sibling(reference[0]).child(reference[1])

    def sized_unlike(self, sizes: Mapping[str, int]) -> builtins.list[tuple[str, str, str]]:
        """The data files of ``sizes`` (``_read_key``) not stored with that many bytes: (name, URL, what is wrong). A
        kvstore lists no sizes: one-byte reads tell one (``_unlike``); never a whole object. They run on the calling
        thread, which may be one of this store's IO threads (a check before a first read, ``check_before_reading``): a
        probe queued on its pool would wait for the threads that wait for it."""
        keys = {name: self._read_key(name) for name in sizes}
        found = [(name, where, self._unlike(key, where, sizes[name])) for name, (key, where) in keys.items()]
        return [(name, where, what) for name, where, what in found if what is not None]

    def _unlike(self, key: str, where: str, size: int) -> str | None:
        """What is wrong with object ``key`` unless it holds ``size`` bytes: its byte ``size`` is not
        there, its byte ``size - 1`` is (a third request, of no bytes, tells missing from shorter)."""
        if self._has_byte(key, size, where):
            return f"holds more than the {size} bytes recorded"
        if size and self._has_byte(key, size - 1, where):
            return None
        if retrying(lambda: self._kv.read(key, byte_range=slice(0, 0)), "Reading", where).state == "missing":
            return "is missing"
        return f"holds fewer than the {size} bytes recorded" if size else None

    def _read_ranges(self, name: str, start: int, lengths: Sequence[int]) -> builtins.list[np.ndarray]:
        """All requests of one read are issued at once (tensorstore queues those beyond the
        store's request limit), then awaited."""
        self._first_reads.before_reading(name)
        key, where = self._read_key(name)
        stop = start + sum(lengths)
        if stop - start > PROBE_FROM_BYTES and not self._has_byte(key, stop - 1, where):
            raise CorruptCheckpointError(f"{where} is missing, or truncated: it ends before byte {stop}", file=where)
        ranges = request_ranges(start, lengths)
        issued = [self._kv.read(key, byte_range=slice(a, b)) for a, b in ranges]
        data = [_range(self._kv, key, a, b, f, where) for f, (a, b) in zip(issued, ranges)]
        return request_chunks(start, lengths, ranges, data)


REQUEST_BYTES = 32 << 20
"""The most one ranged request reads. At pod scale the request count is what a bucket limits (a read rate that ramps up,
an egress quota per project shared by every host: ~200 Gbps over 1,536 hosts is ~16 MB/s each), so requests are large: a
7.8 GB share is ~240 requests, a 1,536-host restore ~360 k, a quarter of what 8 MiB requests make. A read batch
(``read_batch_bytes``, 256 MiB) is then at least 8 requests in flight, each stream ~100 MB/s or more on GCS: more than a
host's share of the quota."""


PROBE_FROM_BYTES = 4 * REQUEST_BYTES
"""A read longer than this first checks that its object is that long (``_has_byte``): a size
claimed by a damaged or hostile manifest would otherwise be cut into requests, and memory,
in proportion to it. Shorter reads are refused from their requests' replies."""


def request_ranges(start: int, lengths: Sequence[int]) -> list[tuple[int, int]]:
    """The byte ranges of at most ``REQUEST_BYTES`` that a read of consecutive ``lengths``
    from ``start`` is cut into, back to back: lengths are kept whole in one request while
    they fit, and one longer than that is cut (so only it spans requests)."""
    out, first, at = [], start, start
    for n in lengths:
        if at > first and at + n - first > REQUEST_BYTES:
            out.append((first, at))
            first = at
        at += n
        while at - first > REQUEST_BYTES:
            out.append((first, first + REQUEST_BYTES))
            first += REQUEST_BYTES
    if at > first or not out:
        out.append((first, at))
    return out


def _range(kv: Any, key: str, a: int, b: int, issued: Any, where: str) -> np.ndarray:
    """Bytes ``a`` to ``b`` of an object (``issued``: the request's first attempt), as a read-only view of the ``bytes``
    tensorstore made; its failure, or a short or missing object, as a CheckpointError naming the object."""
    try:
        result = retrying(lambda: kv.read(key, byte_range=slice(a, b)), "Reading", where, issued)
    except CheckpointError as e:
        if "OUT_OF_RANGE" not in str(e.__cause__):
            raise
        # The object is shorter than the manifest says.
        raise CorruptCheckpointError(f"{where} is truncated ({e.__cause__})", file=where) from None
    size = b - a
    if result.state == "missing":
        raise CorruptCheckpointError(f"data file {where} is missing", file=where)
    value = result.value  # a new bytes object, copied out of tensorstore's Cord, at every access
    if len(value) != size:
        raise CorruptCheckpointError(f"{where} is truncated", file=where)
    return np.frombuffer(value, np.uint8)


def unsafe_key(key: str) -> bool:
    """Whether a key has a ``.``, ``..`` or empty segment (a leading ``/`` too): joined into a
    URL, which a client or server may normalise, it names another object, or another bucket."""
    return any(part in ("", ".", "..") for part in key.split("/"))


def _prefix_range(prefix: str) -> Any:
    """The keys starting with ``prefix``, which is empty or ends with '/'."""
    import tensorstore as ts

    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else ts.KvStore.KeyRange()


def _around(prefix: str, outside: Iterable[str]) -> builtins.list[Any]:
    """The key ranges under ``prefix`` less those of its subdirectories ``outside``: one per gap."""
    import tensorstore as ts

    whole, cuts = _prefix_range(prefix), sorted((f"{prefix}{top}/", f"{prefix}{top}0") for top in set(outside))
    starts = [whole.inclusive_min.decode(), *(stop for _, stop in cuts)]
    stops = [*(start for start, _ in cuts), whole.exclusive_max.decode()]
    return [ts.KvStore.KeyRange(a, b) for a, b in zip(starts, stops) if a < b or not b]
