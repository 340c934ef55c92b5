"""``CheckpointManager``: cadence, retention, preemption and the collective listing over a
run directory of ``step_<n>`` checkpoints."""

from tpu_ckpt.manager._manager import CheckpointManager

__all__ = [
    "CheckpointManager",
]
