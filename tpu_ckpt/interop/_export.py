"""export_for_serving(): a params-only checkpoint from a training checkpoint.

Copying mode restores the chosen subtree (slots are never read), optionally casts floats
(e.g. to bfloat16) and saves it with any sharding policy. Link mode copies no data at all:
it writes a manifest whose pieces point at the source checkpoint's data files, recording
the source manifest's crc32c so a restore can tell when the source is gone or changed.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.errors import CheckpointExistsError, CorruptCheckpointError
from tpu_ckpt.format import (
    MANIFEST_FILE,
    LeafEntry,
    Manifest,
    byte_batches,
    crc32c,
    dtype_from_name,
    flatten,
    join,
    normalise_subtree,
    under,
    unflatten_nested,
    write,
)
from tpu_ckpt.interop._hf_export import export_huggingface
from tpu_ckpt.interop._hf_layout import parse_size
from tpu_ckpt.interop._hf_names import Names
from tpu_ckpt.options import CheckpointOptions, checked_options
from tpu_ckpt.restoring import missing_subtree, restore_from
from tpu_ckpt.saving import save
from tpu_ckpt.settings import settings
from tpu_ckpt.sharding import MaxShardSizePolicy

logger = logging.getLogger(__name__)


def export_for_serving(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    subtree: str = "params",
    dtype: Any = None,
    layout: str = "tpu_ckpt",
    names: Names = None,
    max_shard_size: int | str | None = None,
    link: bool = False,
    progress: Callable[[int, int], None] | None = None,
    options: CheckpointOptions | None = None,
) -> str:
    """Writes the ``subtree`` of checkpoint ``src`` (its params) as checkpoint ``dst``;
    ``tc.restore(dst)`` then returns that subtree as the whole tree. ``layout="huggingface"``
    writes Hugging Face safetensors files instead (docs/serving.md), which serving stacks
    read without this library and :func:`load_safetensors` reads back onto any mesh.

    Args:
      src: the checkpoint to read.
      dst: the new checkpoint; it must not exist yet, or be empty.
      subtree: the key path to export.
      dtype: casts float leaves (e.g. ``"bfloat16"``); ``None`` keeps them.
      layout: ``"tpu_ckpt"`` (a checkpoint) or ``"huggingface"`` (for serving stacks, the Hub).
      names: huggingface only: ``None`` joins the key path below ``subtree`` by ``.``; a dict or function from key path
        (``params/Dense_0/kernel``) to a name, ``None`` or ``{"name": ..., "transpose": True}``.
      max_shard_size: re-cuts the data files (:class:`MaxShardSizePolicy`); for the
        huggingface layout the most data bytes of one file, an int or ``"5GB"`` (the default).
      link: write only a manifest referring to ``src``'s data files (local paths only;
        not with ``dtype`` or ``max_shard_size``, which need a rewrite).
      progress: ``progress(done, total)`` is called with byte counts as the copy proceeds.
      options: huggingface only: ``host_memory_limit`` (big tensors go in blocks of rows).

    Returns:
      The written checkpoint's path (``dst``).

    Raises:
      ValueError: ``dtype`` is not a float type, or ``link`` is combined with a rewrite or
        with a non-local, linked or incremental checkpoint.
      CheckpointExistsError: ``dst`` already holds something.
      TargetMismatchError: ``src`` has no ``subtree``.
      CheckpointNotFoundError: nothing is committed at ``src``.
      CorruptCheckpointError: a data file of ``src`` is missing or fails its checksum.
    """
    _check_arguments(layout, names, link, rewrite=dtype is not None or max_shard_size is not None)
    if link:
        return _link(storage.location(src), storage.location(dst), subtree)
    cast = np.dtype(dtype) if dtype is not None else None
    if cast is not None and not jnp.issubdtype(cast, jnp.floating):
        raise ValueError(f"dtype must be a float type (e.g. bfloat16), got {cast}")
    if layout == "huggingface":
        return export_huggingface(
            src, dst, subtree, cast, names, max_shard_size, checked_options(options, "export_for_serving"), progress
        )
    params = _read_params(src, subtree, cast, progress)
    policy = MaxShardSizePolicy(parse_size(max_shard_size)) if max_shard_size is not None else None
    return save(dst, params, options=CheckpointOptions(sharding_callback=policy)).wait()


def _check_arguments(layout: str, names: Names, link: bool, rewrite: bool) -> None:
    if layout not in ("tpu_ckpt", "huggingface"):
        raise ValueError(f"layout must be 'tpu_ckpt' or 'huggingface', got {layout!r}")
    if layout == "tpu_ckpt" and names is not None:
        raise ValueError("names apply to layout='huggingface' only: a tpu_ckpt export keeps the key paths")
    if link and layout != "tpu_ckpt":
        raise ValueError("link=True needs layout='tpu_ckpt': the huggingface layout is always a copy")
    if link and rewrite:
        raise ValueError(
            "link=True reuses the source's data files as they are, so it cannot also change "
            "the dtype or the shard size; drop --link, or drop --dtype/--max-shard-size."
        )


def _read_params(
    src: str | os.PathLike[str], subtree: str, cast: np.dtype | None, progress: Callable[[int, int], None] | None
) -> Any:
    """The subtree as nested dicts of numpy arrays, read (and cast) a batch of leaves at a
    time so that a progress report is possible and casts never hold two full copies."""
    prefix, depth = normalise_subtree(subtree)
    with open_checkpoint(src) as checkpoint:
        leaves = _subtree_leaves(checkpoint.manifest, prefix, src)
        total, done = sum(leaf.nbytes for leaf in leaves), 0
        values: dict[str, Any] = {join(leaf.path[depth:]): leaf.value for leaf in leaves if leaf.kind == "value"}
        arrays = [leaf for leaf in leaves if leaf.kind == "array"]
        for batch in byte_batches(arrays, operator.attrgetter("nbytes"), settings().read_batch_bytes):
            target = unflatten_nested((leaf.path[depth:], _placeholder(leaf)) for leaf in batch)
            tree, _, _ = restore_from(checkpoint, target, CheckpointOptions(), prefix, None)
            for key, _, value in flatten(tree, keep_none=True)[0]:
                values[key] = value.astype(cast) if cast is not None and _is_float_array(value) else value
            done += sum(leaf.nbytes for leaf in batch)
            if progress is not None:
                progress(done, total)
    return unflatten_nested((leaf.path[depth:], values[join(leaf.path[depth:])]) for leaf in leaves)


def _subtree_leaves(manifest: Manifest, prefix: str, src: Any) -> list[LeafEntry]:
    leaves = [leaf for leaf in manifest.leaves if under(leaf.key, prefix)]
    if not leaves:
        raise missing_subtree(manifest, prefix, str(src))
    return leaves


def _placeholder(leaf: LeafEntry) -> np.ndarray:
    """A restore target standing for an array leaf: an unfilled array of its shape and dtype."""
    return np.empty(leaf.shape, dtype_from_name(leaf.dtype))


def _is_float_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and jnp.issubdtype(value.dtype, jnp.floating)


def _link(src: storage.Location, dst: storage.Location, subtree: str) -> str:
    if not (src.is_local and dst.is_local):
        raise ValueError("link=True works between local directories only")
    with open_checkpoint(src, threads=1) as checkpoint:
        manifest = checkpoint.manifest
        if manifest.source is not None:
            raise ValueError(f"{src.url} is itself a linked checkpoint; link to its source instead")
        prefix, depth = normalise_subtree(subtree)
        leaves = _subtree_leaves(manifest, prefix, src.url)
        checkpoint.load_all(leaves)
        _refuse_references(leaves, src.url)
        source_crc = crc32c(checkpoint.store.read_file(MANIFEST_FILE) or b"")
    if not storage.is_empty(dst):
        raise CheckpointExistsError(f"{dst.url} already exists and is not empty; choose a new path", file=dst.url)
    src_dir, dst_dir = (os.path.abspath(loc.local_path.rstrip("/")) for loc in (src, dst))
    if os.path.dirname(src_dir) != os.path.dirname(dst_dir):
        raise ValueError(
            f"link=True needs {dst.url} beside {src.url} (in the same directory): a linked checkpoint "
            "may only name files of a sibling, so it cannot reach outside its parent directory"
        )
    source_dir = "../" + os.path.basename(src_dir)  # files are resolved from inside dst
    renamed = {name: os.path.join(source_dir, name) for name in manifest.files}
    linked = [
        dataclasses.replace(
            leaf,
            key=join(leaf.path[depth:]),
            path=leaf.path[depth:],
            pieces=tuple(p._replace(file=renamed[p.file]) for p in leaf.pieces),
        )
        for leaf in leaves
    ]
    used = {p.file for leaf in linked for p in leaf.pieces}
    _check_sources(dst_dir, used)
    doc = Manifest(
        tuple(linked),
        {renamed[name]: size for name, size in manifest.files.items() if renamed[name] in used},
        manifest.process_count,
        manifest.sharding_callback,
        source={"path": source_dir, "manifest_crc32c": source_crc},
    )
    staging = dst.staging(storage.new_token())
    with storage.open_staging(staging) as store:
        write(store, doc, MANIFEST_FILE)
    storage.publish(staging, dst)
    logger.info("tpu_ckpt: linked %s to %s (%d leaves, no data copied)", dst.url, src.url, len(linked))
    return dst.url


def _refuse_references(leaves: list[LeafEntry], src: str) -> None:
    """A linked checkpoint names the files of one source, so the pieces an incremental step
    took from an earlier step (``../<step>/<file>``) cannot be linked through it."""
    held = sorted({p.file for leaf in leaves for p in leaf.pieces if p.file.startswith("../")})
    if held:
        raise ValueError(
            f"{src} is an incremental step: {held[0]} (and {len(held) - 1} more) is held by an earlier step, "
            "which a linked checkpoint cannot name; export it without --link (link=False) to copy its data"
        )


def _check_sources(dst_dir: str, names: set[str]) -> None:
    """Opens each data file a link will name (``../<source>/<file>``) as a restore of it
    would (``safe_reads.open_confined``), so that a link out of the source checkpoint (or a
    source that is a link out of its directory), or a file of it gone, is refused by the
    export, not by the serving job's restore."""
    for name in sorted(names):
        try:
            os.close(storage.open_confined(dst_dir, name))
        except FileNotFoundError:
            path = storage.confine(dst_dir, name)
            raise CorruptCheckpointError(
                f"data file {path} is missing: the checkpoint is incomplete; link to another one", file=path
            ) from None
