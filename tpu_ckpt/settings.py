"""tpu_ckpt's settings: the environment variables it reads and its tuning knobs, in one
frozen value.

The environment is read once, at first use, and never again: no checkpoint operation sees
a variable change half-way, and a process's behaviour can be read off one value instead of
``os.environ`` reads deep inside the storage and relay code. A process may replace the
value with :func:`configure` (a test pointing tpu_ckpt at an emulator, a job tuning a knob).

Every process of a job should run with the same settings, as with the same code: a relay's
server sizes its limits by its own knobs, and its clients by theirs.

Not here, on purpose: values every process must compute identically without communicating
(``pieces.SPLIT_REPLICAS_FROM``, which decides who writes a replicated block, and
``read_plan.MAX_READ_BYTES``, which also bounds the relay's wire protocol); facts of the
format (``format.ALIGNMENT``); bounds on what a hostile file or peer may make tpu_ckpt
allocate (``relay_wire``, ``safe_reads``, ``slices``, ``decode``); and tensorstore's retry
policy (``storage/_objects.py`` ``RETRIES``: a few quick retries, fixed into the process-wide
tensorstore context), around which ``object_retry_seconds`` retries for as long as it says.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Settings:
    # From the environment. The relay's address on this host, where the route to the JAX
    # coordinator is not the one hosts talk to each other on (distributed.relay_host).
    relay_host: str | None = None  # TPU_CKPT_RELAY_HOST
    # The ports a relay server may listen on, first and last: a custom VPC's firewall opens
    # only the ports it names. None: any port the OS picks (ephemeral, different each time).
    relay_ports: tuple[int, int] | None = None  # TPU_CKPT_RELAY_PORTS, "50100-50199" or "50100"
    # S3-compatible servers: tensorstore itself ignores the variable (storage/_objects.py).
    aws_endpoint_url: str | None = None  # AWS_ENDPOINT_URL
    # Each process's slice, by process index, where JAX reports none (CPU devices, a test
    # standing in for a multislice job): the local tier's replicas go by it (tiers/_replicas.py).
    slices: tuple[int, ...] | None = None  # TPU_CKPT_SLICES, "0,0,1,1"
    # Each process's host, by process index, in place of what the processes find (hostname and
    # boot id, tiers/_hosts.py): a test simulating several hosts on one machine.
    hosts: tuple[int, ...] | None = None  # TPU_CKPT_HOSTS, "0,0,1,1"

    # Knobs.
    io_threads: int = 8  # of a Store: parallel reads and writes of one process
    copy_threads: int = 4  # host-memory copies: an async save's snapshot, a restore's assembly
    writes_in_flight: int = 4  # data files one saving process has brought to the host and is writing
    read_batch_bytes: int = 256 << 20  # checkpoint data a restore, export or verify reads at once
    # An async save's snapshot buffers kept, once written, for the next snapshot to copy into
    # (saving/_data_writes.py): the snapshot's bytes stay resident between saves, and the copy runs
    # at the memory's speed instead of at the page faults' of fresh memory.
    reuse_snapshot_buffers: bool = True
    # Local data files of 8 MiB or more written around the page cache, through a reused bounce
    # buffer with O_DIRECT (storage/_direct_writes.py): on a VM whose free memory the host takes
    # back, filling fresh page-cache pages cost 10x the write. False: every write is buffered.
    direct_writes: bool = True
    # The largest object a save writes to an object store (gs://, s3://, memory://), header
    # included: data files are cut to it when the save is planned, so a write holds one such
    # object (three times while tensorstore copies it in) and a retried request re-sends one.
    object_bytes: int = 256 << 20
    # Ranged requests one object store keeps in flight while reading (restore, verify, export):
    # a single request reaches ~100 MB/s, a host needs dozens at once to fill its link.
    object_reads_in_flight: int = 32
    # How long one object-store request (a write, a ranged read, a listing, a delete) is retried
    # while the store answers 408, 429, 5xx or drops the connection, from its first attempt:
    # a bucket ramping up throttles for minutes, which a save or restore should wait out, not
    # fail on. Past it the operation fails with a CheckpointError naming the object and the
    # last status (storage/_retries.py).
    object_retry_seconds: float = 900.0  # TPU_CKPT_OBJECT_RETRY_SECONDS
    # The most object-store requests a second this process issues, over all its stores (0: no
    # limit): the bucket's request rate divided by the number of hosts keeps a pod under it
    # together instead of throttled together (storage/_request_rate.py, docs/object_stores.md).
    # At least MIN_REQUESTS_PER_SECOND (one request per 100 s), so that no request waits longer for its turn.
    object_requests_per_second: float = 0.0  # TPU_CKPT_OBJECT_REQUESTS_PER_SECOND
    relay_connections: int = 4  # sockets a process opens to a relay server
    relay_writes_in_flight: int = 4  # files an io_device relay server holds in memory, over all clients
    relay_heartbeat_seconds: float = 5.0  # how often a relay server tells a queued write that it waits
    # How long a relay client waits for TCP to connect: a firewall drops packets silently, and
    # waiting coordination_timeout to learn it would look like a dead host.
    relay_connect_seconds: float = 5.0
    # The rate an io_device process is taken to move a job's bytes (relay and storage together)
    # until it has measured one: a save or restore it would not finish within
    # coordination_timeout at this rate is warned of (relay/_io_budget.py).
    io_device_bytes_per_second: float = 1e9
    # SO_SNDBUF and SO_RCVBUF asked for on every relay socket. 0 (the default) leaves them to
    # the kernel's autotuning, which grows them up to net.ipv4.tcp_rmem's maximum (6 MiB on a
    # stock kernel); a size set here turns autotuning off and is capped at net.core.rmem_max
    # (about 208 KiB on a stock kernel), so set it only on hosts tuned for it.
    relay_socket_buffer_bytes: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _FROM_ENVIRONMENT or (field.name in _MAY_BE_ZERO and value == 0):
                continue
            if not value > 0:
                raise ValueError(f"Settings.{field.name} must be positive, got {value!r}")
        if 0 < self.object_requests_per_second < MIN_REQUESTS_PER_SECOND:
            raise ValueError(
                f"Settings.object_requests_per_second (TPU_CKPT_OBJECT_REQUESTS_PER_SECOND) must be 0 (no limit) or at "
                f"least {MIN_REQUESTS_PER_SECOND} (one request per {1 / MIN_REQUESTS_PER_SECOND:.0f} s), got "
                f"{self.object_requests_per_second!r}"
            )
        if self.relay_ports is not None:
            first, last = self.relay_ports
            if not 0 < first <= last < 1 << 16:
                raise ValueError(
                    "Settings.relay_ports (TPU_CKPT_RELAY_PORTS) must be two ports, first <= last, "
                    f"got {self.relay_ports!r}"
                )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The environment's values, and every knob at its default. An empty variable counts
        as unset."""
        return cls(
            relay_host=environ.get("TPU_CKPT_RELAY_HOST") or None,
            relay_ports=_port_range(environ.get("TPU_CKPT_RELAY_PORTS") or None),
            aws_endpoint_url=environ.get("AWS_ENDPOINT_URL") or None,
            slices=_slices(environ.get("TPU_CKPT_SLICES") or None),
            hosts=_slices(environ.get("TPU_CKPT_HOSTS") or None, "TPU_CKPT_HOSTS", "host"),
            object_retry_seconds=_number(
                "TPU_CKPT_OBJECT_RETRY_SECONDS", environ, cls.object_retry_seconds, "a number of seconds"
            ),
            object_requests_per_second=_number(
                "TPU_CKPT_OBJECT_REQUESTS_PER_SECOND", environ, cls.object_requests_per_second,
                "a number of requests a second",
            ),
        )


