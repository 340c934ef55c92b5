"""check_restore(): what a restore would do, from the manifest and piece tables alone.

A restore that fails after an hour of queueing for a pod, on a key renamed in the model, or
that reads three times the checkpoint because the new mesh cuts every piece, is better found
on a workstation first. The check runs the restore's own planner (``restoring/_plan.py``) leaf
by leaf, so every mismatch it reports is one ``tc.restore`` raises on; the bytes and requests
it counts are the planner's read batches, coalesced as ``shared_reads.StoreReads`` issues
them, counted once per layout and in numpy over the rows (``_check_reads.py``): a pod's
million pieces in about a second. Nothing is read from the data files and no device memory
is allocated (a target of ``jax.ShapeDtypeStruct`` describes devices without using them).

Per process: a single process reports itself. In a multi-process job (or with
``devices_per_process``, which models one from a single machine) each process's regions
come from the target shardings' global device maps, as ``load_and_broadcast`` plans them;
with ``io_device`` or ``load_and_broadcast`` storage reads are then moved between processes,
which the report does not model: it says what each process's devices need.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.errors import CorruptCheckpointError, TargetMismatchError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    Manifest,
    check_byte_ranges,
    dtype_from_name,
    normalise_subtree,
    piece_columns,
    sharding_text,
    under,
)
from tpu_ckpt.options import CheckpointOptions, checked_options
from tpu_ckpt.restoring import _leaf_kinds as leaf_kinds
from tpu_ckpt.restoring._check_reads import ReadCount
from tpu_ckpt.restoring._mismatch import mismatches
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, needed_slices, plan_entries
from tpu_ckpt.runtime import plural, size, table
from tpu_ckpt.settings import settings

BYTES_PER_SECOND = 1e9  # one host's read throughput, for the time estimate: about a GCS bucket's
WIDTH = 100  # describe()'s lines fit a terminal this wide (`tpu-ckpt plan`)


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
        doc["reads"] = {
            str(p): {**dataclasses.asdict(r), "seconds": r.nbytes / self.bytes_per_second}
            for p, r in self.reads.items()
        }
        return doc

    def describe(self) -> str:
        """The verdict and problems, a table of the arrays read (each with its saved and restored
        form on the line below), what is cast, skipped or left unread, and a table of each
        process's reads (the command line's tables), in lines of at most ``WIDTH`` columns
        (but for the first, which names the checkpoint, and a key or sharding longer than that)."""
        verdict = "ok" if self.ok else f"would fail ({plural(len(self.problems), 'problem')})"
        lines = [f"restore of {self.url}: {verdict}", *(_fill(p, "  ") for p in self.problems)]
        if self.leaves:
            rows = [
                [x.key, "resharded" if x.resharded else "as saved", size(x.read_bytes), size(x.over_read)]
                for x in self.leaves
            ]
            header = ["KEY, SAVED -> RESTORED AS", "LAYOUT", "READ", "OVER-READ"]
            title_row, *keyed = table([header, *rows], right={2, 3}).split("\n")
            lines += ["", title_row]
            for line, x in zip(keyed, self.leaves):
                lines += [line, _fill(f"{x.saved} -> {x.restored}", "  ")]
        for title, names in (
            ("cast (float -> float)", self.casts), ("skipped slot variables, not read", self.skipped_slots),
            ("in the checkpoint, not in the target, not read", self.unread_keys),
        ):
            if names:
                lines.append(_fill(f"{title}: {', '.join(names)}", ""))
        if self.reads:
            rows = [
                [str(p), size(r.nbytes), str(r.requests), size(r.over_read), f"{r.nbytes / self.bytes_per_second:.2f}s"]
                for p, r in self.reads.items()
            ]
            header = ["PROCESS", "READ", "REQUESTS", "OVER-READ", f"TIME AT {size(self.bytes_per_second)}/s"]
            lines += ["", table([header, *rows], right={0, 1, 2, 3, 4})]
        return "\n".join(lines)


def _fill(text: str, indent: str) -> str:
    """``text`` from ``indent`` on, in lines of at most WIDTH columns, the next ones indented
    two more; a word (a key) is never cut."""
    return textwrap.fill(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
        break_long_words=False, break_on_hyphens=False,
    )

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
      devices_per_process: plans as if device ``d`` were process ``d.id // devices_per_process`` (a pod, here).

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
        raise ValueError(f"bytes_per_second and devices_per_process must be positive, got {bytes_per_second}, "
                         f"{devices_per_process}")
    options, loc = checked_options(options, "check_restore"), storage.location(path)
    skip = options.skip_slot_variables
    with open_checkpoint(loc) as checkpoint:  # per process, or (a report of several) every process's rows
        manifest, refused = leaf_kinds.unread_per_process(checkpoint.manifest, target, subtree, loc.url)
        try:
            target = leaf_kinds.stored_target(manifest, target, subtree)
        except TargetMismatchError as other_impls:
            return RestoreReport(loc.url, False, [str(other_impls)], [], [], [], [], {}, bytes_per_second)
        everyone = devices_per_process is not None or jax.process_count() > 1
        checkpoint.load(needed_slices(manifest, target, subtree, skip, everyone=everyone))
        try:
            entries, _, _ = plan_entries(manifest, target, subtree, skip, loc.url, regions=False)
        except TargetMismatchError as first:
            problems = [str(e) for e in mismatches(manifest, target, subtree, skip, loc.url)] or [str(first)]
            return RestoreReport(loc.url, False, problems, [], [], [], [], {}, bytes_per_second)
        arrays = [e for e in entries if isinstance(e, ArrayRead)]
        checkpoint.load_all([a.leaf for a in arrays])  # loaded whole already, as every device's regions cover a leaf
        _check_references(checkpoint.store, arrays)
    count = ReadCount(manifest, arrays, read_batch_bytes(options))
    problems = refused + _layout_problems(manifest, loc.child(MANIFEST_FILE), count)
    return RestoreReport(
        loc.url, not problems, problems, _leaf_checks(arrays, count), _unread(manifest, entries, subtree, target),
        [f"{a.key}: {a.leaf.dtype} -> {a.dtype}" for a in arrays if dtype_from_name(a.leaf.dtype) != a.dtype],
        _skipped(manifest, entries, subtree, skip, target), _reads(arrays, count, devices_per_process),
        bytes_per_second,
    )


def _check_references(store: Any, arrays: Sequence[ArrayRead]) -> None:
    """The other steps' objects the restore would read (an incremental checkpoint's), checked
    as its first read of each would check it: an object store checks them then, not when the
    checkpoint is opened, as a local one does (``ObjectStore.check_before_reading``)."""
    if not isinstance(store, storage.ObjectStore):
        return
    referenced: set[str] = set()
    for names, files, _, _ in (piece_columns(a.leaf) for a in arrays):
        referenced.update(name for name in (names[i] for i in np.unique(files)) if name.startswith("../"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # each check is a few requests, one after another
        list(pool.map(store.check_unread, sorted(referenced)))


def read_batch_bytes(options: CheckpointOptions) -> int:
    """A restore's read batch: the ``read_batch_bytes`` setting, at most a quarter of
    ``host_memory_limit`` (two batches in flight, one being assembled, and the pieces
    load_and_broadcast keeps for peers each get a quarter)."""
    limit = options.host_memory_limit
    batch = settings().read_batch_bytes
    return batch if limit is None else min(batch, limit // 4)


def _layout_problems(manifest: Manifest, where: str, count: ReadCount) -> list[str]:
    """A restore's own manifest check (format 2: the leaves read share no byte), in numpy;
    its error, naming the piece, only when there is one."""
    if not manifest.tables or not count.clash():
        return []
    try:
        check_byte_ranges(manifest, where, loaded_only=True)
    except CorruptCheckpointError as error:
        return [str(error)]
    return []


def _leaf_checks(arrays: Sequence[ArrayRead], count: ReadCount) -> list[LeafCheck]:
    checks = []
    restored: dict[Any, str] = {}  # the leaves of one target sharding share its text
    for e in arrays:
        reads = count.own(e)
        saved = f"{e.leaf.dtype}{list(e.leaf.shape)} {sharding_text(e.leaf.sharding)}"
        form = (e.python_type, e.dtype, e.sharding)
        if form not in restored:
            restored[form] = _restored_text(e)
        checks.append(LeafCheck(e.key, saved, restored[form], reads.resharded, reads.read, reads.over_read))
    return checks


def _restored_text(entry: ArrayRead) -> str:
    if entry.python_type is not None:
        return f"Python {entry.python_type.__name__}"
    if entry.sharding is None:
        return f"{entry.dtype} numpy"
    sharding = entry.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        described = {"type": "NamedSharding", "mesh": dict(sharding.mesh.shape), "spec": spec}
        return f"{entry.dtype} {sharding_text(described)}"
    return f"{entry.dtype} {type(sharding).__name__}({len(sharding.device_set)} devices)"


def _unread(manifest: Manifest, entries: Sequence[ArrayRead | NoRead], subtree: str | None, target: Any) -> list[str]:
    if target is None:
        return []
    prefix, _ = normalise_subtree(subtree)
    named = {e.key for e in entries}
    return [leaf.key for leaf in manifest.leaves if under(leaf.key, prefix) and leaf.key not in named]


def _skipped(
    manifest: Manifest, entries: Sequence[ArrayRead | NoRead], subtree: str | None, skip: bool, target: Any
) -> list[str]:
    if target is not None:
        return [e.key for e in entries if isinstance(e, NoRead) and e.skipped_slot]
    prefix, _ = normalise_subtree(subtree)
    return [leaf.key for leaf in manifest.leaves if skip and leaf.is_slot and under(leaf.key, prefix)]


def _reads(arrays: Sequence[ArrayRead], count: ReadCount, devices_per_process: int | None) -> dict[int, ProcessReads]:
    """This process's reads from its plan; with several processes (or ``devices_per_process``
    given: device ``d`` counted as process ``d.id // devices_per_process``), each one's from
    the target shardings' global device maps, batched as the planner batches them."""
    if devices_per_process is None and jax.process_count() == 1:
        return {jax.process_index(): _process_reads(count, [u for a in arrays for u in count.units(a, count.own(a))])}
    process_of: Callable[[jax.Device], int] = (
        (lambda d: d.process_index) if devices_per_process is None else (lambda d: d.id // devices_per_process)
    )
    by_process: dict[int, list[Any]] = {p: [] for p in sorted({process_of(d) for d in jax.devices()})}
    processes = list(by_process)
    for array in arrays:
        for process, reads in count.by_process(array, process_of, processes).items():
            by_process.setdefault(process, []).extend(count.units(array, reads))
    return {p: _process_reads(count, units) for p, units in sorted(by_process.items())}


def _process_reads(count: ReadCount, units: Sequence[Any]) -> ProcessReads:
    nbytes, requests, wanted = count.account(units)
    return ProcessReads(nbytes, requests, nbytes - wanted)
