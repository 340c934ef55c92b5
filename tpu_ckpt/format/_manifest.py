"""The on-disk format: the manifest, its entries, dtypes and checksums (see FORMAT.md).

The manifest is the only file a reader trusts: it lists every leaf, every piece of every
leaf and where its bytes live (file, offset, length, crc32c). The data files are laid out
by ``format/_data_layout.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import crc32c as _crc32c
import numpy as np

from tpu_ckpt.errors import CorruptCheckpointError, FormatVersionError

if TYPE_CHECKING:  # annotations only: the format itself needs no JAX
    from tpu_ckpt.format._keys import PathEntry
    from tpu_ckpt.format._slices import SliceSpec

FORMAT_NAME = "tpu_ckpt"
FORMAT_VERSION = "2.0"
"""The on-disk format version (``MAJOR.MINOR``, FORMAT.md) this library writes. It reads any
minor version of a major version it knows, and refuses a newer major with FormatVersionError."""
LEAF_KINDS_VERSION = "2.1"
"""What a manifest holding the leaves format 2.1 added (typed PRNG keys, bytes, per-process
values: FORMAT.md "Leaf kinds") says it is; one without them still says FORMAT_VERSION."""
PER_PROCESS = "per_process"  # a leaf kind: one value per process, in the values files
MAX_METRICS = 1000  # a manifest's metrics are few numbers (a loss, an accuracy), never a log
MIN_INT, MAX_INT = -(1 << 63), (1 << 63) - 1


_ML_ITEMSIZES = {  # ml_dtypes' names and sizes, known without importing it (see dtype_itemsize)
    "bfloat16": 2,
    **dict.fromkeys(
        (
            "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
            "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
            "int2", "int4", "uint2", "uint4",
        ),
        1,
    ),
}
_ML_FLOATS = frozenset(name for name in _ML_ITEMSIZES if "float" in name)
NUMPY_DTYPES = {
    np.dtype(t).name: np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
        np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    )
}
_ITEMSIZES = {**{name: dt.itemsize for name, dt in NUMPY_DTYPES.items()}, **_ML_ITEMSIZES}
DTYPE_NAMES = frozenset(_ITEMSIZES)


@functools.cache
def _dtypes() -> dict[str, np.dtype]:
    """Every dtype a checkpoint can hold, built on first use: importing ml_dtypes costs about a
    second of CPU, which the commands that only read manifests never pay."""
    import ml_dtypes

    ml = {name: np.dtype(getattr(ml_dtypes, name)) for name in _ML_ITEMSIZES if hasattr(ml_dtypes, name)}
    return {**NUMPY_DTYPES, **ml}


def dtype_name(dtype: Any) -> str:
    """The manifest's name for a dtype; TypeError for dtypes a checkpoint cannot hold."""
    return _dtype_name(np.dtype(dtype))


@functools.cache
def _dtype_name(dt: np.dtype) -> str:
    # Cached: numpy's dtype.name is slow, and a save asks once per piece.
    name = dt.name
    if _dtypes().get(name) != dt:
        raise TypeError(f"dtype {dt!r} cannot be checkpointed (supported: {', '.join(sorted(_dtypes()))})")
    return name


def dtype_from_name(name: str) -> np.dtype:
    """A manifest's dtype; ml_dtypes is imported only for its own dtypes (``_dtypes``)."""
    try:
        return NUMPY_DTYPES[name] if name in NUMPY_DTYPES else _dtypes()[name]
    except KeyError:
        raise _unknown_dtype(name) from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a manifest's dtype, from a table: sizing leaves needs no ml_dtypes."""
    try:
        return _ITEMSIZES[name]
    except KeyError:
        raise _unknown_dtype(name) from None


def _unknown_dtype(name: str) -> FormatVersionError:
    return FormatVersionError(f"The checkpoint uses dtype {name!r}, unknown to this tpu_ckpt/ml_dtypes; upgrade them.")


crc32c = cast("Callable[[bytes | bytearray | memoryview | np.ndarray], int]", _crc32c.crc32c)
"""crc32c of a bytes-like object or a C-contiguous numpy array (hardware-accelerated); the
C function itself, called once per piece (the cast: numpy's stubs give an array the buffer
protocol only from Python 3.12, and the C function reads one on 3.11 as well)."""


