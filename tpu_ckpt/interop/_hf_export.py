"""export_for_serving(layout="huggingface"): a checkpoint's params as the files a serving
stack reads, written from every process with no consolidation pass.

Every process plans the same export from the manifest (tensor names, ``_hf_layout``'s
shard files) and takes the files given to it (balanced by bytes); it writes each file a
block of rows at a time (``storage.FileWriter``: at offsets, on a local disk), reading only
the pieces the block overlaps (``restoring.read_block``), so a tensor bigger than
``host_memory_limit`` is never whole in memory. When every process has written its files,
process 0 writes the index, the commit: a reader that finds it finds every file complete.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from tpu_ckpt import cluster, storage
from tpu_ckpt.catalog import OpenCheckpoint, open_checkpoint
from tpu_ckpt.errors import CheckpointExistsError
from tpu_ckpt.format import LeafEntry, dtype_from_name, dtype_name, full_slice, join, normalise_subtree, under
from tpu_ckpt.interop import _hf_layout as layout
from tpu_ckpt.interop._hf_names import Named, Names, resolve
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import missing_subtree, read_block
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

Progress = Callable[[int, int], None] | None


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
    with open_checkpoint(src) as checkpoint, cluster.Coordinator(f"export {final.url}", options.coordination_timeout) as coord:
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
            for i in mine:
                _write_file(checkpoint, final, files[i], [by_name[t.name] for t in shards[i]], block_bytes, progress)
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
    """The source bytes of one block: a quarter of ``host_memory_limit`` (the block, its
    transposed and its cast copy fit in it), else the read batch."""
    limit = options.host_memory_limit
    return settings().read_batch_bytes if limit is None else max(limit // 4, 1)


def _write_file(
    checkpoint: OpenCheckpoint, final: storage.Location, name: str, outputs: Sequence[Output], block_bytes: int,
    progress: Progress,
) -> None:
    header, offsets = layout.encode_header([o.tensor for o in outputs])
    total, done = sum(o.tensor.nbytes for o in outputs), 0
    with storage.FileWriter(final, name) as writer:
        writer.write_at(0, [header])
        for output, offset in zip(outputs, offsets):
            for at, block in _blocks(checkpoint, output, block_bytes):
                writer.write_at(offset + at, [block])
                done += block.nbytes
                if progress is not None:
                    progress(done, total)


def _blocks(checkpoint: OpenCheckpoint, output: Output, block_bytes: int) -> Any:
    """``(byte offset in the tensor, bytes)`` of an output tensor, a block of its rows at a time."""
    shape, leaf = output.tensor.shape, output.leaf
    if not shape or 0 in shape:
        yield 0, _stored(read_block(checkpoint, leaf, full_slice(leaf.shape)), output)
        return
    row_items = math.prod(shape[1:])
    rows = max(1, block_bytes // max(1, row_items * dtype_from_name(leaf.dtype).itemsize))
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])
        block = list(full_slice(leaf.shape))
        block[-1 if output.named.transpose else 0] = (start, stop)
        data = read_block(checkpoint, leaf, tuple(block))
        yield start * row_items * dtype_from_name(output.tensor.dtype).itemsize, _stored(data, output)


def _stored(data: np.ndarray, output: Output) -> np.ndarray:
    """A block's bytes as the file stores them: axes reversed if asked, cast, row-major."""
    if output.named.transpose:
        data = data.transpose()
    return np.ascontiguousarray(data, dtype=dtype_from_name(output.tensor.dtype)).reshape(-1).view(np.uint8)
