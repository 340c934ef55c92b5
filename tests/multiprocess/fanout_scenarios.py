"""load_and_broadcast's collective fan-out in real processes (run by tests/support/process_group.py): a
state saved sharded over every device, restored onto a (processes, devices) mesh whose first
axis replicates it across processes; the data bytes each process reads, the relay connections
and the values, bit for bit."""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.distributed import global_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.cluster.control_plane_scenarios import _counted
from tests.support.mp_scenarios import _global_array
from tpu_ckpt import storage
from tpu_ckpt.catalog import read_manifest


def _values(n: int) -> dict[str, np.ndarray]:
    """Leaves of every byte width, with values a float sum would change: -0.0, a NaN payload."""
    rng = np.random.default_rng(0)
    odd = np.array([-0.0, 0.0, np.inf, -np.inf, 1e-45, 1.5], np.float32)
    odd = np.concatenate([odd, np.array([0x7FC00123, 0xFFF00001], np.uint32).view(np.float32)])
    return {
        "w": rng.standard_normal((n * 64, 256)).astype(np.float32),
        "odd": np.tile(odd, n),
        "half": rng.standard_normal((n * 8, 32)).astype(jnp.bfloat16),
        "i8": rng.integers(-128, 127, (n * 4, 8)).astype(np.int8),
        "flag": rng.integers(0, 2, n * 4).astype(bool),
        "x64": rng.standard_normal((n * 4, 4)),
        "small": np.arange(4, dtype=np.float32),
    }


_TARGET_SPECS = {"w": P("model"), "odd": P(), "half": P(None, "model"), "i8": P("model"), "flag": P(),
                 "x64": P("model"), "small": P()}


def _local_store_class(directory: str) -> type:
    """The class of a local directory's store (its reads are what the counters wrap)."""
    with storage.Store(storage.location(directory), threads=1) as probe:
        return type(probe)


def _count_data_reads(LocalStore: type) -> tuple[dict[str, int], object]:  # noqa: N803 - the class it wraps
    """Bytes this process reads from the checkpoint's data files from now on (a real store's
    reads, counted)."""
    got = {"bytes": 0}
    read = LocalStore.read

    def counted(self, name, start, lengths, then=None):
        if name.endswith(".safetensors"):
            got["bytes"] += sum(lengths)
        return read(self, name, start, lengths, then=then)

    LocalStore.read = counted
    return got, read


def _bitwise_mismatches(restored: dict, expected: dict, targets: dict) -> list[str]:
    out = []
    for key, value in expected.items():
        array = restored[key]
        if array.sharding != targets[key].sharding or array.dtype != targets[key].dtype:
            out.append(f"{key}: {array.dtype} on {array.sharding}")
        for shard in array.addressable_shards:
            got = np.ascontiguousarray(np.asarray(shard.data)).view(np.uint8)
            if not np.array_equal(got, np.ascontiguousarray(value[shard.index]).view(np.uint8)):
                out.append(f"{key} shard {shard.index} on {shard.device}")
    return out


