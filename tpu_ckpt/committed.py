"""Reading a checkpoint's committed manifest, with the errors a user can act on.

Shared by restore, export and the command line (verify, diff, ls).
"""

from __future__ import annotations

import os
from typing import Any

from tpu_ckpt import storage
from tpu_ckpt.decode import decode_manifest
from tpu_ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UncommittedCheckpointError
from tpu_ckpt.format import MANIFEST_FILE, Manifest, crc32c


def read_manifest(loc: storage.Location) -> Manifest:
    """The committed manifest at ``loc``; a typed error if there is none or it is unusable."""
    with storage.Store(loc, threads=1) as store:
        data = store.read_file(MANIFEST_FILE)
    if data is None:
        if storage.is_empty(loc) and not storage.has_staging_leftover(loc):
            raise CheckpointNotFoundError(f"No checkpoint at {loc.url}", file=loc.url)
        raise UncommittedCheckpointError(
            f"{loc.url} holds an uncommitted checkpoint (no {MANIFEST_FILE}): its save was "
            "interrupted or failed, so it is not restorable. Restore an earlier checkpoint.",
            file=loc.url,
        )
    manifest = decode_manifest(data, where=loc.child(MANIFEST_FILE))
    if manifest.source is not None:
        _check_link(loc, manifest.source)
    return manifest


def _check_link(loc: storage.Location, source: dict[str, Any]) -> None:
    """A linked checkpoint is valid only while the checkpoint holding its data is unchanged."""
    src = storage.location(os.path.normpath(os.path.join(loc.local_path, source["path"])))
    with storage.Store(src, threads=1) as store:
        data = store.read_file(MANIFEST_FILE)
    if data is None:
        raise CheckpointNotFoundError(
            f"{loc.url} is a linked checkpoint whose data lives in {src.url}, which no longer exists. "
            "Export it again without --link, or restore the source checkpoint.",
            file=src.url,
        )
    if crc32c(data) != source["manifest_crc32c"]:
        raise CorruptCheckpointError(
            f"{loc.url} is a linked checkpoint, but its source {src.url} has changed since the link "
            "was made. Export it again.",
            file=src.url,
        )
