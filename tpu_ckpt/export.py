"""export_for_serving(): a params-only checkpoint from a training checkpoint.

Copying mode restores the chosen subtree (slots are never read), optionally casts floats
(e.g. to bfloat16) and saves it with any sharding policy. Link mode copies no data at all:
it writes a manifest whose pieces point at the source checkpoint's data files, recording
the source manifest's crc32c so a restore can tell when the source is gone or changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpu_ckpt import keys, storage
from tpu_ckpt.errors import CheckpointExistsError, TargetMismatchError
from tpu_ckpt.format import MANIFEST_FILE, Manifest, crc32c
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.policies import MaxShardSizePolicy
from tpu_ckpt.restore import read_manifest, restore
from tpu_ckpt.save import save

logger = logging.getLogger(__name__)


def export_for_serving(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    subtree: str = "params",
    dtype: Any = None,
    max_shard_size: int | None = None,
    link: bool = False,
) -> str:
    """Writes the ``subtree`` of checkpoint ``src`` (its params) as checkpoint ``dst``.

    ``tc.restore(dst)`` then returns that subtree as the whole tree. ``dtype`` casts float
    leaves; ``max_shard_size`` re-cuts the data files (``MaxShardSizePolicy``); ``link``
    writes only a manifest referring to ``src``'s data files (local paths only, and not
    combinable with ``dtype`` or ``max_shard_size``, which need a rewrite). Returns ``dst``.
    """
    if link:
        if dtype is not None or max_shard_size is not None:
            raise ValueError(
                "link=True reuses the source's data files as they are, so it cannot also change "
                "the dtype or the shard size; drop --link, or drop --dtype/--max-shard-size."
            )
        return _link(storage.location(src), storage.location(dst), subtree)
    params = restore(src, subtree=subtree, options=CheckpointOptions(skip_slot_variables=True))
    if dtype is not None:
        target = np.dtype(dtype)
        if not jnp.issubdtype(target, jnp.floating):
            raise ValueError(f"dtype must be a float type (e.g. bfloat16), got {target}")
        params = jax.tree_util.tree_map(lambda x: _cast_float(x, target), params)
    policy = MaxShardSizePolicy(max_shard_size) if max_shard_size is not None else None
    return save(dst, params, options=CheckpointOptions(sharding_callback=policy)).wait()


def _cast_float(leaf: Any, dtype: np.dtype) -> Any:
    if isinstance(leaf, np.ndarray) and jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf.astype(dtype)
    return leaf


def _link(src: storage.Location, dst: storage.Location, subtree: str) -> str:
    if not (src.is_local and dst.is_local):
        raise ValueError("link=True works between local directories only")
    manifest = read_manifest(src)
    prefix = subtree.strip("/")
    depth = len(prefix.split("/")) if prefix else 0
    leaves = [leaf for leaf in manifest.leaves if keys.under(leaf.key, prefix)]
    if not leaves:
        raise TargetMismatchError(f"subtree {prefix!r} is not in checkpoint {src.url}", key=prefix, file=src.url)
    if not storage.is_empty(dst):
        raise CheckpointExistsError(f"{dst.url} already exists and is not empty; choose a new path", file=dst.url)
    relative = os.path.relpath(os.path.abspath(src.local_path), os.path.dirname(os.path.abspath(dst.local_path)))
    source_dir = os.path.join("..", relative)  # files are resolved from inside dst
    renamed = {name: os.path.join(source_dir, name) for name in manifest.files}
    linked = [
        dataclasses.replace(
            leaf,
            key=keys.join(leaf.path[depth:]),
            path=leaf.path[depth:],
            pieces=tuple(dataclasses.replace(p, file=renamed[p.file]) for p in leaf.pieces),
        )
        for leaf in leaves
    ]
    used = {p.file for leaf in linked for p in leaf.pieces}
    with storage.Store(src, threads=1) as store:
        source_crc = crc32c(store.read_file(MANIFEST_FILE) or b"")
    doc = Manifest(
        tuple(linked),
        {renamed[name]: size for name, size in manifest.files.items() if renamed[name] in used},
        manifest.process_count,
        manifest.sharding_callback,
        source={"path": source_dir, "manifest_crc32c": source_crc},
    )
    staging = dst.staging(uuid.uuid4().hex[:12])
    with storage.Store(staging) as store:
        store.write(MANIFEST_FILE, [doc.to_json()]).result()
    storage.commit(staging, dst)
    logger.info("tpu_ckpt: linked %s to %s (%d leaves, no data copied)", dst.url, src.url, len(linked))
    return dst.url
