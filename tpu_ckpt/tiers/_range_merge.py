"""A local step's merge, spread over the job: each process merges the parts' rows of a range of leaves.

A tier restore needs what a commit makes (a manifest and piece tables) from the plan and the
parts' indexes, which no shared storage holds. Merged on one process, that is every piece of
the job read, checked and served from one host. Instead the plan's leaves are cut into
contiguous ranges, one per process (``leaf_ranges``: as many as there are leaves, at most);
each part's holder decodes and checks its own parts' indexes and cuts them into one blob of
rows per range (``part_blobs``, its own share); process ``r`` reads range ``r``'s blob of
every part, merges and proves the tiling of its leaves as a commit does, and serves a
manifest of those leaves with their piece tables, naming only the data files its rows use
(``merge_range``). Every process reads each range's manifest (one entry per leaf) and joins
them (``joined``); it then reads only the rows of its own cells, each from its range's server.
Every leaf is in exactly one range, so the tiling of every leaf is proved, by one process.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError
from tpu_ckpt.format import (
    PLAN_FILE,
    IndexPlan,
    IndexRows,
    Manifest,
    decode_index,
    decode_manifest,
    encode_manifest,
    encode_rows,
    grids_shared,
    staged_index_file,
)
from tpu_ckpt.saving import Grids, merge_rows
from tpu_ckpt.tiers import _part_checks as part_checks

_BLOB = re.compile(r"(?:rows-(\d{5,9})-\d{5,9}|record-(\d{5,9}))\.bin")


def leaf_ranges(leaves: int, processes: int) -> list[tuple[int, int]]:
    """The ranges of leaf numbers process 0, 1, ... merges: contiguous, as even as can be."""
    count = max(1, min(leaves, processes))
    bounds = [leaves * r // count for r in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def blob_name(owner: int, index: int) -> str:
    """The rows of process ``owner``'s part for range ``index``, as its holder serves them."""
    return f"rows-{owner:05d}-{index:05d}.bin"


def record_name(owner: int) -> str:
    """Process ``owner``'s values record (``_local_values``), as its holder serves it."""
    return f"record-{owner:05d}.bin"


def blob_owner(name: str) -> int | None:
    """The part a blob (:func:`blob_name`) or a record (:func:`record_name`) is of."""
    match = _BLOB.fullmatch(name)
    return None if match is None else int(match[1] or match[2])


def part_blobs(
    own: storage.Backend, owners: Sequence[int], plan: IndexPlan, ranges: Sequence[tuple[int, int]],
    recorded: dict[str, Any] | None = None, step: int = 0,
) -> dict[str, bytes]:
    """For each part of ``owners`` this host holds, its index checked against what its
    ``tier.json`` records of local step ``step`` (``recorded``: ``part_checks.check_step``),
    decoded and checked against the plan, cut into one index per range
    (``format.encode_rows``): a holder's own share."""
    blobs = {}
    for owner in owners:
        name = staged_index_file(owner)
        data = own.read_file(name)
        if data is None:
            raise CorruptCheckpointError(f"{own.location.child(name)} is missing", file=own.location.child(name))
        try:
            rows = decode_index(data, where=own.location.child(name), plan=plan)
        except CorruptCheckpointError:
            raise
        except CheckpointError as error:  # intact, but of another save than this host's plan
            raise _not_of_one_save(own.location, error) from error
        part_checks.check_index(own.location.url, data, owner, recorded, step)
        files = list(zip(rows.names, rows.sizes.tolist()))
        for index, (first, stop) in enumerate(ranges):
            groups = {rank: g[(g["leaf"] >= first) & (g["leaf"] < stop)] for rank, g in rows.groups.items()}
            blobs[blob_name(owner, index)] = encode_rows(plan, files, groups)
    return blobs


