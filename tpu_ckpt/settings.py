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
policy (``storage.RETRIES``), fixed into the process-wide tensorstore context at import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Settings:
    # From the environment. The relay's address on this host, where the route to the JAX
    # coordinator is not the one hosts talk to each other on (distributed.relay_host).
    relay_host: str | None = None  # TPU_CKPT_RELAY_HOST
    # S3-compatible servers: tensorstore itself ignores the variable (storage.py).
    aws_endpoint_url: str | None = None  # AWS_ENDPOINT_URL

    # Knobs.
    io_threads: int = 8  # of a Store: parallel reads and writes of one process
    copy_threads: int = 4  # host-memory copies: an async save's snapshot, a restore's assembly
    writes_in_flight: int = 4  # data files one saving process has brought to the host and is writing
    read_batch_bytes: int = 256 << 20  # checkpoint data a restore, export or verify reads at once
    relay_connections: int = 4  # sockets a process opens to a relay server
    relay_writes_in_flight: int = 4  # files an io_device relay server holds in memory, over all clients
    relay_heartbeat_seconds: float = 5.0  # how often a relay server tells a queued write that it waits
    coordination_poll_seconds: float = 0.05  # the longest pause between polls of a cross-process wait

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("relay_host", "aws_endpoint_url") and not value > 0:
                raise ValueError(f"Settings.{field.name} must be positive, got {value!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The environment's values, and every knob at its default. An empty variable counts
        as unset."""
        return cls(
            relay_host=environ.get("TPU_CKPT_RELAY_HOST") or None,
            aws_endpoint_url=environ.get("AWS_ENDPOINT_URL") or None,
        )


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
