"""check_restore(): what a restore would do, from the manifest and piece tables alone.

A restore that fails after an hour of queueing for a pod, on a key renamed in the model, or
that reads three times the checkpoint because the new mesh cuts every piece, is better found
on a workstation first. The check runs the restore's own planner (``restoring/_plan.py``), so
every mismatch it reports is one ``tc.restore`` raises on, and the bytes and requests it
counts are the planner's read batches, coalesced as ``shared_reads.StoreReads`` issues them.
Nothing is read from the data files and no device memory is allocated (a target of
``jax.ShapeDtypeStruct`` describes devices without using them).

Per process: a single process reports itself. In a multi-process job (or with
``devices_per_process``, which models one from a single machine) each process's regions
come from the target shardings' global device maps, as ``load_and_broadcast`` plans them;
with ``io_device`` or ``load_and_broadcast`` storage reads are then moved between processes,
which the report does not model: it says what each process's devices need.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from tpu_ckpt import storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.errors import CorruptCheckpointError, TargetMismatchError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    LeafEntry,
    Manifest,
    PieceEntry,
    byte_batches,
    check_byte_ranges,
    coalesce,
    dtype_from_name,
    extent,
    full_slice,
    normalise_subtree,
    overlapping,
    sharding_text,
    under,
)
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring._mismatch import mismatches
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, RestorePlan, needed_slices, plan_restore
from tpu_ckpt.runtime import plural, size, table
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import index_to_slice

BYTES_PER_SECOND = 1e9  # one host's read throughput, for the time estimate: about a GCS bucket's


@dataclasses.dataclass(frozen=True)
class LeafCheck:
    """One array leaf the restore reads: its saved and restored form, whether this
    process's regions are cut out of the saved pieces, and what this process's plan reads
    of it (on the command line, the plan of one process holding every device)."""

    key: str
    saved: str  # dtype[shape] and saved sharding
    restored: str  # dtype and target sharding
    resharded: bool
    read_bytes: int
    over_read: int


@dataclasses.dataclass(frozen=True)
class ProcessReads:
    """What one process reads: bytes (of pieces), coalesced requests, and the bytes beyond
    those of its regions (pieces read whole, or once per region of a leaf bigger than a batch)."""

    nbytes: int = 0
    requests: int = 0
    over_read: int = 0


@dataclasses.dataclass
class RestoreReport:
    """The answer of :func:`check_restore`.

    Attributes:
      url: the checkpoint checked.
      ok: whether ``tc.restore`` would succeed as far as the manifest can tell (a corrupt
        data file is found by ``tpu-ckpt verify``, not here).
      problems: the errors the restore would raise, one line each, naming the key.
      leaves: one ``LeafCheck`` per array read: saved and restored form, bytes read.
      unread_keys: keys in the checkpoint (or its subtree) that the target does not name.
      casts: the float casts, as ``"key: float32 -> bfloat16"``.
      skipped_slots: the slot variables ``skip_slot_variables`` leaves unread.
      reads: process index -> what it reads (bytes, requests, over-read).
      bytes_per_second: the read speed the estimated times assume.
    """

    url: str
    ok: bool
    problems: list[str]
    leaves: list[LeafCheck]
    unread_keys: list[str]
    casts: list[str]
    skipped_slots: list[str]
    reads: dict[int, ProcessReads]
    bytes_per_second: float

    @property
    def bytes_per_process(self) -> dict[int, int]:
        """Process index -> bytes of pieces it reads."""
        return {p: r.nbytes for p, r in self.reads.items()}

    @property
    def requests_per_process(self) -> dict[int, int]:
        """Process index -> storage requests it makes (adjacent reads coalesced)."""
        return {p: r.requests for p, r in self.reads.items()}

    @property
    def over_read_per_process(self) -> dict[int, int]:
        """Process index -> bytes it reads beyond its own regions."""
        return {p: r.over_read for p, r in self.reads.items()}

    @property
    def seconds_per_process(self) -> dict[int, float]:
        """Process index -> estimated seconds of reading, at ``bytes_per_second``."""
        return {p: r.nbytes / self.bytes_per_second for p, r in self.reads.items()}

    @property
    def resharded(self) -> list[str]:
        """The keys whose regions are cut out of pieces saved with another layout."""
        return [leaf.key for leaf in self.leaves if leaf.resharded]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready dicts and lists (``tpu-ckpt plan --json``)."""
        doc = dataclasses.asdict(self)
        doc["reads"] = {str(p): {**dataclasses.asdict(r), "seconds": r.nbytes / self.bytes_per_second} for p, r in self.reads.items()}
        return doc

    def describe(self) -> str:
        """The verdict and problems, a table of the arrays read, what is cast, skipped or
        left unread, and a table of each process's reads (the command line's tables)."""
        verdict = "ok" if self.ok else f"would fail ({plural(len(self.problems), 'problem')})"
        lines = [f"restore of {self.url}: {verdict}", *(f"  {p}" for p in self.problems)]
        if self.leaves:
            rows = [[x.key, x.saved, x.restored, "resharded" if x.resharded else "as saved", size(x.read_bytes), size(x.over_read)] for x in self.leaves]
            lines += ["", table([["KEY", "SAVED", "RESTORED AS", "LAYOUT", "READ", "OVER-READ"], *rows], right={4, 5})]
        for title, names in (
            ("cast (float -> float)", self.casts), ("skipped slot variables, not read", self.skipped_slots),
            ("in the checkpoint, not in the target, not read", self.unread_keys),
        ):
            if names:
                lines.append(f"{title}: {', '.join(names)}")
        if self.reads:
            rows = [[str(p), size(r.nbytes), str(r.requests), size(r.over_read), f"{r.nbytes / self.bytes_per_second:.2f}s"] for p, r in self.reads.items()]
            header = ["PROCESS", "READ", "REQUESTS", "OVER-READ", f"TIME AT {size(self.bytes_per_second)}/s"]
            lines += ["", table([header, *rows], right={0, 1, 2, 3, 4})]
        return "\n".join(lines)


