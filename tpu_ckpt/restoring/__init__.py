"""The restore pipeline: open -> load the rows the target needs -> plan (pure) -> read ->
place, with reads shared between processes; and ``check_restore``, the plan without the reads."""

from tpu_ckpt.restoring._abstract import abstract_target
from tpu_ckpt.restoring._check import (
    RestoreReport,
    check_restore,
)
from tpu_ckpt.restoring._plan import missing_subtree
from tpu_ckpt.restoring._restore import (
    ArrayMetadata,
    PerProcessMetadata,
    metadata,
    restore,
    restore_from,
)

__all__ = [
    "ArrayMetadata",
    "PerProcessMetadata",
    "RestoreReport",
    "abstract_target",
    "check_restore",
    "metadata",
    "missing_subtree",
    "restore",
    "restore_from",
]
