"""Whether one ``io_device`` process can move a job's bytes in time: a warning, once.

With ``io_device`` every byte of a save or restore goes through one process: its network
link, its relay and its storage. At pod scale that is the job's whole state (a 70B model
with Adam: ~1.1 TB) through one host, while every other process waits on it. So before a
relayed save or restore, the io process estimates its time from the job's bytes and a rate
(the one it measured over its last relayed operation, else ``Settings.io_device_bytes_per_second``)
and, where that exceeds ``coordination_timeout`` or the bytes exceed the free space of its
local disk, logs one WARNING naming the numbers and the alternative: the default, where
every process reads and writes its own share. Once per process: a training loop's next
saves would say the same.
"""

from __future__ import annotations

import logging
import shutil

from tpu_ckpt.settings import settings

logger = logging.getLogger(__name__)

# The least bytes an operation moves for its time to count as a measured rate: below it a
# save is latency (coordination, a commit), not throughput.
MEASURED_FROM_BYTES = 64 << 20
_measured: list[float] = []  # bytes a second of this process's last relayed operation that moved enough
_warned: list[str] = []  # the warning given, if any: at most one per process


def note_rate(nbytes: int, seconds: float) -> None:
    """Records what the io process moved in a relayed operation, as the rate estimates use next."""
    if nbytes >= MEASURED_FROM_BYTES and seconds > 0:
        _measured[:] = [nbytes / seconds]


def warn_if_beyond(operation: str, url: str, nbytes: int, timeout: float, local_dir: str | None = None) -> str | None:
    """On the io process, before a relayed ``operation`` ("save", "restore") of ``url``
    moving ``nbytes`` in all: logs a WARNING, the first time only, where the estimated time
    exceeds ``timeout`` (``coordination_timeout``) or, for a save into ``local_dir``, the
    bytes exceed its free space. Returns the warning's text when it would warn (logged or not)."""
    rate, source = _rate()
    seconds = nbytes / rate
    late = seconds > timeout
    problems = []
    if late:
        problems.append(
            f"~{seconds:,.0f} s at {rate / 1e6:,.0f} MB/s ({source}), beyond coordination_timeout={timeout:g}s"
        )
    free = _free_bytes(local_dir)
    if free is not None and nbytes > free:
        problems.append(f"more than the {free / 1e9:,.1f} GB free in {local_dir}")
    if not problems:
        return None
    text = (
        f"tpu_ckpt: {operation} {url} moves {nbytes / 1e9:,.1f} GB through the io_device process alone: "
        f"{'; '.join(problems)}.{' The other processes wait on it and may time out.' if late else ''} Leave io_device "
        "unset (the default: every process reads and writes its own share, on storage every host sees)"
        f"{', or raise coordination_timeout' if late else ''}."
    )
    if not _warned:
        _warned.append(text)
        logger.warning("%s", text)
    return text


def _rate() -> tuple[float, str]:
    if _measured:
        return _measured[0], "measured over this process's last io_device operation"
    return settings().io_device_bytes_per_second, "Settings.io_device_bytes_per_second; none measured yet"


def _free_bytes(local_dir: str | None) -> int | None:
    if local_dir is None:
        return None
    try:
        return shutil.disk_usage(local_dir).free
    except OSError:
        return None  # not there yet: nothing to compare
