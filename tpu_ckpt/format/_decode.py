"""Decoding a manifest from bytes we do not trust.

A manifest decides what a restore allocates, which files it opens and which bytes it hands
back as an array, so nothing in it is used before it is checked: first its crc32c (format
1.2 and later), then every field's type and range, then the layout as a whole (file indexes,
byte ranges inside their file and disjoint from each other, lengths equal to element count
times item size, pieces tiling their leaf, keys distinct and consistent with their paths).
Sizes are checked against each other before anything proportional to one is allocated. A
damaged manifest is a :class:`CorruptCheckpointError` naming the file and the field.

Format 2 moves the pieces of gridded leaves into binary piece tables: such a leaf's rows are
read and checked when its pieces are first used (``format/_piece_table.py``), so pieces that are
never used are never read; their byte ranges are checked against those of the other loaded
leaves by a restore, and against all by ``verify`` (``check_byte_ranges``).

Per-process index files, written during a save, use the same form and the same checks,
except that a process's pieces need not tile a leaf (``complete=False``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from tpu_ckpt.errors import CorruptCheckpointError, FormatVersionError
from tpu_ckpt.format import _keys as keys
from tpu_ckpt.format import _piece_table as piece_table
from tpu_ckpt.format import _slices as slices
from tpu_ckpt.format._decode_json import parse_json
from tpu_ckpt.format._decode_layout import (
    check_byte_ranges as check_byte_ranges,  # restore and verify import it from here
)
from tpu_ckpt.format._decode_layout import check_layout
from tpu_ckpt.format._manifest import (
    FORMAT_VERSION,
    MAX_INT,
    MAX_METRICS,
    MIN_INT,
    PER_PROCESS,
    LeafEntry,
    Manifest,
    PieceEntry,
    dtype_itemsize,
    unseal,
)

MAX_RANK = 64
_PATH_KINDS = {"dict": "dict", "attr": "attr", "seq": "seq"}  # each to its one str: a state may have a million paths
_VALUE_TYPES = (bool, int, float, str, type(None))
_FIRST_SEALED = (1, 2)


def decode_manifest(
    data: bytes, *, where: str, complete: bool = True, tables: piece_table.TableSource | None = None, tiled: bool = True
) -> Manifest:
    """The manifest in ``data`` (the bytes of ``where``), checked throughout (see module docstring).
    ``tiled=False``: every leaf as in a manifest, but holding only some of its pieces (a local-tier part).

    Format 2: a gridded leaf's pieces are read from ``tables`` when first used, and checked
    then (``format/_piece_table.py``); without ``tables`` only its shape, dtype and grid are known."""
    body, sealed = unseal(data, where=where)
    doc = parse_json(body, where)
    version = _version(doc, where)
    if not sealed and version >= _FIRST_SEALED:
        raise CorruptCheckpointError(
            f"{where}: format {'.'.join(map(str, version))} manifests end with a manifest_crc32c field, "
            "and this one does not: it is damaged or was edited by hand.",
            file=where,
        )
    manifest = _Decoder(where, complete, tables).manifest(doc, ".".join(map(str, version)))
    check_layout(manifest, where, complete and tiled, paths=complete)
    return manifest


def _version(doc: dict[str, Any], where: str) -> tuple[int, int]:
    text = doc.get("format_version")
    parts = text.split(".") if isinstance(text, str) else []
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and len(p) <= 4 for p in parts):  # '²'.isdigit()
        raise CorruptCheckpointError(f"{where}: bad format_version {_short(text)}", file=where)
    major, minor = int(parts[0]), int(parts[1])
    if major > int(FORMAT_VERSION.split(".")[0]):
        raise FormatVersionError(
            f"{where} has format version {text}, newer than this tpu_ckpt reads "
            f"({FORMAT_VERSION}); upgrade tpu_ckpt to restore it.",
            file=where,
        )
    return major, minor


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Decoder:
    """Builds the manifest's objects from its JSON, refusing any field of the wrong type or range."""

    def __init__(self, where: str, complete: bool, source: piece_table.TableSource | None = None):
        self.where = where
        self.table_source = source
        self.tables: list[tuple[str, int]] = []
        self.sizes: tuple[list[str], list[int]] = ([], [])
        self.complete = complete  # an index file's leaves carry their key, not their path
        self.shardings: dict[str, dict[str, Any]] = {}  # equal descriptions, one object (by repr)

    def fail(self, field: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: field {field} {problem}; the checkpoint is damaged, restore another one.",
            file=self.where,
        )

    def integer(self, value: Any, field: str, hi: int = MAX_INT) -> int:
        if type(value) is not int or not 0 <= value <= hi:
            raise self.fail(field, f"must be an integer in [0, {hi}], got {_short(value)}")
        return value

    def string(self, value: Any, field: str) -> str:
        if type(value) is not str:
            raise self.fail(field, f"must be a string, got {_short(value)}")
        return value

    def array(self, value: Any, field: str, length: int | None = None) -> list[Any]:
        if type(value) is not list or (length is not None and len(value) != length):
            wanted = "a list" if length is None else f"a list of {length}"
            raise self.fail(field, f"must be {wanted}, got {_short(value)}")
        return value

    def manifest(self, doc: dict[str, Any], version: str) -> Manifest:
        files = self.files(doc.get("files"))
        names = list(files)
        self.sizes = (names, list(files.values()))
        if "tables" in doc and int(version.split(".")[0]) < 2:
            raise self.fail("tables", f"appears in a format {version} manifest; piece tables came with format 2")
        tables = self.files(doc.get("tables", []), "tables")
        for name, size in tables.items():
            if size % piece_table.ROW_BYTES:
                rows = f"{piece_table.ROW_BYTES}-byte rows"
                raise self.fail("tables", f"gives {name} {size} bytes, not a whole number of {rows}")
        self.tables = list(tables.items())
        raw_leaves = self.array(doc.get("leaves"), "leaves")
        leaves = tuple(self.leaf(d, f"leaves[{i}]", names, len(raw_leaves)) for i, d in enumerate(raw_leaves))
        return Manifest(
            leaves, files, self.integer(doc.get("process_count"), "process_count", 1 << 31),
            self.string(doc.get("sharding_callback"), "sharding_callback"), version, self.source(doc.get("source")),
            self.metrics(doc.get("metrics")), tables,
        )

    def files(self, value: Any, field: str = "files") -> dict[str, int]:
        files: dict[str, int] = {}
        for i, item in enumerate(self.array(value, field)):
            name, size = self.array(item, f"{field}[{i}]", 2)
            name = self.string(name, f"{field}[{i}] (name)")
            if name in files:
                raise self.fail(f"{field}[{i}]", f"repeats the file name {name!r}")
            files[name] = self.integer(size, f"{field}[{i}] (size)")
        return files

    def source(self, value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        if type(value) is not dict:
            raise self.fail("source", f"must be an object, got {_short(value)}")
        path = self.string(value.get("path"), "source.path")
        parts = path.split("/")
        if len(parts) != 2 or parts[0] != ".." or parts[1] in ("", ".", "..") or not parts[1].isprintable():
            raise self.fail("source.path", f"must name a sibling checkpoint as '../<name>', got {path!r}")
        crc = self.integer(value.get("manifest_crc32c"), "source.manifest_crc32c", 0xFFFFFFFF)
        return {"path": path, "manifest_crc32c": crc}

    def metrics(self, value: Any) -> dict[str, float | int] | None:
        """Numbers by name; ``ls`` shows them and retention ranks steps by them."""
        if value is None:
            return None
        if type(value) is not dict or len(value) > MAX_METRICS:
            raise self.fail("metrics", f"must be an object of at most {MAX_METRICS} numbers, got {_short(value)}")
        for name, number in value.items():
            if type(number) is not float and not (type(number) is int and MIN_INT <= number <= MAX_INT):
                raise self.fail(f"metrics[{_short(name)}]", f"must be a number (not a bool), got {_short(number)}")
        return value

    def leaf(self, doc: Any, field: str, files: Sequence[str], leaf_count: int) -> LeafEntry:
        if type(doc) is not dict:
            raise self.fail(field, f"must be an object, got {_short(doc)}")
        key = self.string(doc.get("key"), f"{field}.key")
        field = f"{field} (key {_short(key)})"
        raw_path = self.array(doc.get("path"), f"{field}.path")
        path = [self.path_entry(e, f"{field}.path[{j}]", leaf_count) for j, e in enumerate(raw_path)]
        if (path or self.complete) and keys.join(path) != key:
            raise self.fail(f"{field}.key", f"{key!r} does not match its path {path}")
        kind = doc.get("kind")
        if kind == "value":
            value = doc.get("value")
            if not isinstance(value, _VALUE_TYPES):
                raise self.fail(f"{field}.value", f"must be a bool, number, string or null, got {_short(value)}")
            return LeafEntry(key, path, "value", value=value)
        if kind == PER_PROCESS:  # one piece per process (``check_layout`` counts them)
            raw = self.array(doc.get("pieces"), f"{field}.pieces")
            pieces = tuple(self.piece(p, f"{field}.pieces[{j}]", None, 0, files) for j, p in enumerate(raw))
            return LeafEntry(key, path, kind, pieces=pieces)
        if kind != "array":
            raise self.fail(f"{field}.kind", f"must be 'array', 'value' or 'per_process', got {_short(kind)}")
        if "table" in doc and self.complete:
            return self.array_leaf(doc, field, key, path, None, files)
        raw = self.array(doc.get("pieces"), f"{field}.pieces")
        if not self.complete:  # an index file: pieces of leaves whose shape the leader knows
            pieces = tuple(self.piece(p, f"{field}.pieces[{j}]", None, 0, files) for j, p in enumerate(raw))
            return LeafEntry(key, path, "array", pieces=pieces)
        return self.array_leaf(doc, field, key, path, raw, files)

    def array_leaf(
        self, doc: dict[str, Any], field: str, key: str, path: list[Any], raw: list[Any] | None, files: Sequence[str]
    ) -> LeafEntry:
        shape = tuple(self.integer(n, f"{field}.shape") for n in self.array(doc.get("shape"), f"{field}.shape"))
        if len(shape) > MAX_RANK or math.prod(shape) > MAX_INT:
            raise self.fail(f"{field}.shape", f"is not a shape an array can have: {_short(list(shape))}")
        dtype = sys.intern(self.string(doc.get("dtype"), f"{field}.dtype"))
        itemsize = dtype_itemsize(dtype)
        if type(doc.get("is_slot")) is not bool:
            raise self.fail(f"{field}.is_slot", f"must be true or false, got {_short(doc.get('is_slot'))}")
        sharding = self.sharding(doc.get("sharding"), f"{field}.sharding")
        sharding = sharding if sharding is None else self.shardings.setdefault(repr(sharding), sharding)
        if raw is None:  # format 2: the rows of a piece table, read when first used
            if "pieces" in doc:
                raise self.fail(field, "has both pieces and a table")
            pieces: Sequence[PieceEntry] = piece_table.lazy_pieces(
                self, doc, field, key, shape, itemsize, self.sizes, self.tables, self.table_source
            )
        else:
            pieces = tuple(self.piece(p, f"{field}.pieces[{j}]", shape, itemsize, files) for j, p in enumerate(raw))
        logical = self.logical(doc, field, dtype, shape)
        return LeafEntry(key, path, "array", shape, dtype, doc["is_slot"], sharding, pieces, logical=logical)

    def logical(self, doc: dict[str, Any], field: str, dtype: str, shape: tuple[int, ...]) -> str:
        """What an array leaf is restored as (format 2.1): bytes (uint8, one axis) or a typed PRNG key of
        an impl (uint32, the key's trailing axes)."""
        logical = doc.get("logical", "")
        impl = logical[len("prng_key:"):] if type(logical) is str and logical.startswith("prng_key:") else None
        if logical == "" or (logical == "bytes" and dtype == "uint8" and len(shape) == 1):
            return logical
        if impl is not None and impl.isidentifier() and dtype == "uint32" and shape:
            return logical
        wanted = "'bytes' (uint8[n]) or 'prng_key:<impl>' (uint32)"
        raise self.fail(f"{field}.logical", f"must be {wanted}, got {_short(logical)}")

    def sharding(self, value: Any, field: str) -> dict[str, Any] | None:
        """How a leaf was saved sharded, as ``pieces.describe_sharding`` writes it: a
        NamedSharding's mesh (axis sizes by name) and spec, or a kind and device count. A
        restore never needs it, but ``inspect`` and ``describe`` show every part of it."""
        if value is None:
            return None
        if type(value) is not dict or type(value.get("type")) is not str:
            raise self.fail(field, f"must be null or an object with a string type, got {_short(value)}")
        if value["type"] != "NamedSharding":
            self.integer(value.get("num_devices"), f"{field}.num_devices", 1 << 31)
            return value
        mesh, spec = value.get("mesh"), self.array(value.get("spec"), f"{field}.spec")
        if type(mesh) is not dict or not all(type(n) is int and 0 < n <= 1 << 31 for n in mesh.values()):
            raise self.fail(f"{field}.mesh", f"must map axis names to sizes, got {_short(mesh)}")
        for entry in spec:
            if not (
                entry is None or type(entry) is str or (type(entry) is list and all(type(a) is str for a in entry))
            ):
                raise self.fail(f"{field}.spec", f"must list null, axis names or lists of them, got {_short(spec)}")
        return value

    def path_entry(self, entry: Any, field: str, leaf_count: int) -> tuple[str, Any]:
        kind, name = self.array(entry, field, 2)
        if kind not in _PATH_KINDS:
            raise self.fail(field, f"has an unknown kind {_short(kind)}")
        if kind == "seq":  # an index bounded by the leaves, so rebuilding lists stays small
            return "seq", self.integer(name, field, max(leaf_count - 1, 0))
        if kind == "dict" and type(name) in (int, bool):  # a save keeps a dict's int and bool keys
            return "dict", name
        if "/" in self.string(name, field):  # save refuses such names: "/" joins a key's entries
            raise self.fail(field, f"has a name containing '/': {_short(name)}")
        return _PATH_KINDS[kind], name

    def piece(
        self, item: Any, field: str, shape: tuple[int, ...] | None, itemsize: int, files: Sequence[str]
    ) -> PieceEntry:
        """One piece, checked inline: a manifest has millions. Only a bad piece takes the slow
        path, which names exactly what is wrong with it. ``shape`` None: an index file's piece,
        whose leaf only the leader knows."""
        try:
            raw, file, offset, length, crc = item
            spec = tuple((a, b) for a, b in raw)
            bounds = shape if shape is not None else (MAX_INT,) * len(spec)
            ok = (
                type(item) is list and type(raw) is list and len(spec) == len(bounds)
                and all(type(a) is int and type(b) is int and 0 <= a <= b <= n for (a, b), n in zip(spec, bounds))
                and type(file) is int and type(offset) is int and type(length) is int and type(crc) is int
                and 0 <= file < len(files) and 0 <= offset <= MAX_INT and 0 <= crc <= 0xFFFFFFFF
                and 0 <= length <= MAX_INT and (length > 0 or crc == 0)
                and (shape is None or length == math.prod(b - a for a, b in spec) * itemsize)
            )
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return self.explain_piece(item, field, shape, itemsize, files)
        return PieceEntry(spec, files[file], offset, length, crc)

    def explain_piece(
        self, item: Any, field: str, shape: tuple[int, ...] | None, itemsize: int, files: Sequence[str]
    ) -> PieceEntry:
        """A piece checked field by field; ``shape`` None: its leaf is not known here."""
        spec, file, offset, length, crc = self.array(item, field, 5)
        pairs = self.array(spec, f"{field} (slice)", None if shape is None else len(shape))
        spec = tuple(
            (self.integer(a, f"{field} (slice)"), self.integer(b, f"{field} (slice)"))
            for a, b in (self.array(pair, f"{field} (slice)", 2) for pair in pairs)
        )
        bounds = shape if shape is not None else (MAX_INT,) * len(spec)
        if not all(a <= b <= n for (a, b), n in zip(spec, bounds)):
            raise self.fail(field, f"has slice {list(spec)} outside the leaf's shape {list(bounds)}")
        file = self.integer(file, f"{field} (file index)", len(files) - 1)
        length = self.integer(length, f"{field} (length)")
        if shape is not None and length != slices.volume(spec) * itemsize:
            held = slices.volume(spec) * itemsize
            raise self.fail(field, f"has length {length}, but its slice {list(spec)} holds {held} bytes")
        crc = self.integer(crc, f"{field} (crc32c)", 0xFFFFFFFF)
        if length == 0 and crc != 0:
            raise self.fail(field, "is empty but has a non-zero crc32c")
        return PieceEntry(spec, files[file], self.integer(offset, f"{field} (offset)"), length, crc)
