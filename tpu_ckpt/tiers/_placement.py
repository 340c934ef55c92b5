"""Where a local tier belongs, checked: TPU VMs have no local SSD (a 100 GiB boot disk and
network-attached disks), so the local tier lives in RAM: ``/dev/shm`` or a ramdisk mount
(on GKE a hostPath to one, or the multi-tier checkpointing CSI ramdisk; never ``emptyDir``,
which is deleted with the pod). A directory on the root or an overlay file system is the
boot disk or the container's layer: slow, small, and gone with the container. A tmpfs too
small for the steps kept fails a save half-way, so its size is compared, at the first local
save, with what the tier takes (docs/multi_tier.md):

    (1 + local_replicas) × (local_max_to_keep + 1) × this host's share, plus the async snapshot
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_RAM = ("tmpfs", "ramfs")
_checked_sizes: set[str] = set()  # roots whose size this process has compared already


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the deepest mount holding ``path`` (Linux's
    /proc/mounts; ("", "") where it cannot be read)."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, fields[2])
    except OSError:
        pass
    return best


def _existing(path: str) -> str:
    """``path``, or its nearest ancestor that exists (a local tier's root is made at its first save)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def warn_if_not_in_memory(root: str) -> None:
    """The construction-time warning for a local tier on the root or an overlay file system."""
    point, kind = mount_of(_existing(root))
    if kind == "overlay" or point == "/":
        logger.warning(
            "tpu_ckpt: local_directory %s is on the %s file system (%s): on a TPU VM that is the boot disk "
            "(or the container's own layer), slow, small and gone with the container. Put the local tier in "
            "memory: /dev/shm or a ramdisk mount (on GKE a hostPath or the multi-tier checkpointing CSI "
            "ramdisk, never emptyDir). See docs/multi_tier.md.", root, "root" if point == "/" else "overlay", kind,
        )


def check_size(root: str, share: int, replicas: int, keep: int | None, snapshot: bool) -> None:
    """Warns, once per root, when ``root`` is a tmpfs smaller than what the tier takes for
    this host's ``share`` of bytes per step (the formula above)."""
    if root in _checked_sizes:
        return
    _checked_sizes.add(root)
    existing = _existing(root)
    if mount_of(existing)[1] not in _RAM or keep is None:
        return
    needed = (1 + replicas) * (keep + 1) * share + (share if snapshot else 0)
    stats = os.statvfs(existing)
    size = stats.f_blocks * stats.f_frsize
    if needed > size:
        logger.warning(
            "tpu_ckpt: local_directory %s is a %.1f GB RAM disk, but the local tier takes up to %.1f GB on this "
            "host: (1 + local_replicas=%d) x (local_max_to_keep=%d + 1) x %.1f GB of this host's share%s. Grow the "
            "RAM disk, or lower local_max_to_keep or local_replicas.", root, size / 1e9, needed / 1e9, replicas, keep,
            share / 1e9, ", plus the async snapshot" if snapshot else "",
        )