class PieceEntry(NamedTuple):
    """Where one piece's bytes live: ``length`` bytes at ``offset`` of ``file``. A named
    tuple, not a frozen dataclass: a save or restore makes one per piece, a million at pod
    scale, and a frozen dataclass costs four times as much to make."""

    slice: SliceSpec
    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class LeafEntry:
    """One leaf of the saved tree: an array (with pieces) or a small Python value."""

    key: str
    path: list[PathEntry]
    kind: str  # "array" | "value" | "per_process"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    is_slot: bool = False
    sharding: dict[str, Any] | None = None
    pieces: Sequence[PieceEntry] = ()  # a tuple, or (format 2) a ``piece_table.LazyPieces``
    value: Any = None
    logical: str = ""  # an array leaf's restored type: "" (itself), "bytes", or "prng_key:<impl>"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(self.dtype) if self.kind == "array" else 0

    @functools.cached_property
    def piece_at(self) -> dict[SliceSpec, PieceEntry]:
        """The pieces by their slice (a restore onto the saved sharding looks them up here)."""
        return {p.slice: p for p in self.pieces}

    @functools.cached_property
    def rows(self) -> PieceRows:
        """The pieces grouped by their extent along the first axis (see ``read_plan.overlapping``)."""
        groups: dict[tuple[int, int], list[PieceEntry]] = {}
        for piece in self.pieces:
            if piece.slice:
                groups.setdefault(piece.slice[0], []).append(piece)
        extents = sorted(groups)
        disjoint = all(a[1] <= b[0] for a, b in zip(extents, extents[1:]))
        return PieceRows([a for a, _ in extents], [b for _, b in extents], [groups[e] for e in extents], disjoint)


@dataclasses.dataclass(frozen=True)
class PieceRows:
    """A leaf's pieces grouped by first-axis extent, sorted by start: a lookup touches the
    groups that can overlap, not every piece (a pod's leaf has hundreds)."""

    starts: list[int]
    stops: list[int]
    groups: list[list[PieceEntry]]
    disjoint: bool  # no two extents overlap, so ``stops`` is sorted too


@dataclasses.dataclass(frozen=True)
class Manifest:
    leaves: tuple[LeafEntry, ...]
    files: dict[str, int]  # data file name -> size in bytes
    process_count: int
    sharding_callback: str
    version: str = FORMAT_VERSION
    source: dict[str, Any] | None = None  # a linked checkpoint: {"path", "manifest_crc32c"}
    metrics: dict[str, float | int] | None = None  # e.g. {"loss": 0.25}: what best-k retention ranks
    tables: dict[str, int] = dataclasses.field(default_factory=dict)  # format 2: piece table name -> size

    def to_json(self) -> bytes:
        """Every leaf with its pieces inline (an index file; any reader reads it)."""
        # Pieces name their file by its index in "files": a manifest lists tens of thousands
        # of pieces, and its size is read (and parsed) on every restore.
        file_index = {name: i for i, name in enumerate(self.files)}
        doc = {
            "format": FORMAT_NAME,
            "format_version": version_for(self, self.version),
            "process_count": self.process_count,
            "sharding_callback": self.sharding_callback,
            "files": [[name, size] for name, size in self.files.items()],
            "leaves": [leaf_to_json(leaf, file_index) for leaf in self.leaves],
        }
        if self.source is not None:
            doc["source"] = self.source
        if self.metrics is not None:
            doc["metrics"] = self.metrics
        return seal(json.dumps(doc, separators=(",", ":")).encode())


def metric_values(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """``metrics`` as a manifest holds them: Python numbers by name.

    A loss fresh from a jitted step is a 0-d JAX or numpy array, so any real scalar is
    accepted and converted; a bool is refused, being a flag rather than a measure. Checked
    when a save starts, so a manifest that its own reader would refuse is never committed.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> number, got a {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"metrics holds {len(metrics)} numbers; a checkpoint stores at most {MAX_METRICS}")
    values: dict[str, float | int] = {}
    for name, value in metrics.items():
        if type(name) is not str:
            raise TypeError(f"metric names must be strings, got {_abridged(name)}")
        values[name] = _metric_value(name, value)
    return values


def _metric_value(name: str, value: Any) -> float | int:
    try:
        array = None if isinstance(value, (bool, str)) else np.asarray(value)
    except (TypeError, ValueError):  # a ragged sequence, say
        array = None
    if array is not None and array.shape == ():
        if array.dtype.kind in ("i", "u") and MIN_INT <= int(array) <= MAX_INT:
            return int(array)
        if array.dtype.kind == "f" or array.dtype.name in _ML_FLOATS:
            return float(array)
    raise TypeError(
        f"metric {name!r} must be a number (an int or float, or a numpy/JAX scalar; integers within "
        f"64 bits), got {_abridged(value)}"
    )


def _abridged(value: Any) -> str:
    """A value for an error message: a pytree's repr runs to kilobytes."""
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__} ({text[:40]}...)"