def check_restore(
    path: str | os.PathLike[str],
    target: Any = None,
    *,
    options: CheckpointOptions | None = None,
    subtree: str | None = None,
    bytes_per_second: float = BYTES_PER_SECOND,
    devices_per_process: int | None = None,
) -> RestoreReport:
    """What ``tc.restore(path, target, options=options, subtree=subtree)`` would do, from
    the manifest and piece tables only (no data file is read).

    Args:
      path: the checkpoint directory or URL.
      target: as for :func:`restore`: ``None``, or a pytree of arrays or ``jax.ShapeDtypeStruct``.
      options: as for :func:`restore` (``skip_slot_variables``, ``host_memory_limit``).
      subtree: as for :func:`restore`.
      bytes_per_second: each process's read speed, which turns bytes into the estimated time.
      devices_per_process: counts device ``d`` as process ``d.id // devices_per_process``,
        to plan a multi-host restore from one machine with that many devices.

    Returns:
      A :class:`RestoreReport`: whether the restore would succeed (a mismatched ``target``
      is a problem it lists, not an error), and what each process would read.

    Raises:
      ValueError: ``bytes_per_second`` or ``devices_per_process`` is not positive.
      CheckpointNotFoundError: nothing is committed at ``path``.
      UncommittedCheckpointError: only a partial, never committed save is there.
      FormatVersionError: a newer format version wrote it.
      CorruptCheckpointError: the manifest is unreadable.
    """
    if not bytes_per_second > 0 or (devices_per_process is not None and devices_per_process < 1):
        raise ValueError(f"bytes_per_second and devices_per_process must be positive, got {bytes_per_second}, {devices_per_process}")
    options = options or CheckpointOptions()
    loc = storage.location(path)
    skip = options.skip_slot_variables
    with open_checkpoint(loc) as checkpoint:  # per process, or (a report of several) every process's rows
        manifest = checkpoint.manifest
        everyone = devices_per_process is not None or jax.process_count() > 1
        checkpoint.load(needed_slices(manifest, target, subtree, skip, everyone=everyone))
    try:
        plan = plan_restore(manifest, target, subtree, skip, batch_bytes=read_batch_bytes(options), url=loc.url)
    except TargetMismatchError as first:
        problems = [str(e) for e in mismatches(manifest, target, subtree, skip, loc.url)] or [str(first)]
        return RestoreReport(loc.url, False, problems, [], [], [], [], {}, bytes_per_second)
    problems = _layout_problems(manifest, loc.child(MANIFEST_FILE))
    arrays = [e for e in plan.leaves if isinstance(e, ArrayRead)]
    process_of = None if devices_per_process is None else (lambda d: d.id // devices_per_process)
    return RestoreReport(
        loc.url, not problems, problems, _leaf_checks(plan), _unread(manifest, plan, subtree, target),
        [f"{a.key}: {a.leaf.dtype} -> {a.dtype}" for a in arrays if dtype_from_name(a.leaf.dtype) != a.dtype],
        _skipped(manifest, plan, subtree, skip, target), _reads(plan, process_of), bytes_per_second,
    )


def read_batch_bytes(options: CheckpointOptions) -> int:
    """A restore's read batch: the ``read_batch_bytes`` setting, at most a quarter of
    ``host_memory_limit`` (two batches in flight, one being assembled, and the pieces
    load_and_broadcast keeps for peers each get a quarter)."""
    limit = options.host_memory_limit
    batch = settings().read_batch_bytes
    return batch if limit is None else min(batch, limit // 4)


def _layout_problems(manifest: Manifest, where: str) -> list[str]:
    """A restore's own manifest check (format 2: the leaves read share no byte)."""
    if not manifest.tables:
        return []
    try:
        check_byte_ranges(manifest, where, loaded_only=True)
    except CorruptCheckpointError as error:
        return [str(error)]
    return []


def _leaf_checks(plan: RestorePlan) -> list[LeafCheck]:
    read, over = _leaf_bytes(plan)
    return [
        LeafCheck(e.key, f"{e.leaf.dtype}{list(e.leaf.shape)} {sharding_text(e.leaf.sharding)}", _restored_text(e),
                  _resharded(e), read.get(i, 0), over.get(i, 0))
        for i, e in enumerate(plan.leaves) if isinstance(e, ArrayRead)
    ]


def _leaf_bytes(plan: RestorePlan) -> tuple[dict[int, int], dict[int, int]]:
    """Per leaf position: the piece bytes its units read, and those beyond its regions."""
    read: dict[int, int] = {}
    over: dict[int, int] = {}
    for batch in plan.batches:
        for unit in batch:
            nbytes = sum(p.length for p in unit.pieces)
            read[unit.position] = read.get(unit.position, 0) + nbytes
            wanted = sum(_slice_bytes(r.slice, unit.array.leaf) for r in unit.regions)
            over[unit.position] = over.get(unit.position, 0) + nbytes - wanted
    return read, over


def _resharded(entry: ArrayRead) -> bool:
    """Whether some region is not exactly one saved piece (it is cut out of pieces)."""
    return any(len(r.pieces) != 1 or (r.slice and r.pieces[0].slice != r.slice) for r in entry.regions)


def _restored_text(entry: ArrayRead) -> str:
    if entry.python_type is not None:
        return f"Python {entry.python_type.__name__}"
    if entry.sharding is None:
        return f"{entry.dtype} numpy"
    sharding = entry.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return f"{entry.dtype} {sharding_text({'type': 'NamedSharding', 'mesh': dict(sharding.mesh.shape), 'spec': spec})}"
    return f"{entry.dtype} {type(sharding).__name__}({len(sharding.device_set)} devices)"


def _unread(manifest: Manifest, plan: RestorePlan, subtree: str | None, target: Any) -> list[str]:
    if target is None:
        return []
    prefix, _ = normalise_subtree(subtree)
    named = {e.key for e in plan.leaves}
    return [leaf.key for leaf in manifest.leaves if under(leaf.key, prefix) and leaf.key not in named]


def _skipped(manifest: Manifest, plan: RestorePlan, subtree: str | None, skip: bool, target: Any) -> list[str]:
    if target is not None:
        return [e.key for e in plan.leaves if isinstance(e, NoRead) and e.skipped_slot]
    prefix, _ = normalise_subtree(subtree)
    return [leaf.key for leaf in manifest.leaves if skip and leaf.is_slot and under(leaf.key, prefix)]


# Per-process reads. A unit: (leaf key, its pieces, the bytes of its regions).
Unit = tuple[str, Sequence[PieceEntry], int]


def _reads(plan: RestorePlan, process_of: Callable[[jax.Device], int] | None) -> dict[int, ProcessReads]:
    """This process's reads from its plan; with several processes, each one's from the
    target shardings' global device maps, batched as the planner batches them."""
    if process_of is None and jax.process_count() == 1:
        units = ([(u.array.key, u.pieces, sum(_slice_bytes(r.slice, u.array.leaf) for r in u.regions)) for u in b] for b in plan.batches)
        return {jax.process_index(): _account(units)}
    process_of = process_of or (lambda d: d.process_index)
    by_process: dict[int, list[Unit]] = {p: [] for p in sorted({process_of(d) for d in jax.devices()})}
    for array in (e for e in plan.leaves if isinstance(e, ArrayRead)):
        for process, slices in _process_regions(array, process_of, list(by_process)).items():
            by_process.setdefault(process, []).extend(_units(array, slices, plan.batch_bytes))
    return {
        p: _account(byte_batches(units, lambda u: sum(x.length for x in u[1]), plan.batch_bytes))
        for p, units in sorted(by_process.items())
    }


def _process_regions(array: ArrayRead, process_of: Callable[[jax.Device], int], processes: Iterable[int]) -> dict[int, list[Any]]:
    """Each process's distinct slices of a leaf; a leaf without sharding is read whole by all."""
    shape = array.leaf.shape
    if array.sharding is None:
        return {p: [full_slice(shape)] for p in processes}
    out: dict[int, dict[Any, None]] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        out.setdefault(process_of(device), {})[index_to_slice(index, shape)] = None
    return {p: list(slices) for p, slices in out.items()}


def _units(array: ArrayRead, slices: list[Any], batch_bytes: int) -> list[Unit]:
    """As ``restore_plan`` groups a leaf: whole, or region by region when bigger than a batch."""
    leaf = array.leaf
    regions = [(s, overlapping(leaf, s)) for s in slices]
    if leaf.nbytes <= batch_bytes or len(regions) == 1:
        pieces = {(p.file, p.offset): p for _, found in regions for p in found}
        return [(array.key, list(pieces.values()), sum(_slice_bytes(s, leaf) for s, _ in regions))]
    return [(array.key, found, _slice_bytes(s, leaf)) for s, found in regions]


def _account(batches: Iterable[Iterable[Unit]]) -> ProcessReads:
    """Bytes and requests of read batches, each coalesced as ``StoreReads`` issues it."""
    nbytes = requests = wanted = 0
    for batch in batches:
        needed: list[tuple[str, PieceEntry]] = []
        for key, pieces, region_bytes in batch:
            needed.extend((key, p) for p in pieces)
            wanted += region_bytes
        reads = coalesce(needed)
        requests += len(reads)
        nbytes += sum(p.length for r in reads for _, p in r.pieces)
    return ProcessReads(nbytes, requests, nbytes - wanted)


def _slice_bytes(spec: Any, leaf: LeafEntry) -> int:
    return math.prod(extent(spec)) * dtype_from_name(leaf.dtype).itemsize
