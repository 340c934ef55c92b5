"""tpu_ckpt: checkpoints for pytrees of sharded JAX arrays, with TF's CheckpointOptions.

    import tpu_ckpt as tc
    tc.save("/ckpt/step_100", state)
    state = tc.restore("/ckpt/step_100", target=abstract_state)

The public names are imported on first use (PEP 562), so that ``import tpu_ckpt`` and the
``tpu-ckpt`` commands that only read manifests do not pay for importing JAX.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from tpu_ckpt.orbax_interop import ImportReport, export_orbax, import_orbax
    from tpu_ckpt.pieces import ShardableTensor, ShardingCallback
    from tpu_ckpt.policies import MaxShardSizePolicy, ShardByDevicePolicy, ShardByTaskPolicy
    from tpu_ckpt.restore import ArrayMetadata, metadata, restore
    from tpu_ckpt.restore_check import RestoreReport, check_restore
    from tpu_ckpt.save import save

__version__ = "0.1.0"

_MODULE_OF = {
    "ArrayMetadata": "restore",
    "Checkpoint": "checkpoint",
    "CheckpointError": "errors",
    "CheckpointExistsError": "errors",
    "CheckpointManager": "manager",
    "CheckpointNotFoundError": "errors",
    "CheckpointOptions": "options",
    "CoordinationTimeoutError": "errors",
    "CorruptCheckpointError": "errors",
    "FORMAT_VERSION": "format",
    "FormatVersionError": "errors",
    "ImportReport": "orbax_interop",
    "InvalidShardsError": "errors",
    "MaxShardSizePolicy": "policies",
    "RemoteProcessError": "errors",
    "RestoreReport": "restore_check",
    "SaveResult": "background",
    "ShardByDevicePolicy": "policies",
    "ShardByTaskPolicy": "policies",
    "ShardableTensor": "pieces",
    "ShardingCallback": "pieces",
    "TargetMismatchError": "errors",
    "UncommittedCheckpointError": "errors",
    "check_restore": "restore_check",
    "export_for_serving": "export",
    "export_orbax": "orbax_interop",
    "import_orbax": "orbax_interop",
    "metadata": "restore",
    "restore": "restore",
    "save": "save",
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
    "RemoteProcessError",
    "RestoreReport",
    "SaveResult",
    "ShardByDevicePolicy",
    "ShardByTaskPolicy",
    "ShardableTensor",
    "ShardingCallback",
    "TargetMismatchError",
    "UncommittedCheckpointError",
    "check_restore",
    "export_for_serving",
    "export_orbax",
    "import_orbax",
    "metadata",
    "restore",
    "save",
)


class _Package(types.ModuleType):
    """Importing a submodule binds it as an attribute of its package; for ``save`` and
    ``restore`` that would hide the functions of the same name, so those bindings are
    dropped (the submodules stay in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tpu_ckpt.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
