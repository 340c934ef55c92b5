"""The save pipeline: plan (pure) -> snapshot to host -> write data files -> every process's
index to the leader -> commit (manifest last), synchronously or in the background."""

from tpu_ckpt.saving._background import WRITER, SaveResult
from tpu_ckpt.saving._commit import commit, index, merge_rows
from tpu_ckpt.saving._data_writes import Writes, snapshot, write_all
from tpu_ckpt.saving._incremental import Incremental
from tpu_ckpt.saving._plan import (
    DataFile,
    SavePlan,
    data_file_name,
    plan_save,
    refuse_per_process,
    staged_index_file,
    written_by,
)
from tpu_ckpt.saving._save import SaveJob, largest_file, save, write_budget
from tpu_ckpt.saving._staging import Staging, prepare
from tpu_ckpt.saving._stream_write import StreamWriter

__all__ = ["DataFile", "Incremental", "SaveJob", "SavePlan", "SaveResult", "Staging", "StreamWriter", "WRITER", "Writes", "commit", "data_file_name", "index", "largest_file", "merge_rows", "plan_save", "prepare", "refuse_per_process", "save", "snapshot", "staged_index_file", "write_all", "write_budget", "written_by"]
