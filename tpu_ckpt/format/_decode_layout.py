"""The checks of a decoded manifest that no single field shows: file names, keys and byte
ranges against each other, and pieces tiling their leaf (``format/_decode.py`` checks the fields).
"""

from __future__ import annotations

from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import _keys as keys
from tpu_ckpt.format import _piece_table as piece_table
from tpu_ckpt.format import _slices as slices
from tpu_ckpt.format._manifest import PER_PROCESS, Manifest


def check_layout(manifest: Manifest, where: str, complete: bool, paths: bool = True) -> None:
    """What no single field shows: names, byte ranges and keys against each other.
    ``paths``: whether leaves carry their paths (an index file's carry their key only)."""
    linked = manifest.source["path"] if manifest.source else None
    for name in [*manifest.files, *manifest.tables]:
        data = name in manifest.files
        problem = _file_name_problem(name, linked if data else None, references=data and linked is None)
        if problem:
            raise CorruptCheckpointError(f"{where}: data file name {name!r} {problem}", file=where)
    _check_keys(manifest, where, paths)
    for leaf in manifest.leaves if complete else ():
        one_each = [((i, i + 1),) for i in range(manifest.process_count)]
        if leaf.kind == PER_PROCESS and [p.slice for p in leaf.pieces] != one_each:
            raise CorruptCheckpointError(
                f"{where}: per-process key {leaf.key!r} does not hold exactly one value for each of the "
                f"{manifest.process_count} processes that saved it ({len(leaf.pieces)} found)",
                key=leaf.key, file=where,
            )
    check_byte_ranges(manifest, where, loaded_only=True)
    with slices.grids_shared():  # leaves of one layout share their grid
        for leaf in manifest.leaves if complete else ():
            if isinstance(leaf.pieces, piece_table.LazyPieces):
                continue  # a grid's cells tile the leaf by construction (checked on load)
            problem = (
                slices.tiling_problem(leaf.shape, [p.slice for p in leaf.pieces]) if leaf.kind == "array" else None
            )
            if problem:
                raise CorruptCheckpointError(
                    f"{where}: the pieces of key {leaf.key!r} do not tile its shape: {problem}",
                    key=leaf.key, file=where,
                )


def _file_name_problem(name: str, linked: str | None, *, references: bool = False) -> str | None:
    """Names stay inside the checkpoint: plain relative paths, or, in a linked checkpoint,
    ``../<sibling>/...`` under its source, or (``references``: an incremental save's data
    files) ``../<sibling>/<plain path>``, a file of another step of the same run directory,
    one level up and no further; printable text (a lone surrogate is no file name the file
    system can be asked for: UnicodeEncodeError)."""
    parts = name.split("/")
    if linked is not None and name.startswith(linked + "/"):
        parts = parts[2:]
    elif references and len(parts) >= 3 and parts[0] == "..":
        parts = parts[1:]  # the sibling, then its file: neither may be empty, '.' or '..'
    if not name.isprintable() or "\\" in name or any(p in ("", ".", "..") for p in parts):
        return "is not a plain relative path inside the checkpoint"
    return None


def check_byte_ranges(manifest: Manifest, where: str, *, loaded_only: bool = False) -> None:
    """Every piece lies inside its file, and no two share a byte (so each read is checked
    against its own crc32c: a range read once serves exactly one piece). ``loaded_only``:
    only the pieces already in memory (a format 2 leaf's rows are read when used); else
    every leaf's rows are read (verify)."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for leaf in manifest.leaves:
        pieces = leaf.pieces
        if loaded_only and isinstance(pieces, piece_table.LazyPieces):
            pieces = pieces.so_far()  # a restore's: the rows it read
        for p in pieces:
            if p.length:
                by_file.setdefault(p.file, []).append((p.offset, p.offset + p.length, leaf.key))
    for file, ranges in by_file.items():
        ranges.sort()
        size = manifest.files[file]
        if ranges[-1][1] > size or any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            past_end = next((r for r in ranges if r[1] > size), None)
            bad = past_end or next(a for a, b in zip(ranges, ranges[1:]) if a[1] > b[0])
            raise CorruptCheckpointError(
                f"{where}: a piece of key {bad[2]!r} at bytes [{bad[0]}, {bad[1]}) of {file} overlaps another "
                f"piece or runs past the file's {size} bytes",
                key=bad[2], file=where,
            )


def _check_keys(manifest: Manifest, where: str, paths: bool) -> None:
    """Keys are distinct, and no leaf sits inside another (a tree could not hold both). A
    root leaf (the whole tree one leaf) has key ``""`` and no path; so has a dict's leaf
    of key ``""``, but with a path, and it may have siblings."""
    seen: set[str] = set()
    inner: set[str] = set()
    for leaf in manifest.leaves:
        if leaf.key in seen:
            raise CorruptCheckpointError(f"{where}: key {leaf.key!r} appears twice", key=leaf.key, file=where)
        seen.add(leaf.key)
        if leaf.path:
            parts = leaf.key.split("/")
            inner.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = next((k for k in seen if k in inner), None)
    root = paths and any(not leaf.key and not leaf.path for leaf in manifest.leaves)
    if clash is None and root and len(seen) > 1:
        clash = ""
    if clash is not None:
        raise CorruptCheckpointError(f"{where}: key {clash!r} is both a leaf and a subtree", key=clash, file=where)
    clash = keys.node_clash(leaf.path for leaf in manifest.leaves if leaf.path)
    if clash is not None:
        raise CorruptCheckpointError(
            f"{where}: key {clash!r} names two different nodes (an attribute and a dict entry, say), so a restore "
            "would lose the leaves of one: the manifest was edited or damaged", key=clash, file=where,
        )
