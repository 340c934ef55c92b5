"""Host memory of this process, for the probes that run a save or restore in a fresh one.

Peaks come from VmHWM after resetting it through /proc/self/clear_refs.
"""

import ctypes
import ctypes.util


def rss(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak(trim: bool = False) -> None:
    """Resets VmHWM to the current RSS; ``trim`` first returns free heap pages to the OS, so
    that a copy cannot hide in them."""
    if trim:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
