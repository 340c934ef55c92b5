"""Shared test helpers (no fixtures: plain functions)."""

from __future__ import annotations

import json
import os

import numpy as np


def bits(x) -> np.ndarray:
    """The raw bytes of an array, for bit-exact comparisons (NaN payloads included)."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.reshape(-1).view(np.uint8)


def mixed_state(seed: int = 23) -> dict:
    """A small tree of a float array, an int64 array and a value, different for each seed."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32), "ids": np.arange(3000, dtype=np.int64) * seed,
        "step": seed,
    }


def assert_bit_exact(restored: dict, expected: dict) -> None:
    """``restored`` is ``expected`` (a :func:`mixed_state`), bit for bit and dtype for dtype."""
    assert restored["step"] == expected["step"]
    for key in ("w", "ids"):
        assert restored[key].dtype == expected[key].dtype and restored[key].tobytes() == expected[key].tobytes()


def axis_types(mesh) -> dict:
    """What a saved NamedSharding records of ``mesh``'s axis types: nothing when every axis is
    Auto (``jax.make_mesh``'s default before JAX 0.9), else their names ("Explicit" later)."""
    types = [t.name for t in getattr(mesh, "axis_types", ())]
    return {"axis_types": types} if any(t != "Auto" for t in types) else {}


def manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def files(path: str) -> dict[str, int]:
    """The manifest's data files, name -> size."""
    return dict(manifest(path)["files"])


def leaf(path: str, key: str) -> dict:
    """One leaf's manifest entry, its pieces decoded into dicts (see FORMAT.md)."""
    doc = manifest(path)
    entry = next(e for e in doc["leaves"] if e["key"] == key)
    if entry.get("kind") != "array":
        return entry
    from tpu_ckpt import storage
    from tpu_ckpt.catalog import read_manifest

    decoded = next(e for e in read_manifest(storage.location(str(path))).leaves if e.key == key)
    entry["pieces"] = [
        {
            "slice": [list(ab) for ab in p.slice], "file": p.file, "offset": p.offset, "length": p.length,
            "crc32c": p.crc32c,
        }
        for p in decoded.pieces
    ]
    return entry


def read_chars() -> int:
    """Bytes this process has read through read(2)-like calls so far (/proc/self/io rchar):
    what tpu_ckpt asked for, page cache or not (it never maps files)."""
    return _proc_io("rchar")


def storage_reads() -> int:
    """Bytes this process has made the kernel fetch from a block device so far
    (/proc/self/io read_bytes): readahead included, page-cache hits not."""
    return _proc_io("read_bytes")


def _proc_io(field: str) -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/io")


def evict(path) -> None:
    """Drops a file, or every file under a directory, from the page cache (only clean pages
    go: tpu_ckpt fsyncs what it writes)."""
    paths = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names] if os.path.isdir(path) else [path]
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def seal(body: bytes) -> bytes:
    """``body``, a JSON object, sealed as FORMAT.md ("The seal") says, written here from the
    text: the crc32c (Castagnoli) of these very bytes appended as its last field."""
    from tpu_ckpt.format import crc32c

    return body[:-1] + b',"manifest_crc32c":' + str(crc32c(body)).encode() + b"}"


def sealed(doc: dict) -> bytes:
    """A manifest document as tpu_ckpt writes it: compact JSON ending in its own crc32c
    (a sealed manifest reads as plain JSON: ``json.loads`` gives a document with it).

    Tests that hand-edit a manifest re-seal it, so that what they test is the edit, not the
    checksum (which would refuse any edit)."""
    body = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    return seal(json.dumps(body, separators=(",", ":")).encode())


def write_manifest(path: str, doc: dict) -> None:
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(sealed(doc))


def as_format_1_2(path) -> None:
    """Rewrites the checkpoint at ``path`` as format 1.2 wrote it: every piece inline in the
    sealed manifest, no piece tables. Tests of the checks on inline pieces start from it."""
    import dataclasses

    from tpu_ckpt import storage
    from tpu_ckpt.catalog import read_manifest

    decoded = read_manifest(storage.location(str(path)))
    leaves = tuple(dataclasses.replace(e, pieces=tuple(e.pieces)) for e in decoded.leaves)
    flat = dataclasses.replace(decoded, leaves=leaves, version="1.2", tables={})
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(flat.to_json())
    for name in decoded.tables:
        os.remove(os.path.join(path, name))


class CountingStore:
    """A real store whose reads are counted: ``files`` names every read in order,
    ``read_bytes`` the bytes of ranged reads per file, ``whole_reads`` the files read whole."""

    def __init__(self, store):
        self._store, self.location = store, store.location
        self.files: list[str] = []
        self.read_bytes: dict[str, int] = {}
        self.whole_reads: list[str] = []

    def read(self, name, start, lengths, then=None):
        self.files.append(name)
        self.read_bytes[name] = self.read_bytes.get(name, 0) + sum(lengths)
        return self._store.read(name, start, lengths, then=then)

    def read_file(self, name):
        self.files.append(name)
        self.whole_reads.append(name)
        return self._store.read_file(name)

    def close(self):
        self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def merge_indexes(planned, indexes, check: bool = True):
    """``planned`` completed by indexes in manifest form, a Python object per piece: the
    reference model the vectorized merge (``saving.merge_rows``) is tested against. Raises
    ``CheckpointError`` naming the leaf whose merged pieces miss or repeat a block."""
    import dataclasses

    from tpu_ckpt.errors import CheckpointError
    from tpu_ckpt.format import tiling_problem

    pieces: dict = {}
    files: dict = {}
    for one in indexes:
        files.update(one.files)
        for entry in one.leaves:
            pieces.setdefault(entry.key, []).extend(entry.pieces)
    leaves = tuple(
        dataclasses.replace(e, pieces=tuple(sorted(pieces.get(e.key, ()), key=lambda p: p.slice)))
        for e in planned.leaves
    )
    merged = dataclasses.replace(planned, leaves=leaves, files=dict(sorted(files.items())))
    for entry in merged.leaves if check else ():
        problem = None if entry.kind != "array" else tiling_problem(entry.shape, [p.slice for p in entry.pieces])
        if problem:
            raise CheckpointError(
                f"Leaf {entry.key!r}: {problem}; refusing to commit an inconsistent checkpoint. "
                "Are all processes saving the same tree?", key=entry.key
            )
    return merged


def binary_merge(planned, indexes):
    """Indexes in manifest form merged as the leader's commit merges them: each encoded to
    binary rows and decoded (``format.encode_index``), then ``saving.merge_rows``."""
    from tpu_ckpt.format import IndexPlan, decode_index, encode_index
    from tpu_ckpt.saving import merge_rows

    plan = IndexPlan.of(planned)
    rows = [decode_index(encode_index(one, plan), where=f"index-{p}", plan=plan) for p, one in enumerate(indexes)]
    return merge_rows(planned, plan, rows)
