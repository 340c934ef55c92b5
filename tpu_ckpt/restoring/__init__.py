"""The restore pipeline: open -> load the rows the target needs -> plan (pure) -> read ->
place, with reads shared between processes; and ``check_restore``, the plan without the reads."""

from tpu_ckpt.restoring._abstract import abstract_target
from tpu_ckpt.restoring._check import RestoreReport, check_restore
from tpu_ckpt.restoring._exec import execute
from tpu_ckpt.restoring._plan import ArrayRead, NoRead, missing_subtree, needed_slices, plan_restore
from tpu_ckpt.restoring._restore import ArrayMetadata, PerProcessMetadata, metadata, restore, restore_from
from tpu_ckpt.restoring._shared_reads import StoreReads

__all__ = ["ArrayMetadata", "PerProcessMetadata", "ArrayRead", "NoRead", "RestoreReport", "StoreReads", "abstract_target", "check_restore", "execute", "metadata", "missing_subtree", "needed_slices", "plan_restore", "restore", "restore_from"]
