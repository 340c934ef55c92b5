"""tpu_ckpt: checkpoints for pytrees of sharded JAX arrays, with TF's CheckpointOptions.

    import tpu_ckpt as tc
    tc.save("/ckpt/step_100", state)
    state = tc.restore("/ckpt/step_100", target=abstract_state)

The public names are imported on first use (PEP 562), so that ``import tpu_ckpt`` and the
``tpu-ckpt`` commands that only read manifests do not pay for importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpu_ckpt.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CoordinationTimeoutError,
        CorruptCheckpointError,
        FormatVersionError,
        InvalidShardsError,
        ProcessCountMismatchError,
        ProcessValueMismatchError,
        RemoteProcessError,
        TargetMismatchError,
        UncommittedCheckpointError,
    )
    from tpu_ckpt.format import FORMAT_VERSION, PerProcess
    from tpu_ckpt.interop import (
        Checkpoint,
        ImportReport,
        export_for_serving,
        export_orbax,
        import_orbax,
        load_safetensors,
    )
    from tpu_ckpt.manager import CheckpointManager
    from tpu_ckpt.options import CheckpointOptions
    from tpu_ckpt.restoring import (
        ArrayMetadata,
        PerProcessMetadata,
        RestoreReport,
        abstract_target,
        check_restore,
        metadata,
        restore,
    )
    from tpu_ckpt.saving import SaveResult, save
    from tpu_ckpt.sharding import (
        MaxShardSizePolicy,
        ShardableTensor,
        ShardByDevicePolicy,
        ShardByTaskPolicy,
        ShardingCallback,
    )

__version__ = "0.1.0"

_MODULE_OF = {
    "ArrayMetadata": "restoring",
    "Checkpoint": "interop",
    "CheckpointError": "errors",
    "CheckpointExistsError": "errors",
    "CheckpointManager": "manager",
    "CheckpointNotFoundError": "errors",
    "CheckpointOptions": "options",
    "CoordinationTimeoutError": "errors",
    "CorruptCheckpointError": "errors",
    "FORMAT_VERSION": "format",
    "FormatVersionError": "errors",
    "ImportReport": "interop",
    "InvalidShardsError": "errors",
    "MaxShardSizePolicy": "sharding",
    "PerProcess": "format",
    "PerProcessMetadata": "restoring",
    "ProcessCountMismatchError": "errors",
    "ProcessValueMismatchError": "errors",
    "RemoteProcessError": "errors",
    "RestoreReport": "restoring",
    "SaveResult": "saving",
    "ShardByDevicePolicy": "sharding",
    "ShardByTaskPolicy": "sharding",
    "ShardableTensor": "sharding",
    "ShardingCallback": "sharding",
    "TargetMismatchError": "errors",
    "UncommittedCheckpointError": "errors",
    "abstract_target": "restoring",
    "check_restore": "restoring",
    "export_for_serving": "interop",
    "export_orbax": "interop",
    "import_orbax": "interop",
    "load_safetensors": "interop",
    "metadata": "restoring",
    "restore": "restoring",
    "save": "saving",
}

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
    "ImportReport",
    "InvalidShardsError",
    "MaxShardSizePolicy",
    "PerProcess",
    "PerProcessMetadata",
    "ProcessCountMismatchError",
    "ProcessValueMismatchError",
    "RemoteProcessError",
    "RestoreReport",
    "SaveResult",
    "ShardByDevicePolicy",
    "ShardByTaskPolicy",
    "ShardableTensor",
    "ShardingCallback",
    "TargetMismatchError",
    "UncommittedCheckpointError",
    "abstract_target",
    "check_restore",
    "export_for_serving",
    "export_orbax",
    "import_orbax",
    "load_safetensors",
    "metadata",
    "restore",
    "save",
)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tpu_ckpt.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
