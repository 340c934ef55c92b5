"""tpu_ckpt: checkpoints for pytrees of sharded JAX arrays, with TF's CheckpointOptions.

    import tpu_ckpt as tc
    tc.save("/ckpt/step_100", state)
    state = tc.restore("/ckpt/step_100", target=abstract_state)
"""

from tpu_ckpt.background import SaveResult
from tpu_ckpt.checkpoint import Checkpoint
from tpu_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    FormatVersionError,
    InvalidShardsError,
    RemoteProcessError,
    TargetMismatchError,
    UncommittedCheckpointError,
)
from tpu_ckpt.export import export_for_serving
from tpu_ckpt.format import FORMAT_VERSION
from tpu_ckpt.manager import CheckpointManager
from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.pieces import ShardableTensor, ShardingCallback
from tpu_ckpt.policies import MaxShardSizePolicy, ShardByDevicePolicy, ShardByTaskPolicy
from tpu_ckpt.restore import ArrayMetadata, metadata, restore
from tpu_ckpt.save import save

__version__ = "0.1.0"

__all__ = (
    "ArrayMetadata",
    "Checkpoint",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointOptions",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "FORMAT_VERSION",
    "FormatVersionError",
    "InvalidShardsError",
    "MaxShardSizePolicy",
    "RemoteProcessError",
    "SaveResult",
    "ShardByDevicePolicy",
    "ShardByTaskPolicy",
    "ShardableTensor",
    "ShardingCallback",
    "TargetMismatchError",
    "UncommittedCheckpointError",
    "export_for_serving",
    "metadata",
    "restore",
    "save",
)
