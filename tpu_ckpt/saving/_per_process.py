"""What each process saves for itself, and the check that its Python values agree with the others'.

A ``tc.PerProcess`` leaf's values, one per process, go into a values file per process
(``values-<process>.bin``, FORMAT.md "Per-process values") that the process writes beside its
data files. Only a small record crosses to the leader through the coordination service, with
the ``written`` stage it reaches anyway: the file's name and size, each value's offset, length
and crc32c, and a short digest of each plain Python leaf. The leader puts the values into the
manifest as pieces (one per process: slice ``[p, p+1)``), and refuses to commit a Python leaf
whose value differs between processes (a checkpoint holds one value per Python leaf; the
others' would be lost). The same goes for the host leaves one process writes for all: bytes,
and numpy arrays of at most ``HOST_CHECKED_BYTES`` (a forgotten ``tc.PerProcess`` around an
iterator's state is usually one); a bigger numpy leaf would cost a hash of its bytes at every
save, and is taken from the writing process unchecked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpu_ckpt import storage
from tpu_ckpt.errors import CheckpointError, CorruptCheckpointError, ProcessValueMismatchError
from tpu_ckpt.format import PER_PROCESS, LeafEntry, Manifest, PieceEntry, crc32c, values_file_name

HOST_CHECKED_BYTES = 64 << 10
HostDigests = Sequence[tuple[str, str]]  # (key, digest) per checked host leaf, in leaf order


def host_digests(leaves: Sequence[tuple[str, Any, Any]]) -> tuple[tuple[str, str], ...]:
    """The digests of the flattened tree's bytes leaves and numpy leaves of at most
    ``HOST_CHECKED_BYTES`` (dtype and shape included)."""
    out = []
    for key, _, leaf in leaves:
        if isinstance(leaf, (bytes, bytearray, memoryview)):
            form, data = b"bytes", bytes(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic)) and leaf.nbytes <= HOST_CHECKED_BYTES:
            form, data = f"{leaf.dtype.str}{leaf.shape}".encode(), np.ascontiguousarray(leaf).tobytes()
        else:
            continue
        out.append((key, hashlib.blake2b(form + b"\0" + data, digest_size=8).hexdigest()))
    return tuple(out)


def write_values(store: storage.CheckpointStore, planned: Manifest, host: HostDigests, me: int, token: str) -> str:
    """Writes this process's per-process values, if the tree has any, and returns the record
    the leader gets (a short JSON text: sizes, crc32c and digests, never the values)."""
    values = [leaf.value for leaf in planned.leaves if leaf.kind == PER_PROCESS]
    record: dict[str, Any] = {"digests": [_digest(leaf.value) for leaf in planned.leaves if leaf.kind == "value"]}
    if host:
        record["host"] = [digest for _, digest in host]
    if values:
        name, offset, places = values_file_name(me, token), 0, []
        for value in values:
            places.append([offset, len(value), crc32c(value) if value else 0])
            offset += len(value)
        store.write(name, values).result()
        record.update(file=[name, offset], values=places)
    return json.dumps(record, separators=(",", ":"))


def _digest(value: Any) -> str:
    """A Python leaf's value, told apart from any other by 64 bits (its type too: 1, 1.0 and True differ)."""
    return hashlib.blake2b(json.dumps([type(value).__name__, value]).encode(), digest_size=8).hexdigest()


def completed(planned: Manifest, records: dict[int, str], host: HostDigests = ()) -> Manifest:
    """The leader: ``planned`` (merged) with each per-process leaf's values as pieces, one per
    process, and the values files among its files. Raises ProcessValueMismatchError for a
    Python leaf, or a checked host leaf (``host``: the leader's digests), some process saved
    with another value than the leader."""
    decoded = {p: _record(p, text) for p, text in sorted(records.items())}
    _check_values_agree(planned, decoded, host)
    per_process = [n for n, leaf in enumerate(planned.leaves) if leaf.kind == PER_PROCESS]
    if not per_process:
        return planned
    leaves, files = list(planned.leaves), dict(planned.files)
    files.update(record["file"] for record in decoded.values())
    for i, n in enumerate(per_process):
        pieces = tuple(PieceEntry(((p, p + 1),), r["file"][0], *r["values"][i]) for p, r in decoded.items())
        leaves[n] = LeafEntry(planned.leaves[n].key, planned.leaves[n].path, PER_PROCESS, pieces=pieces)
    return dataclasses.replace(planned, leaves=tuple(leaves), files=files)


def _record(process: int, text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("digests"), list):
            raise ValueError(text[:60])
    except ValueError as e:
        raise CorruptCheckpointError(
            f"process {process} sent a malformed save record ({e}); refusing to commit."
        ) from None
    return record


_DIFFERS = {
    "digests": "Leaf {key!r} is a Python value that differs between processes (process {p} saved another value than "
    "the committing process), and a checkpoint keeps one value per Python leaf; nothing was committed. If each "
    "process has its own value (a data iterator's position, say), save it as tc.PerProcess(value); otherwise make "
    "every process save the same value.",
    "host": "Leaf {key!r} (bytes or a small numpy array) differs between processes (process {p} saved another value "
    "than the committing process), and one process writes such a leaf for all: the others' values would be lost; "
    "nothing was committed. If each process has its own value (a data iterator's state, say), save it as "
    "tc.PerProcess(value); otherwise make every process save the same.",
}


def _check_values_agree(planned: Manifest, records: dict[int, dict[str, Any]], host: HostDigests) -> None:
    """Every process saved the leader's tree (the same Python, PerProcess and checked host
    leaves) with the leader's Python values and checked host leaves (``host``: its digests)."""
    values = [leaf for leaf in planned.leaves if leaf.kind == "value"]
    leader = {"digests": [(leaf.key, _digest(leaf.value)) for leaf in values], "host": list(host)}
    per_process = sum(leaf.kind == PER_PROCESS for leaf in planned.leaves)
    for p, record in records.items():
        if len(record.get("values", ())) != per_process or any(
            len(record.get(field, [])) != len(mine) for field, mine in leader.items()
        ):
            raise CheckpointError(
                f"process {p} saved another tree than the committing process (other Python, PerProcess, bytes or "
                "small numpy leaves); refusing to commit. Are all processes saving the same tree?"
            )
        for field, mine in leader.items():
            differing = next((key for (key, a), b in zip(mine, record.get(field, [])) if a != b), None)
            if differing is not None:
                raise ProcessValueMismatchError(_DIFFERS[field].format(key=differing, p=p), key=differing)
