"""export_for_serving(layout="huggingface"): a checkpoint's params as the files a serving
stack reads, written from every process with no consolidation pass.

Every process plans the same export from the manifest (tensor names, ``_hf_layout``'s shard files) and takes the files
given to it (balanced by bytes). It reads each piece of their tensors from the checkpoint once, a block of its rows at a
time, checking the piece's crc32c across its blocks, and writes each block where it lies in the file, as the row-major
runs of bytes it covers there (``storage.FileWriter``: at offsets, on a local disk), so a tensor, or a piece, bigger
than ``host_memory_limit`` is never whole in memory. When every process has written its files, process 0 writes the
index, the commit: a reader that finds it finds every file complete.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c as _crc32c
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import cluster, storage
from tpu_ckpt.catalog import OpenCheckpoint, open_checkpoint
from tpu_ckpt.errors import CheckpointExistsError, CorruptCheckpointError
from tpu_ckpt.format import (
    LeafEntry,
    PieceEntry,
    SliceSpec,
    check_byte_ranges,
    crc32c,
    dtype_from_name,
    dtype_name,
    extent,
    full_slice,
    intersect,
    join,
    loaded_overlapping,
    normalise_subtree,
    relative,
    under,
    volume,
)
from tpu_ckpt.interop import _hf_layout as layout
from tpu_ckpt.interop._hf_names import Named, Names, resolve
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import missing_subtree
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None] | None
READ_AHEAD = 2  # blocks whose reads are in flight while one is built and the one before written
BLOCK_BYTES = 32 << 20  # a block of rows with no host_memory_limit: the next one's reads overlap this one's write


@dataclasses.dataclass(frozen=True)
class Output:
    """One tensor of the export: the leaf it comes from and how it is stored."""

    leaf: LeafEntry
    named: Named
    tensor: layout.Tensor


def export_huggingface(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], subtree: str, cast: np.dtype | None, names: Names,
    max_shard_size: int | str | None, options: CheckpointOptions, progress: Progress,
) -> str:
    """See ``export_for_serving``; returns ``dst``'s URL."""
    final = storage.location(dst)
    max_size = layout.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else layout.parse_size(max_shard_size)
    with (
        open_checkpoint(src) as checkpoint,
        cluster.Coordinator(f"export {final.url}", options.coordination_timeout) as coord,
    ):
        try:
            outputs = plan_outputs(checkpoint, subtree, cast, names)
            shards = layout.split_shards([o.tensor for o in outputs], max_size)
            files = layout.file_names(len(shards))
            if coord.me == 0:
                _prepare(final)
            coord.barrier("directory")
            by_name = {o.tensor.name: o for o in outputs}
            mine = [i for i, owner in enumerate(owners(shards, coord.count)) if owner == coord.me]
            block_bytes = _block_bytes(options)
            bounce_bytes = None if options.host_memory_limit is None else block_bytes  # the writes' bounce buffers
            for i in mine:
                outs = [by_name[t.name] for t in shards[i]]
                _write_file(checkpoint, final, files[i], outs, (block_bytes, bounce_bytes), progress)
            coord.barrier("written")
            if coord.me == 0 and len(files) > 1:
                weight_map = {t.name: files[i] for i, shard in enumerate(shards) for t in shard}
                with storage.FileWriter(final, layout.INDEX_FILE) as index:
                    index.write_at(0, [layout.encode_index(weight_map, sum(o.tensor.nbytes for o in outputs))])
            coord.barrier("committed")
        except BaseException as error:
            coord.report_failure(error)
            raise
    logger.info("tpu_ckpt: exported %d tensors in %d files to %s", len(outputs), len(files), final.url)
    return final.url


def plan_outputs(checkpoint: OpenCheckpoint, subtree: str, cast: np.dtype | None, names: Names) -> list[Output]:
    """The exported tensors, in the checkpoint's leaf order; leaves that are Python values
    (not arrays) are left out."""
    prefix, depth = normalise_subtree(subtree)
    leaves = [leaf for leaf in checkpoint.manifest.leaves if under(leaf.key, prefix)]
    if not leaves:
        raise missing_subtree(checkpoint.manifest, prefix, checkpoint.where)
    arrays = [leaf for leaf in leaves if leaf.kind == "array"]
    found = resolve(names, [(leaf.key, ".".join(join(leaf.path[depth:]).split("/"))) for leaf in arrays])
    outputs = []
    for leaf, named in zip(arrays, found):
        if named is None:
            continue
        saved = dtype_from_name(leaf.dtype)
        dtype = cast if cast is not None and jnp.issubdtype(saved, jnp.floating) else saved
        shape = tuple(reversed(leaf.shape)) if named.transpose else tuple(leaf.shape)
        outputs.append(Output(leaf, named, layout.Tensor(named.name, dtype_name(dtype), shape)))
    return outputs


