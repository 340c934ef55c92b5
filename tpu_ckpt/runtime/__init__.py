"""What every long operation shares: a progress bar and human sizes, and the garbage
collector paused while millions of small objects are made."""

from tpu_ckpt.runtime._gc_pause import gc_paused
from tpu_ckpt.runtime._progress import (
    Progress,
    plural,
    size,
    table,
)

__all__ = [
    "Progress",
    "gc_paused",
    "plural",
    "size",
    "table",
]
