"""One process serving another's reads and writes over TCP: the wire format, the server and
the client store (private directories, a restore read once and shared)."""

from tpu_ckpt.relay._client import RelayStore
from tpu_ckpt.relay._io_budget import (
    note_rate,
    warn_if_beyond,
)
from tpu_ckpt.relay._server import RelayServer
from tpu_ckpt.relay._wire import (
    RelayConnectionError,
    error_from_json,
    error_to_json,
)

__all__ = [
    "RelayConnectionError",
    "RelayServer",
    "RelayStore",
    "error_from_json",
    "error_to_json",
    "note_rate",
    "warn_if_beyond",
]
