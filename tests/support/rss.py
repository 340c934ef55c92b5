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


def measured(out: dict, name: str, operation):
    """``operation()``'s result. Records in ``out[name]`` the peak RSS above the RSS before it
    (free heap pages trimmed and the peak reset first), and in ``out[name + "_held"]`` what it
    still holds once it returned (a restore's result, say)."""
    reset_peak(trim=True)
    base = rss("VmRSS")
    result = operation()
    out[name], out[name + "_held"] = rss("VmHWM") - base, rss("VmRSS") - base
    return result