def merge_range(
    plan: bytes, blobs: Sequence[tuple[str, bytes]], step: storage.Location, leaves: tuple[int, int] | None = None,
    table_prefix: str = "", finish: Callable[[Manifest], Manifest] | None = None,
) -> tuple[bytes, dict[str, bytes]]:
    """The merge of the local step ``step``'s leaves ``leaves`` (default: all): its plan (the
    manifest without pieces) and, for every part, the index of its rows of those leaves, into
    a format 2 manifest of those leaves and its piece tables (named from ``table_prefix``),
    as a commit makes them (``saving.merge_rows``): every row checked against the plan, each
    leaf's rows sorted and proved to tile it, the tables written from the sorted rows, the
    manifest naming the data files they use. Array operations over the rows, never a Python
    object per piece (``benchmarks/leader_commit_bench.py --tier``: 13.5 M pieces in seconds).
    ``finish``: what the merged manifest still needs (the per-process values' pieces)."""
    planned = decode_manifest(plan, where=step.child(PLAN_FILE), tiled=False)
    first, stop = leaves if leaves is not None else (0, len(planned.leaves))
    rows_plan, sub = IndexPlan.of(planned), dataclasses.replace(planned, leaves=planned.leaves[first:stop])
    with grids_shared():  # a leaf kept inline is gridded once, for its check and its encoding
        try:
            rows = [
                _shifted(decode_index(data, where=step.child(name), plan=rows_plan), first, stop)
                for name, data in blobs
            ]
            manifest, grids = merge_rows(sub, IndexPlan.of(sub), rows)
            manifest = manifest if finish is None else finish(manifest)
        except CorruptCheckpointError:
            raise
        except CheckpointError as error:  # each file is intact (its crc32c checked): they are of different saves
            raise _not_of_one_save(step, error) from error
        return encode_manifest(*_files_used(manifest, grids), table_prefix=table_prefix)


def _not_of_one_save(step: storage.Location, error: CheckpointError) -> CorruptCheckpointError:
    """The typed error for a local step whose plan and parts' indexes, each intact, are of
    different saves (a host's disk restored from an old image, a hand copy)."""
    what = f"leaf {error.key!r}" if error.key else f"{error.file or 'an index'} names another tree"
    return CorruptCheckpointError(
        f"The local step {step.url}: its {PLAN_FILE} and its parts' indexes are not of one save "
        f"({what}). Remove that step_<n> on the hosts holding it to fall back.",
        key=error.key, file=step.url,
    )


def _shifted(rows: IndexRows, first: int, stop: int) -> IndexRows:
    """``rows`` (checked against the whole plan) numbered from leaf ``first`` of the range
    ``[first, stop)``, which a holder's blob for it must keep to."""
    groups = {}
    for rank, group in rows.groups.items():
        leaf = group["leaf"].astype(np.int64)
        outside = (leaf < first) | (leaf >= stop)
        if outside.any():
            raise CorruptCheckpointError(
                f"{rows.where} holds rows of leaf {int(leaf[np.argmax(outside)])}, outside the range "
                f"{first}..{stop - 1} it was cut for: the local step's parts are damaged.",
                file=rows.where,
            )
        group = group.copy()
        group["leaf"] -= first
        groups[rank] = group
    return dataclasses.replace(rows, groups=groups)


def _files_used(manifest: Manifest, grids: Grids) -> tuple[Manifest, Grids]:
    """``manifest`` naming only the data files its pieces use (a range's rows use a few of
    the job's files), its grids' rows renumbered to match."""
    names = list(manifest.files)
    used = {names[n] for table in grids.tables() for n in np.unique(table["file"]).tolist()}
    used.update(piece.file for leaf in manifest.leaves for piece in leaf.pieces)
    kept = sorted(used)
    position = {name: n for n, name in enumerate(names)}
    number = np.zeros(len(names), np.uint32)
    number[[position[name] for name in kept]] = np.arange(len(kept), dtype=np.uint32)
    for table in grids.tables():
        table["file"] = number[table["file"]]
    return dataclasses.replace(manifest, files={name: manifest.files[name] for name in kept}), grids


def joined(planned: Manifest, parts: Sequence[Manifest], ranges: Sequence[tuple[int, int]], where: str) -> Manifest:
    """One manifest of every range's, in the plan's order; a range whose leaves are not the
    plan's is refused (its server merged another save's step)."""
    for part, (first, stop) in zip(parts, ranges):
        if [leaf.key for leaf in part.leaves] != [leaf.key for leaf in planned.leaves[first:stop]]:
            raise CorruptCheckpointError(
                f"{where}: the manifest of leaves {first}..{stop - 1} is not of the plan's leaves; the local step's "
                "parts are of different saves. Remove that step_<n> on the hosts holding it to fall back.",
                file=where,
            )
    files: dict[str, int] = {}
    tables: dict[str, int] = {}
    for part in parts:
        for name, size in part.files.items():
            if files.setdefault(name, size) != size:
                raise CorruptCheckpointError(
                    f"{where}: two ranges' manifests give data file {name} different sizes ({files[name]} and {size}); "
                    "the local step's parts are damaged. Remove that step_<n> on the hosts holding it to fall back.",
                    file=where,
                )
        tables.update(part.tables)
    leaves = tuple(leaf for part in parts for leaf in part.leaves)
    return dataclasses.replace(parts[0], leaves=leaves, files=files, tables=tables)
