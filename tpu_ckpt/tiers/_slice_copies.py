"""Slices, as the local tier sees them: a multi-host TPU slice is recovered or recreated as a
unit, so a copy kept inside one slice is lost with it, and state that every slice already
holds in its own HBM (data parallelism across slices) needs no copy over DCN at all.

Where every array of the tree has every block on some device of every slice, each slice
writes a whole copy into its own hosts' local tier (``copy_group``: the processes that share
the writing, ``sharding.LocalPieces``), and those copies are the replicas: no TCP copy. A
restore then needs the parts of one slice's processes (``tiers/_restore.py``). Otherwise the
job writes each block once and sends replicas over TCP, to another slice first
(``replica_roles``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import jax

from tpu_ckpt.format import PerProcess
from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)


def job_slices(count: int) -> tuple[int | None, ...]:
    """Each process's slice: a TPU's ``slice_index``, else the ``TPU_CKPT_SLICES`` setting (a
    job whose devices tell no TPU slices apart: JAX's CPU devices all say slice 0), else None."""
    devices = jax.devices()
    slice_of = {d.process_index: getattr(d, "slice_index", None) for d in devices}
    found = tuple(slice_of.get(p) for p in range(count))
    configured = settings().slices
    tpu = any(d.platform == "tpu" for d in devices) and any(s is not None for s in found)
    if not tpu and configured is not None:
        if len(configured) != count:
            raise ValueError(
                f"TPU_CKPT_SLICES gives {len(configured)} processes' slices, but the job has {count} processes"
            )
        return configured
    return found


def warn_if_one_slice(count: int, replicas: int) -> None:
    """The construction-time warning that replicas kept inside one slice share its fate."""
    slices = set(job_slices(count))
    if count > 1 and replicas > 0 and len(slices - {None}) <= 1:
        logger.warning(
            "tpu_ckpt: this job runs on one slice, so the local tier's replicas (local_replicas=%d) live on "
            "hosts of the same slice and do not survive a slice restart (a TPU slice is recovered or recreated "
            "whole): after one, the restore falls back to the persistent directory.", replicas,
        )


def copy_group(tree: Any, me: int, slices: Sequence[int | None]) -> frozenset[int] | None:
    """The processes of ``me``'s slice when every slice holds the whole of ``tree`` (then
    each slice writes its own copy), else None. The same answer on every process: it reads
    only the global shardings."""
    if any(s is None for s in slices) or len(set(slices)) < 2:
        return None
    count = len(set(slices))
    seen = set()
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, PerProcess):
            return None  # a process's own value is in no other slice's copy: its part is replicated
        if not isinstance(leaf, jax.Array):
            continue  # a host value: the first process of each group writes it
        layout = (leaf.sharding, tuple(leaf.shape))
        if layout in seen:
            continue
        seen.add(layout)
        if not _in_every_slice(leaf.sharding, tuple(leaf.shape), slices, count):
            return None
    return frozenset(p for p, s in enumerate(slices) if s == slices[me])


def _in_every_slice(sharding: Any, shape: tuple[int, ...], slices: Sequence[int | None], count: int) -> bool:
    """Whether each of the ``count`` slices holds every block of an array so sharded."""
    held: dict[int | None, set[tuple[tuple[int, int], ...]]] = collections.defaultdict(set)
    for device, index in sharding.devices_indices_map(shape).items():
        held[slices[device.process_index]].add(tuple(s.indices(n)[:2] for s, n in zip(index, shape)))
    blocks = set().union(*held.values())
    return len(held) == count and all(regions == blocks for regions in held.values())
