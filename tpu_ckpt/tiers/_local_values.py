"""A local step's per-process values (``tc.PerProcess`` leaves): each process's own, in its part.

An ordinary save sends each process's record of its values (offsets, lengths, crc32c) to the
leader, which writes them into the manifest (``saving/_per_process.py``). A local step has no
leader and no manifest, so each process's values file carries its own record:

    values-<p>.bin    [8 bytes: n, little-endian][n bytes: the record, JSON][the values, in leaf order]

the record being ``{"token": the save's, "values": [[offset, length, crc32c], ...]}``, offsets
counted from the first value. The file is process ``p``'s, like its data files: replicated,
served and checked with its part, and tied to its save by the token. A restore reads each
process's record (two small reads of its part's holder: :func:`with_values`) and puts the
values into the merged manifest as the pieces of any checkpoint, one per process, so the
restore reads them as from any checkpoint (its own; every process's for a reshard). An upload
gives the plan this process's values back (:func:`own_values`) and writes them as any save does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import PER_PROCESS, TIER_FILE, LeafEntry, Manifest, PieceEntry, crc32c, values_file_name

_HEADER = 8
_MAX_RECORD = 1 << 24  # a record is a few dozen bytes a leaf: a larger claim is a damaged file


def write(store: storage.CheckpointStore, planned: Manifest, me: int, token: str) -> list[str]:
    """Writes this process's values file, if the tree has per-process leaves; returns its name
    (in a list: the files of this process's part it adds)."""
    values = [leaf.value for leaf in planned.leaves if leaf.kind == PER_PROCESS]
    if not values:
        return []
    places, offset = [], 0
    for value in values:
        places.append([offset, len(value), crc32c(value) if value else 0])
        offset += len(value)
    record = json.dumps({"token": token, "values": places}, separators=(",", ":")).encode()
    name = values_file_name(me)
    store.write(name, [len(record).to_bytes(_HEADER, "little"), record, *values]).result()
    return [name]


def with_values(
    record: Callable[[int], bytes | None], manifest: Manifest, token: str, where: storage.Location
) -> Manifest:
    """``manifest`` (merged from the plan and the parts) with each per-process leaf's values as
    pieces, one per process of the save, from each process's values file (``record(p)``: its
    record's bytes, :func:`read_record`, from the file's holder or its gatherer), 8 at a time."""
    per_process = [n for n, leaf in enumerate(manifest.leaves) if leaf.kind == PER_PROCESS]
    if not per_process:
        return manifest
    count = manifest.process_count

    def parsed(p: int) -> tuple[int, list[list[int]]]:
        data, name = record(p), where.child(values_file_name(p))
        if data is None:
            raise CorruptCheckpointError(f"{name}: the per-process values of this local step are missing", file=name)
        return _parse(data, name, token, len(per_process))

    with concurrent.futures.ThreadPoolExecutor(min(8, count)) as pool:
        records = list(pool.map(parsed, range(count)))
    leaves = list(manifest.leaves)
    for i, n in enumerate(per_process):
        pieces = tuple(PieceEntry(((p, p + 1),), values_file_name(p), start + places[i][0], places[i][1], places[i][2])
                       for p, (start, places) in enumerate(records))
        leaves[n] = LeafEntry(leaves[n].key, leaves[n].path, PER_PROCESS, pieces=pieces)
    sizes = {
        values_file_name(p): start + sum(length for _, length, _ in places) for p, (start, places) in enumerate(records)
    }
    return dataclasses.replace(manifest, leaves=tuple(leaves), files={**manifest.files, **sizes})


def read_record(store: storage.ReadableStore, process: int) -> bytes:
    """Process ``process``'s record as its values file begins: the 8-byte length and the JSON."""
    name = values_file_name(process)
    where = store.location.child(name)
    try:
        head = store.read(name, 0, [_HEADER]).result()[0].tobytes()
        size = int.from_bytes(head, "little")
        if not 0 < size <= _MAX_RECORD:
            raise ValueError(f"a record of {size} bytes")
        return head + store.read(name, _HEADER, [size]).result()[0].tobytes()
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{where}: the per-process values of this local step are unreadable ({e})", file=where
        ) from None


def _parse(data: bytes, where: str, token: str, count: int) -> tuple[int, list[list[int]]]:
    """A record (:func:`read_record`): where its values start, and each value's place."""
    try:
        size = int.from_bytes(data[:_HEADER], "little")
        if len(data) != _HEADER + size or not 0 < size <= _MAX_RECORD:
            raise ValueError(f"a record of {len(data) - _HEADER} bytes claiming {size}")
        record: Any = json.loads(data[_HEADER:])
        places = record["values"]
        if record["token"] != token:
            raise ValueError(f"of the save {record['token']!r}, not {token!r}")
        if len(places) != count or not all(len(p) == 3 and all(type(x) is int and x >= 0 for x in p) for p in places):
            raise ValueError(f"{len(places)} values for {count} per-process leaves")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{where}: the per-process values of this local step are unreadable ({e})", file=where
        ) from None
    return _HEADER + size, places


def own_values(source: str, plan: Manifest, me: int) -> Manifest:
    """``plan`` (decoded: its per-process leaves hold no value) with this process's values, read
    from its values file in the local step ``source`` and checked against their crc32c: what an
    upload of the step writes as any save does."""
    per_process = [n for n, leaf in enumerate(plan.leaves) if leaf.kind == PER_PROCESS]
    if not per_process:
        return plan
    name, info = values_file_name(me), storage.read_json(source, TIER_FILE, 1 << 16)
    token = info.get("token") if isinstance(info, dict) else None
    if not isinstance(token, str):
        where = storage.Location(source).child(TIER_FILE)
        raise CorruptCheckpointError(f"{where} names no save token: its values cannot be tied to it", file=where)
    local = storage.Store(storage.Location(source))
    with local:
        start, places = _parse(read_record(local, me), local.location.child(name), token, len(per_process))
        size = storage.file_size(local.location, name) or 0  # a local step: on this host's disk
        if any(start + offset + length > size for offset, length, _ in places):
            where = local.location.child(name)
            raise CorruptCheckpointError(f"{where}: a value is claimed past the file's {size} bytes", file=where)
        leaves = list(plan.leaves)
        for n, (offset, length, crc) in zip(per_process, places):
            value = local.read(name, start + offset, [length]).result()[0].tobytes()
            if crc32c(value) != crc:
                raise CorruptCheckpointError(f"{local.location.child(name)}: a value fails its crc32c", file=name)
            leaves[n] = dataclasses.replace(leaves[n], value=value)
    return dataclasses.replace(plan, leaves=tuple(leaves))
