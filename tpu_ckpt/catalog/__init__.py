"""Committed checkpoints as they are found: one open checkpoint (manifest and piece tables
read once), a run's listing, verification and diffs; and the removal of a run's steps,
leftovers and strays (``_removal``, the one module that deletes). No JAX."""

from tpu_ckpt.catalog._committed import (
    read_manifest,
    store_tables,
)
from tpu_ckpt.catalog._diff import (
    Change,
    diff,
)
from tpu_ckpt.catalog._listing import (
    Entry,
    Listing,
    busy,
    checkpoints_in,
    list_run,
    nested,
    parse_listing,
    scan,
)
from tpu_ckpt.catalog._open import (
    OpenCheckpoint,
    open_checkpoint,
)
from tpu_ckpt.catalog._removal import (
    remove_leftover,
    remove_leftovers,
    remove_step,
    remove_strays,
    retire_step,
    trim_step,
)
from tpu_ckpt.catalog._strays import (
    Strays,
    strays,
)
from tpu_ckpt.catalog._verify import verify

__all__ = [
    "Change",
    "Entry",
    "Listing",
    "OpenCheckpoint",
    "Strays",
    "busy",
    "checkpoints_in",
    "diff",
    "list_run",
    "nested",
    "open_checkpoint",
    "parse_listing",
    "read_manifest",
    "remove_leftover",
    "remove_leftovers",
    "remove_step",
    "remove_strays",
    "retire_step",
    "scan",
    "store_tables",
    "strays",
    "trim_step",
    "verify",
]
