"""Multi-tier checkpoints: a fast local tier on each host, replicated to peers, promoted to
persistent storage in the background, and the choice of which tier a restore reads."""

from tpu_ckpt.tiers._fallback import agree
from tpu_ckpt.tiers._local_tier import (
    FromLocal,
    LocalTier,
)
from tpu_ckpt.tiers._upload import Upload

__all__ = [
    "agree",
    "FromLocal",
    "LocalTier",
    "Upload",
]
