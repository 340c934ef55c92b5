"""Who writes a staging area, and whether that writer is provably dead.

A staging marker (``_stores.mark_staging``) records its writer: the host (its hostname, the
kernel's boot id from ``/proc/sys/kernel/random/boot_id``, and the process's PID namespace),
the process id and the process's start time (field 22 of ``/proc/<pid>/stat``, clock ticks
since boot). A reader on the same host, same boot and same PID namespace can tell for
certain that the writer is gone: no such process, or a process of that id started at
another time (the id was reused). Anywhere else (another host, another container, a
rebooted host, a marker written before these fields, a system without ``/proc``) nothing is
certain, and the marker's grace period stays.

``shorter_grace`` lets ``tpu-ckpt gc --grace SECONDS`` shorten the grace period of every
marker read inside it: an operator who knows a job is dead need not wait an hour.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

_GRACE: contextvars.ContextVar[float | None] = contextvars.ContextVar("tpu_ckpt_grace", default=None)


def identity() -> dict[str, Any]:
    """This process as a staging marker records it (its fields are None where unknown)."""
    return {"host": _host(), "pid": os.getpid(), "pid_start": _started(os.getpid())}


def dead(marker: Mapping[str, Any]) -> bool:
    """Whether the writer a marker records is provably gone (see module docstring)."""
    host, pid, started = marker.get("host"), marker.get("pid"), marker.get("pid_start")
    if host is None or host != _host() or None in host.values() or not isinstance(pid, int) or isinstance(pid, bool):
        return False
    now = _started(pid)
    return now is None or now != started


@functools.cache
def _host() -> dict[str, str | None]:
    """This host and kernel boot, and this process's PID namespace: ids mean the same only within all three."""
    return {
        "name": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _link("/proc/self/ns/pid"),
    }


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such process (or no /proc)."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    try:
        return int(text.rpartition(")")[2].split()[19])  # after the command name, which may hold spaces
    except (IndexError, ValueError):
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


@contextlib.contextmanager
def shorter_grace(seconds: float | None) -> Iterator[None]:
    """Every staging marker read inside counts a grace period of at most ``seconds`` (None: its own)."""
    token = _GRACE.set(seconds)
    try:
        yield
    finally:
        _GRACE.reset(token)


def grace(recorded: float) -> float:
    """A marker's grace period as read now: its own, or a shorter one (``shorter_grace``)."""
    cap = _GRACE.get()
    return recorded if cap is None else min(recorded, cap)