def leaf_to_json(leaf: LeafEntry, file_index: dict[str, int], *, pieces: bool = True) -> dict[str, Any]:
    """A leaf's manifest entry; ``pieces=False`` leaves its pieces out (format 2 puts a
    gridded leaf's in a piece table)."""
    doc: dict[str, Any] = {"key": leaf.key, "path": [list(e) for e in leaf.path], "kind": leaf.kind}
    if leaf.kind == "value":
        doc["value"] = leaf.value
        return doc
    if leaf.kind == PER_PROCESS:  # its pieces are its values, process by process: always inline
        doc["pieces"] = [[p.slice, file_index[p.file], p.offset, p.length, p.crc32c] for p in leaf.pieces]
        return doc
    doc.update(shape=list(leaf.shape), dtype=leaf.dtype, is_slot=leaf.is_slot, sharding=leaf.sharding)
    if leaf.logical:
        doc["logical"] = leaf.logical
    if pieces:
        doc["pieces"] = [[p.slice, file_index[p.file], p.offset, p.length, p.crc32c] for p in leaf.pieces]
    return doc


def version_for(manifest: Manifest, version: str = FORMAT_VERSION) -> str:
    """The format version ``manifest`` is written as: 2.1 when it holds a leaf kind 2.1 added,
    else ``version``, so that a checkpoint older releases could read still says 2.0."""
    new = any(leaf.logical or leaf.kind == PER_PROCESS for leaf in manifest.leaves)
    return LEAF_KINDS_VERSION if new else version


_SEAL = re.compile(rb',"manifest_crc32c":(0|[1-9][0-9]{0,9})}\Z')


def seal(body: bytes) -> bytes:
    """A JSON object with its own crc32c appended as its last field, ``manifest_crc32c``.

    The checksum covers every byte of the object as it would read without that field, so a
    reader checks it before parsing anything, and the file stays plain JSON.
    """
    return b"".join(sealed_parts([body]))


def sealed_parts(parts: Sequence[Any]) -> list[Any]:
    """:func:`seal` of the JSON object ``parts`` (buffers) make when joined, as buffers: a
    writer that takes buffers then writes a manifest of many leaves with no copy of it."""
    last = bytes(parts[-1])
    if not last.endswith(b"}"):
        raise ValueError("seal() takes a serialized JSON object")
    crc = 0
    for part in parts:
        crc = _crc32c.crc32c(part, crc)
    return [*parts[:-1], last[:-1] + b',"manifest_crc32c":' + str(crc).encode() + b"}"]


def unseal(data: bytes, *, where: str) -> tuple[bytes, bool]:
    """The JSON object a sealed file holds, checked against its crc32c, and whether it was
    sealed at all (manifests before format 1.2 were not)."""
    found = _SEAL.search(data)
    if found is None:
        return data, False
    body = data[: found.start()] + b"}"
    if crc32c(body) != int(found.group(1)):
        raise CorruptCheckpointError(
            f"{where} does not match its manifest_crc32c: the manifest is damaged or was edited "
            "(a hand edit must be re-sealed); restore another checkpoint.",
            file=where,
        )
    return body, True


ALIGNMENT = 64
"""Every tensor's data starts at a multiple of this many bytes in its data file, so a piece
read whole lands in an aligned buffer (``storage/_safe_reads.py``) that JAX's CPU backend adopts
without a copy."""


def tensor_name(key: str, slice_spec: SliceSpec) -> str:
    """The safetensors name of a piece: its key and its slice, e.g. ``w[0:4,0:2]``."""
    return f"{key}[{slice_text(slice_spec)}]"


def slice_text(slice_spec: SliceSpec) -> str:
    return ",".join(f"{a}:{b}" for a, b in slice_spec)


def sharding_text(description: dict[str, Any] | None) -> str:
    """A manifest's sharding description, short: ``data=4,model=2 P(data,model)``."""
    if description is None:
        return "host"
    if description.get("type") == "NamedSharding":
        mesh = ",".join(f"{axis}={n}" for axis, n in description["mesh"].items())
        spec = ",".join("+".join(p) if isinstance(p, list) else str(p) for p in description["spec"])
        return f"{mesh} P({spec})"
    kind, devices = description.get("type"), description.get("num_devices")
    return str(kind) if devices == 1 else f"{kind}({devices} devices)"
