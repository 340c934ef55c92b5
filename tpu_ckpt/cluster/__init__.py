"""The processes of a job: the coordinator (key-value store and barriers, with deadlines) and
the proofs of what each process sees (shared storage, private directories)."""

from tpu_ckpt.cluster._coordinator import (
    Coordinator,
    preemption_sync_available,
    process_count,
    process_index,
    reached_preemption_sync_point,
    relay_host,
)
from tpu_ckpt.cluster._relays import (
    Clients,
    connect,
    contacts,
    fanout,
    serve,
    spread,
)
from tpu_ckpt.cluster._shared_storage import (
    prove_staging,
    read_manifest_everywhere,
    unproved,
)
from tpu_ckpt.cluster._verdicts import (
    Proved,
    agreed_verdict,
)

__all__ = [
    "Clients",
    "Coordinator",
    "Proved",
    "agreed_verdict",
    "connect",
    "contacts",
    "fanout",
    "preemption_sync_available",
    "process_count",
    "process_index",
    "prove_staging",
    "reached_preemption_sync_point",
    "read_manifest_everywhere",
    "relay_host",
    "serve",
    "spread",
    "unproved",
]