def owners(shards: Sequence[Sequence[layout.Tensor]], count: int) -> list[int]:
    """The process that writes each file: the biggest first, each to the least loaded."""
    load = [0] * count
    owner = [0] * len(shards)
    for i in sorted(range(len(shards)), key=lambda i: -sum(t.nbytes for t in shards[i])):
        owner[i] = min(range(count), key=lambda p: (load[p], p))
        load[owner[i]] += sum(t.nbytes for t in shards[i])
    return owner


def _prepare(final: storage.Location) -> None:
    if not storage.is_empty(final):
        raise CheckpointExistsError(f"{final.url} already exists and is not empty; choose a new path", file=final.url)
    storage.ensure_directory(final)


def _block_bytes(options: CheckpointOptions) -> int:
    """The bytes of one block of rows: an eighth of ``host_memory_limit`` (the block being
    assembled and its reads, the next ``READ_AHEAD`` blocks' reads, the one before being
    written and its transposed or cast copy fit in it, beside the write's bounce buffer),
    else ``BLOCK_BYTES`` (at most the read batch)."""
    limit = options.host_memory_limit
    return min(BLOCK_BYTES, settings().read_batch_bytes) if limit is None else max(limit // 8, 1)


def _write_file(
    checkpoint: OpenCheckpoint, final: storage.Location, name: str, outputs: Sequence[Output],
    sizes: tuple[int, int | None], progress: Progress,
) -> None:
    """File ``name``: its blocks (``sizes[0]`` bytes) built here, each written on a thread
    while the next is built; ``sizes[1]``: the bytes its direct writes' bounce buffers may hold."""
    block_bytes, bounce_bytes = sizes
    header, offsets = layout.encode_header([o.tensor for o in outputs])
    total, done = sum(o.tensor.nbytes for o in outputs), 0
    writing: concurrent.futures.Future | None = None
    with storage.FileWriter(final, name, len(header) + total, bounce_bytes) as writer, ThreadPoolExecutor(1) as thread:
        writer.write_at(0, [header])
        for k, spec, data in _blocks(checkpoint, [o.leaf for o in outputs], block_bytes):
            if writing is not None:
                writing.result()  # before the next block is built where this one was
            writing = thread.submit(_write_block, writer, offsets[k], outputs[k], spec, data)
            done += data.nbytes
            if progress is not None:
                progress(done, total)
        if writing is not None:
            writing.result()


Step = tuple[int, LeafEntry, list[PieceEntry], SliceSpec]  # a block: its leaf's index, the leaf, its pieces, its slice


def _blocks(
    checkpoint: OpenCheckpoint, leaves: Sequence[LeafEntry], block_bytes: int
) -> Iterator[tuple[int, SliceSpec, np.ndarray]]:
    """The leaves as blocks of whole rows, ``(leaf index, global slice, array)``, each assembled from the rows of the
    pieces it overlaps; every piece is read once, in row order, the next ``READ_AHEAD`` blocks' reads (of the next
    leaves, after a leaf's last) in flight while this one is built and the one before written. A piece's crc32c is
    checked across its blocks, at its last row; a mismatch fails the export before its file is committed."""
    checkpoint.load([(leaf, [full_slice(leaf.shape)]) for leaf in leaves])
    if checkpoint.manifest.tables:  # format 2: the pieces loaded share no byte (as a restore checks)
        check_byte_ranges(checkpoint.manifest, checkpoint.where, loaded_only=True)
    steps = [step for k, leaf in enumerate(leaves) for step in _steps(checkpoint, k, leaf, block_bytes)]
    scratch = _Scratch(max((volume(s[3]) * dtype_from_name(s[1].dtype).itemsize for s in steps), default=0))
    crcs: dict[PieceEntry, int] = {}
    pending = collections.deque(_start_reads(checkpoint, *step[1:]) for step in steps[:READ_AHEAD])
    for i, (k, leaf, _, span) in enumerate(steps):
        if i + READ_AHEAD < len(steps):
            pending.append(_start_reads(checkpoint, *steps[i + READ_AHEAD][1:]))
        current = pending.popleft()
        yield k, span, _assemble(checkpoint, leaf, current, span, dtype_from_name(leaf.dtype), crcs, scratch)


def _steps(checkpoint: OpenCheckpoint, k: int, leaf: LeafEntry, block_bytes: int) -> list[Step]:
    """A leaf's blocks of about ``block_bytes`` (whole rows, one row at least), with its pieces."""
    whole, dtype = full_slice(leaf.shape), dtype_from_name(leaf.dtype)
    pieces = [p for p in loaded_overlapping(leaf, whole) if p.length or volume(p.slice)]
    for piece in pieces:
        if volume(piece.slice) * dtype.itemsize != piece.length:
            raise _corrupt(checkpoint, leaf, piece, f"holds {piece.length} bytes, not {extent(piece.slice)} of {dtype}")
    if not pieces:
        return []
    if not leaf.shape:  # a scalar: one piece, one block
        return [(k, leaf, pieces, ())]
    rows = max(1, block_bytes // max(1, volume(whole[1:]) * dtype.itemsize))
    return [(k, leaf, pieces, ((r, min(r + rows, leaf.shape[0])), *whole[1:])) for r in range(0, leaf.shape[0], rows)]


class _Scratch:
    """The two buffers the assembled blocks of an export are built in, in turn (one being
    written while the next is built), each made at the largest block's size when first
    needed: fresh pages for each block would cost their first touch each time
    (``storage/_direct_writes.py``)."""

    def __init__(self, nbytes: int):
        self.nbytes, self._turn = nbytes, 0
        self._buffers: list[np.ndarray | None] = [None, None]

    def take(self, span: SliceSpec, dtype: np.dtype) -> np.ndarray:
        self._turn ^= 1
        buffer = self._buffers[self._turn]
        if buffer is None:
            buffer = self._buffers[self._turn] = storage.aligned_empty(self.nbytes)
        return buffer[: volume(span) * dtype.itemsize].view(dtype).reshape(extent(span))


def _assemble(
    checkpoint: OpenCheckpoint, leaf: LeafEntry, reads: list[tuple[PieceEntry, SliceSpec, concurrent.futures.Future]],
    span: SliceSpec, dtype: np.dtype, crcs: dict[PieceEntry, int], scratch: _Scratch,
) -> np.ndarray:
    """A block from its pieces' reads, each let go of once copied. A piece read whole was
    checked in the IO thread; one read in parts adds each to its running crc32c, checked at
    its last row. A block that is one read is that read's bytes, not copied."""
    if len(reads) == 1 and reads[0][1] == span and reads[0][1] == reads[0][0].slice:
        return reads.pop()[2].result()[0].view(dtype).reshape(extent(span))
    block = scratch.take(span, dtype)
    while reads:
        piece, part, future = reads.pop()
        (chunk,) = future.result()
        block[relative(part, span)] = chunk.view(dtype).reshape(extent(part))
        if part == piece.slice:
            continue
        crcs[piece] = _crc32c.crc32c(chunk, crcs.get(piece, 0))
        if part[0][1] == piece.slice[0][1] and crcs[piece] != piece.crc32c:
            raise _corrupt(checkpoint, leaf, piece, "does not match its crc32c")
    return block


def _start_reads(
    checkpoint: OpenCheckpoint, leaf: LeafEntry, pieces: Sequence[PieceEntry], span: SliceSpec
) -> list[tuple[PieceEntry, SliceSpec, concurrent.futures.Future]]:
    """Starts reading the rows of each piece inside the block ``span`` (whole rows of the
    leaf): a contiguous range of the piece's bytes; a piece read whole is checked against
    its crc32c in the IO thread, in parallel with the others."""
    reads = []
    for piece in pieces:
        part = intersect(piece.slice, span) if span else ()
        if part is None:
            continue
        first = piece.slice[0][0] if span else 0
        row = piece.length // max(1, extent(piece.slice)[0]) if span else piece.length
        start, stop = (part[0][0] - first, part[0][1] - first) if span else (0, 1)
        check = functools.partial(_check_whole, checkpoint, leaf, piece) if part == piece.slice else None
        read = checkpoint.store.read(piece.file, piece.offset + start * row, [(stop - start) * row], check)
        reads.append((piece, part, read))
    return reads


def _check_whole(checkpoint: OpenCheckpoint, leaf: LeafEntry, piece: PieceEntry, chunks: list[np.ndarray]) -> None:
    if crc32c(chunks[0]) != piece.crc32c:
        raise _corrupt(checkpoint, leaf, piece, "does not match its crc32c")


def _corrupt(checkpoint: OpenCheckpoint, leaf: LeafEntry, piece: PieceEntry, what: str) -> CorruptCheckpointError:
    where = checkpoint.location.child(piece.file)
    return CorruptCheckpointError(
        f"key {leaf.key!r} slice {list(piece.slice)} in {where} {what}: the checkpoint is corrupt; export another",
        key=leaf.key, file=where,
    )


def _write_block(writer: storage.FileWriter, offset: int, output: Output, spec: SliceSpec, data: np.ndarray) -> None:
    """A block at its place in the tensor: axes reversed if asked, cast, as the row-major
    runs of bytes its slice of the tensor is made of."""
    if output.named.transpose:
        spec, data = tuple(reversed(spec)), data.transpose()
    dtype = dtype_from_name(output.tensor.dtype)
    flat = np.ascontiguousarray(data, dtype=dtype).reshape(-1).view(np.uint8)
    at = 0
    for start, length in layout.runs_of(output.tensor.shape, dtype.itemsize, spec):
        writer.write_at(offset + start, [flat[at : at + length]])
        at += length