def replica_fanout(directory: str) -> dict:
    """Saved over every device, restored replicated across processes: plain and with
    load_and_broadcast; what each read, the relay connections, the values."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    values = _values(len(devices))
    flat = Mesh(np.array(devices), ("all",))
    tree = {key: _global_array(flat, P() if key == "small" else P("all"), value) for key, value in values.items()}
    path = os.path.join(directory, "ckpt")
    tc.save(path, tree)
    grid = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("replica", "model"))
    targets = {key: jax.ShapeDtypeStruct(v.shape, np.float32 if key == "x64" else v.dtype,
                                         sharding=NamedSharding(grid, _TARGET_SPECS[key]))
               for key, v in values.items()}
    expected = {**values, "x64": values["x64"].astype(np.float32)}
    out = {}
    LocalStore = _local_store_class(directory)  # noqa: N806 - a class
    for label, share in (("plain", False), ("shared", True)):
        got, read = _count_data_reads(LocalStore)
        try:
            options = tc.CheckpointOptions(load_and_broadcast=share, coordination_timeout=60)
            restored, out[f"{label}_counts"] = _counted(functools.partial(tc.restore, path, targets, options=options))
        finally:
            LocalStore.read = read
        out[f"{label}_read"] = got["bytes"]
        out[f"{label}_mismatches"] = _bitwise_mismatches(restored, expected, targets)
    # A mesh over half the processes: not every process joins its collective, so the relay serves it.
    half = Mesh(
        np.array(devices[: len(devices) // 2]).reshape(max(1, jax.process_count() // 2), -1), ("replica", "model")
    )
    mixed = {"w": targets["w"], "small": jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(half, P()))}
    restored = tc.restore(path, mixed, options=tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=60))
    out["mixed_mismatches"] = _bitwise_mismatches(restored, {k: expected[k] for k in mixed}, mixed)
    return out


def _restore_error(path: str, target: dict, timeout: float) -> dict | None:
    options = tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=timeout)
    try:
        tc.restore(path, target, options=options)
    except tc.CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "missing": getattr(e, "missing", None)}
    return None


def _flip_first_piece(path: str) -> None:
    """One byte of the first piece of ``w`` changed on disk (its crc32c then fails)."""
    piece = next(e for e in read_manifest(storage.location(path)).leaves if e.key == "w").pieces[0]
    with open(os.path.join(path, piece.file), "r+b") as f:
        f.seek(piece.offset)
        byte = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def fanout_failures(directory: str, timeout: str) -> dict:
    """A corrupt piece, then the last process's storage stalling in the fan-out's reads (past
    the timeout): the others are told at the barrier before the collective, naming it."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    flat = Mesh(np.array(devices), ("all",))
    value = np.arange(len(devices) * 64, dtype=np.float32)
    path = os.path.join(directory, "ckpt")
    tc.save(path, {"w": _global_array(flat, P("all"), value)})
    tc.save(path + "-bad", {"w": _global_array(flat, P("all"), value)})
    if jax.process_index() == 0:
        _flip_first_piece(path + "-bad")
    global_state.client.wait_at_barrier("flipped", 60_000)
    grid = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("replica", "model"))
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(grid, P()))}
    corrupt = _restore_error(path + "-bad", target, 60)
    LocalStore = _local_store_class(directory)  # noqa: N806 - a class
    read = LocalStore.read
    stalled = jax.process_index() == jax.process_count() - 1

    def stalling(self, name, start, lengths, then=None):
        if name.endswith(".safetensors"):
            time.sleep(float(timeout) + 2)
        return read(self, name, start, lengths, then=then)

    if stalled:
        LocalStore.read = stalling
    started = time.monotonic()
    try:
        error = _restore_error(path, target, float(timeout))
    finally:
        LocalStore.read = read
    return {"corrupt": corrupt, "error": error, "seconds": time.monotonic() - started, "stalled": stalled}


def host_targets(directory: str) -> dict:
    """The same state restored with load_and_broadcast onto numpy targets and a Python float
    (every process wants each leaf whole, on its host): the small ones alone, then with ``w``,
    bigger than one device's part of the read batch, ``x64``, which JAX without x64 cannot
    carry, and a big-endian target (those the relay brings). The values bit for bit, the connections, and the bytes
    each process read of the small ones."""
    from tpu_ckpt import settings

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    values = _values(len(devices))
    flat = Mesh(np.array(devices), ("all",))
    tree = {key: _global_array(flat, P() if key == "small" else P("all"), value) for key, value in values.items()}
    path = os.path.join(directory, "ckpt")
    tc.save(path, {**tree, "loss": jax.device_put(np.float32(2.5), NamedSharding(flat, P()))})
    small = {key: np.zeros_like(values[key]) for key in ("odd", "half", "i8", "flag", "small")} | {"loss": 0.0}
    everything = small | {"w": np.zeros_like(values["w"]), "x64": np.zeros_like(values["x64"]),
                          "small": np.zeros(4, ">f4")}  # a byte order JAX has no dtype for: the relay casts it
    expected = {**values, "loss": 2.5}
    options = tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=60)
    previous = settings.configure(settings.Settings(read_batch_bytes=2 * (64 << 10)))  # a device's part: 64 KiB
    out = {}
    LocalStore = _local_store_class(directory)  # noqa: N806 - a class
    try:
        for label, target, want in (("small", small, expected),
                                    ("everything", everything, {**expected, "small": values["small"].astype(">f4")})):
            got, read = _count_data_reads(LocalStore)
            try:
                restore = functools.partial(tc.restore, path, target, options=options)
                restored, out[f"{label}_counts"] = _counted(restore)
            finally:
                LocalStore.read = read
            out[f"{label}_read"] = got["bytes"]
            out[f"{label}_mismatches"] = [
                key for key in target
                if type(restored[key]) is not type(want[key]) or np.asarray(restored[key]).dtype != np.asarray(
                    want[key]).dtype or np.asarray(restored[key]).tobytes() != np.asarray(want[key]).tobytes()
            ]
    finally:
        settings.configure(previous)
    out["small_bytes"] = sum(values[key].nbytes for key in small if key != "loss") + 4
    return out