MIN_REQUESTS_PER_SECOND = 0.01  # a slower pace would make one request wait hours (or overflow time.sleep)
_FROM_ENVIRONMENT = ("relay_host", "relay_ports", "aws_endpoint_url", "slices", "hosts")
_MAY_BE_ZERO = ("relay_socket_buffer_bytes", "reuse_snapshot_buffers", "direct_writes", "object_requests_per_second")


def _port_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    first, _, last = text.strip().partition("-")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise ValueError(f"TPU_CKPT_RELAY_PORTS must be a port or a range such as 50100-50199, got {text!r}") from None


def _number(variable: str, environ: Mapping[str, str], default: float, what: str) -> float:
    """A knob the environment may set too (tests and launchers outside the library do)."""
    text = environ.get(variable) or None
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{variable} must be {what}, got {text!r}") from None


def _slices(text: str | None, variable: str = "TPU_CKPT_SLICES", what: str = "slice") -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        found = tuple(int(part) for part in text.split(","))
    except ValueError:
        found = ()
    if not found or min(found) < 0:
        raise ValueError(f"{variable} must give each process's {what}, e.g. 0,0,1,1, got {text!r}")
    return found


_current: Settings | None = None


def settings() -> Settings:
    """This process's settings: read from the environment at the first call, then fixed."""
    global _current
    if _current is None:
        _current = Settings.from_environment()
    return _current


def configure(value: Settings | None) -> Settings | None:
    """Makes ``value`` this process's settings from now on (``None``: read the environment
    again at the next use) and returns the previous value, for putting it back. An operation
    already running may go on with the old ones."""
    global _current
    previous, _current = _current, value
    return previous


def use_cpu_devices(count: int) -> None:
    """Before JAX is imported, for a command that builds shardings it will not run on
    (``tpu-ckpt plan``): ``count`` CPU devices, unless the environment names a platform or a
    device count already, and 64-bit dtypes as themselves (a plan is of layouts: whether the
    job restoring them runs with x64 is its own). Once JAX is imported, its devices are what they are."""
    if "jax" in sys.modules:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_ENABLE_X64", "1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(count, 1)}".strip()
