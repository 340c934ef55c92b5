"""The save pipeline: plan (pure) -> snapshot to host -> write data files -> every process's
index to the leader -> commit (manifest last), synchronously or in the background."""

from tpu_ckpt.saving._background import (
    WRITER,
    SaveResult,
)
from tpu_ckpt.saving._data_writes import (
    Writes,
    snapshot,
    write_all,
)
from tpu_ckpt.saving._incremental import Incremental
from tpu_ckpt.saving._merge import (
    Grids,
    merge_rows,
)
from tpu_ckpt.saving._plan import (
    SavePlan,
    plan_save,
)
from tpu_ckpt.saving._save import (
    OwnFiles,
    SaveJob,
    largest_file,
    save,
)
from tpu_ckpt.saving._staging import prepare
from tpu_ckpt.saving._stream_write import StreamWriter

__all__ = [
    "Grids",
    "Incremental",
    "OwnFiles",
    "SaveJob",
    "SavePlan",
    "SaveResult",
    "StreamWriter",
    "WRITER",
    "Writes",
    "largest_file",
    "merge_rows",
    "plan_save",
    "prepare",
    "save",
    "snapshot",
    "write_all",
]
