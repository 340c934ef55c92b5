"""A data file's bytes: the safetensors header, alignment padding and each piece's bytes.

Data files are valid safetensors files (FORMAT.md), so a shard can be opened with the
``safetensors`` package, but nothing of ours ever parses their headers: the manifest says
where each piece is. Laying out a file is the one per-piece step every save runs for every
piece, a million of them on a pod's leader, so it is one pass that makes few objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tpu_ckpt.format._manifest import (
    ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    NUMPY_DTYPES,
    PieceEntry,
    crc32c,
    dtype_name,
    slice_text,
    tensor_name,
)

if TYPE_CHECKING:
    from tpu_ckpt.format._slices import SliceSpec

# safetensors' dtype codes; dtypes it has no code for are stored as raw bytes ("U8").
SAFETENSORS_CODES = {
    "bool": "BOOL", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16",
    "float32": "F32", "float64": "F64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


_ZEROS = [bytes(n) for n in range(ALIGNMENT)]  # every padding, made once: a file may have a million


class _Header:
    """A safetensors header built one tensor at a time, as text: built from dicts and then
    serialised, a million pieces' entries cost seconds more.

    Every tensor starts at a multiple of ``ALIGNMENT`` bytes: the header is padded with
    spaces (as the safetensors spec allows) so the data starts aligned, and a tensor that
    would start unaligned is preceded by a ``__pad_<n>`` entry of ``U8`` zeros, because
    safetensors allows no holes between tensors.
    """

    def __init__(self, keep: bool = True) -> None:
        self.metadata: dict[str, str] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        self.entries: list[str] = []  # kept only with ``keep``: ``file_size`` counts them alone
        self.keep = keep
        self.entry_bytes = 0  # the entries' text, each with its comma
        self.starts: list[int] = []  # each tensor's first byte, counted from the end of the header
        self.data_bytes = 0

    def add(self, quoted: str, span: str, kind: _PieceKind, dims: str, nbytes: int) -> int:
        """Adds a piece: its key as a JSON string less the closing quote, its slice as text
        (``"0:4,0:2"``), its dtype, its shape as text (``"2,3"``); returns the padding
        before it."""
        at = self.data_bytes
        pad = -at % ALIGNMENT
        if pad:
            self._entry(f'"__pad_{len(self.starts)}":{{"dtype":"U8","shape":[{pad}],"data_offsets":[{at},{at + pad}]}}')
            at += pad
        code = kind.code
        if code is None:  # no safetensors code: raw bytes, the dtype kept in the metadata
            self.metadata[json.loads(f'{quoted}[{span}]"')] = kind.dtype
            code, dims = "U8", str(nbytes)
        self._entry(f'{quoted}[{span}]":{{"dtype":"{code}","shape":[{dims}],"data_offsets":[{at},{at + nbytes}]}}')
        self.starts.append(at)
        self.data_bytes = at + nbytes
        return pad

    def _entry(self, text: str) -> None:
        """One tensor's entry (ASCII: keys are JSON-escaped): kept, or only counted."""
        if self.keep:
            self.entries.append(text)
        self.entry_bytes += len(text) + 1

    def size(self) -> int:
        """The bytes ``encoded`` gives, without joining the entries."""
        unpadded = len(self._head()) + self.entry_bytes + 1  # + the closing brace
        return 8 + unpadded + (-(8 + unpadded) % ALIGNMENT)

    def _head(self) -> str:
        return json.dumps({"__metadata__": self.metadata}, separators=(",", ":"))[:-1]

    def encoded(self) -> bytes:
        """The header as written: its length (u64), the JSON, spaces up to the alignment."""
        raw = (",".join([self._head(), *self.entries]) + "}").encode()
        raw += b" " * (-(8 + len(raw)) % ALIGNMENT)
        return len(raw).to_bytes(8, "little") + raw


class _PieceKind(NamedTuple):
    dtype: str  # the manifest's name
    code: str | None  # safetensors' name, if it has one
    exported: bool  # numpy shares its bytes through the buffer protocol (ml_dtypes' it refuses)

    @staticmethod
    def of(dtype: Any) -> _PieceKind:
        name = dtype_name(dtype)
        return _PieceKind(name, SAFETENSORS_CODES.get(name), name in NUMPY_DTYPES)


