"""Multi-tier checkpoints: a fast local tier on each host, replicated to peers, promoted to
persistent storage in the background, and the choice of which tier a restore reads."""

from tpu_ckpt.tiers._choice import Choice, decide
from tpu_ckpt.tiers._local_steps import held_steps
from tpu_ckpt.tiers._local_tier import FromLocal, LocalTier
from tpu_ckpt.tiers._range_merge import merge_range
from tpu_ckpt.tiers._replicas import replica_roles
from tpu_ckpt.tiers._upload import Upload

__all__ = ["Choice", "FromLocal", "LocalTier", "Upload", "decide", "held_steps", "merge_range", "replica_roles"]
