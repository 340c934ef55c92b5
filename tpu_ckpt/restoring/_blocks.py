"""One block of one saved leaf, read onto the host: what an export that writes a tensor a
slice at a time reads (``interop/_hf_export.py``), through the restore's own plan and
executor, so a block is read, checked and assembled exactly as a restore would."""

from __future__ import annotations

import numpy as np

from tpu_ckpt.catalog import OpenCheckpoint
from tpu_ckpt.format import LeafEntry, SliceSpec, check_byte_ranges, dtype_from_name, loaded_overlapping
from tpu_ckpt.restoring import _exec as restore_exec
from tpu_ckpt.restoring import _shared_reads as shared_reads
from tpu_ckpt.restoring._plan import ArrayRead, Region, RestorePlan, Unit


def read_block(checkpoint: OpenCheckpoint, leaf: LeafEntry, block: SliceSpec) -> np.ndarray:
    """The global slice ``block`` of array leaf ``leaf``, as saved, in a host array (only
    the pieces it overlaps are read, each checked against its crc32c)."""
    checkpoint.load([(leaf, [block])])
    if checkpoint.manifest.tables:  # format 2: the pieces loaded share no byte (as restore_from checks)
        check_byte_ranges(checkpoint.manifest, checkpoint.where, loaded_only=True)
    pieces = tuple(loaded_overlapping(leaf, block))
    array = ArrayRead(leaf.key, leaf, dtype_from_name(leaf.dtype), None, None, (Region(block, (), pieces),))
    plan = RestorePlan((array,), ((Unit(0, array, array.regions, True, pieces),),), None, (tuple(leaf.path),))
    results, _ = restore_exec.execute(plan, shared_reads.StoreReads(checkpoint.store))
    return results[0]