def file_size(pieces: Iterable[tuple[str, SliceSpec, str, tuple[int, ...], int]]) -> int:
    """The size of the data file of ``(key, slice, dtype name, shape, nbytes)`` pieces as
    ``data_file_bytes`` lays it out, header and padding included, without their bytes."""
    header = _Header(keep=False)  # each entry counted and dropped: a file may hold a million pieces
    for key, spec, dtype, shape, nbytes in pieces:
        header.add(json.dumps(key)[:-1], slice_text(spec), _PieceKind.of(dtype), ",".join(map(str, shape)), nbytes)
    return header.size() + header.data_bytes


SMALL_PIECE = 16 << 10
"""Pieces up to this size are copied into the file's next buffer, together with the padding
around them, rather than written from their own: a pod's leader writes a million of them,
and each buffer of its own costs an iovec and Python work in the writing thread, which then
waits on the interpreter lock a thousand times a file. The copies add at most the small
pieces' own bytes (``DataFileBytes.copied``)."""


class DataFileBytes(NamedTuple):
    """A data file ready to write, and where its pieces are in it."""

    buffers: list[Any]  # what to write, in order: the header, then the pieces and their padding
    size: int
    entries: list[PieceEntry]  # each piece's manifest entry, in the order given
    copied: int  # bytes of small pieces copied into ``buffers``, beyond the pieces' own


class Texts:
    """The texts a save's data files repeat, made once a save: every file of a pod's save
    names the same few thousand keys, and a file's pieces share a few slices and shapes."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}  # a key as JSON, less its closing quote
        self.spans: dict[SliceSpec, str] = {}
        self.shapes: dict[tuple[int, ...], str] = {}
        self.kinds: dict[Any, _PieceKind] = {}

    def quoted(self, key: str) -> str:
        text = self.keys[key] = json.dumps(key)[:-1]
        return text

    def span(self, spec: SliceSpec) -> str:
        text = self.spans[spec] = slice_text(spec)
        return text

    def dims(self, shape: tuple[int, ...]) -> str:
        text = self.shapes[shape] = ",".join(map(str, shape))
        return text


class PlannedPiece(NamedTuple):
    """One block of one leaf in a data file, as the sharding callback cut it, with its data
    (a numpy array, or a single-device ``jax.Array`` until the write or snapshot brings it
    to the host) and its size. A named tuple: a save plans one per piece, a million at pod
    scale."""

    key: str
    slice: SliceSpec
    data: Any
    nbytes: int

    @property
    def name(self) -> str:
        return tensor_name(self.key, self.slice)


def data_file_bytes(name: str, pieces: Iterable[PlannedPiece], texts: Texts | None = None) -> DataFileBytes:
    """Lays out pieces (their data a host array or a CPU device's, read in place) as the
    data file ``name``, in one pass:
    its bytes to write, its size, and each piece's manifest entry (offset, length, crc32c).

    One pass and few objects, because a pod's save runs this for a million pieces: the texts
    files repeat come from ``texts`` (one per save), and consecutive small pieces and their
    padding become one buffer (``SMALL_PIECE``); a big piece is written from a flat view of
    its own bytes.
    """
    header = _Header()
    texts = texts or Texts()
    keys, spans, shapes, kinds = texts.keys, texts.spans, texts.shapes, texts.kinds
    out: list[Any] = [b""]  # the header goes first, once it is complete
    run: list[Any] = []  # small pieces and padding, joined into one buffer before the next big piece
    slices, lengths, crcs = [], [], []
    copied = 0
    for key, spec, array, _ in pieces:
        kind = kinds.get(array.dtype)
        if kind is None:
            kind = kinds[array.dtype] = _PieceKind.of(array.dtype)
        shape = array.shape
        if type(array) is not np.ndarray or not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        pad = header.add(
            keys.get(key) or texts.quoted(key), spans.get(spec) or texts.span(spec), kind,
            shapes.get(shape) or texts.dims(shape), nbytes,
        )
        if pad:
            run.append(_ZEROS[pad])
        if nbytes <= SMALL_PIECE:
            run.append(array)  # joined through the buffer protocol, which takes any dtype flat
            copied += nbytes
        else:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(memoryview(array).cast("B") if kind.exported else array.reshape(-1).view(np.uint8))
        slices.append(spec)
        lengths.append(nbytes)
        crcs.append(crc32c(array))
    if run:
        out.append(b"".join(run))
    out[0] = encoded = header.encoded()
    base = len(encoded)
    entries = [PieceEntry(s, name, base + at, n, c) for s, at, n, c in zip(slices, header.starts, lengths, crcs)]
    return DataFileBytes(out, base + header.data_bytes, entries, copied)
