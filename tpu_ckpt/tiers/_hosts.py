"""Which processes share a host, so that no local-tier replica lands on its owner's host.

A host can run several JAX processes (a TPU7x VM one per NUMA node, a GKE node several
pods): a replica kept by a process of the same host dies with it. So each process brings
its hostname and boot id to one collect of the coordination service (O(1) calls per
process), once per job: processes reporting the same pair share a host. ``TPU_CKPT_HOSTS``
(each process's host, by process index) stands in for them where one machine simulates
several hosts (tests). A job whose processes all share one host places replicas by process
(nothing else is left), as before.
"""

from __future__ import annotations

import socket

from tpu_ckpt import cluster
from tpu_ckpt.settings import settings

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_found: dict[int, tuple[int, ...]] = {}  # process count -> each process's host number


def job_hosts(coord: cluster.Coordinator) -> tuple[int, ...] | None:
    """Each process's host number (processes of one host share theirs), by process index;
    None where every process is on one host (collective at the first call of a job)."""
    hosts = settings().hosts
    if hosts is not None and len(hosts) != coord.count:
        raise ValueError(f"TPU_CKPT_HOSTS gives {len(hosts)} processes' hosts, but the job has {coord.count} processes")
    if hosts is None:
        if coord.count not in _found:
            names = coord.collect("hosts", _identity(), at=coord.me)  # everyone's, on every process
            numbers: dict[str, int] = {}
            _found[coord.count] = tuple(numbers.setdefault(names[p], len(numbers)) for p in range(coord.count))
        hosts = _found[coord.count]
    return None if len(set(hosts)) == 1 else hosts  # one host: replicas by process, nothing else is left


def _identity() -> str:
    """This host's name and boot id (a host re-imaged under the same name boots anew)."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()} {boot}"
