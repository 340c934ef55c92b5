"""Scenarios run by every process of a multi-process test (see tests/support/process_group.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

GLOBAL = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
BIG = np.arange(2 << 20, dtype=np.float32).reshape(1024, 2048)  # 8 MiB: big enough to split between holders


def _global_array(mesh: jax.sharding.Mesh, spec: P, value: np.ndarray = GLOBAL) -> jax.Array:
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def _shard_mismatches(array: jax.Array, value: np.ndarray, key: str = "") -> list[str]:
    """Each addressable shard that differs from ``value``, described (empty when all match):
    the test prints what differed, not ``False``."""
    return [
        f"{key} shard {s.index} on {s.device}: {np.asarray(s.data).ravel()[:6]} != {value[s.index].ravel()[:6]}"
        for s in array.addressable_shards
        if not np.array_equal(np.asarray(s.data), value[s.index])
    ]


def save_and_restore_across_meshes(directory: str) -> dict:
    """Save on a (4,2) mesh; restore on a mesh whose devices are reversed, so each process
    needs pieces the other one wrote."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    zero_mesh = jax.sharding.Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("x",))
    tree = {
        # Only on process 0's devices, and first in flatten order: every process must still
        # make the same write-balance choices for the replicated leaves after it.
        "a_on_zero": _global_array(zero_mesh, P("x"), np.arange(1 << 18, dtype=np.float32)),
        "w": _global_array(mesh, P("data", "model")),
        "replicated": _global_array(mesh, P(), np.arange(6, dtype=np.int32)),
        "big_replicated": _global_array(mesh, P(), BIG),
        "step": 42,
    }
    path = os.path.join(directory, "ckpt")
    result = tc.save(path, tree)
    assert result.wait() == path
    assert os.path.exists(os.path.join(path, "manifest.json"))  # visible right after wait()
    files = sorted(os.listdir(path))
    reversed_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
    target = {
        "w": jax.ShapeDtypeStruct(
            GLOBAL.shape, GLOBAL.dtype, sharding=NamedSharding(reversed_mesh, P("model", "data"))
        ),
        "replicated": jax.ShapeDtypeStruct((6,), np.int32, sharding=NamedSharding(reversed_mesh, P())),
        "big_replicated": jax.ShapeDtypeStruct(BIG.shape, BIG.dtype, sharding=NamedSharding(reversed_mesh, P("data"))),
        "a_on_zero": jax.ShapeDtypeStruct((1 << 18,), np.float32, sharding=NamedSharding(reversed_mesh, P())),
        "step": 0,
    }
    before = {s.device.id for s in tree["w"].addressable_shards}
    try:
        tc.save(
            os.path.join(directory, "bad"), tree, options=tc.CheckpointOptions(sharding_callback=_ReturnsGlobalArrays())
        )
        altered_task_error = ""
    except tc.InvalidShardsError as e:
        altered_task_error = str(e)
    restored = tc.restore(path, target)
    everything = tc.restore(path)
    return {
        "process": jax.process_index(),
        "files": files,
        "mismatches": _shard_mismatches(restored["w"], GLOBAL, "w")
        + _shard_mismatches(restored["replicated"], np.arange(6, dtype=np.int32), "replicated")
        + _shard_mismatches(restored["big_replicated"], BIG, "big_replicated")
        + _shard_mismatches(restored["a_on_zero"], np.arange(1 << 18, dtype=np.float32), "a_on_zero")
        + ([] if np.array_equal(everything["w"], GLOBAL) else ["w restored to numpy differs"]),
        "step": restored["step"],
        "needs_other_process_pieces": _needs_pieces_of_other_processes(tree["w"], restored["w"]),
        "saved_device_ids": sorted(before),
        "altered_task_error": altered_task_error,
    }


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def _needs_pieces_of_other_processes(saved: jax.Array, restored: jax.Array) -> bool:
    """Whether some local shard of ``restored`` overlaps a region another process saved."""
    others = [
        _region(index, saved.shape)
        for device, index in saved.sharding.devices_indices_map(saved.shape).items()
        if device.process_index != jax.process_index()
    ]
    mine = [_region(s.index, saved.shape) for s in restored.addressable_shards]
    overlap = lambda a, b: all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))  # noqa: E731
    return any(overlap(a, b) for a in mine for b in others)


class _ReturnsGlobalArrays(tc.ShardingCallback):
    """Invalid: hands back the whole (multi-process) array instead of this process's piece."""

    description = "returns global arrays"

    def __init__(self):
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        self.replicated = _global_array(mesh, P(), np.arange(6, dtype=np.int32))

    def __call__(self, pieces):
        return [{p.checkpoint_key: {p.slice_spec: self.replicated}} for p in pieces if p.checkpoint_key == "replicated"]


class _FailsOnProcessOne(tc.ShardingCallback):
    description = "fails on process 1"

    def __call__(self, pieces):
        if jax.process_index() == 1:
            raise RuntimeError("callback failed on process 1")
        return [{p.checkpoint_key: {p.slice_spec: p.tensor}} for p in pieces]


def one_process_fails(directory: str) -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tree = {"w": _global_array(mesh, P("data", "model"))}
    options = tc.CheckpointOptions(sharding_callback=_FailsOnProcessOne(), coordination_timeout=180)
    started = time.monotonic()
    try:
        tc.save(os.path.join(directory, "ckpt"), tree, options=options)
    except Exception as e:  # noqa: BLE001 - the scenario reports what was raised
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    return {"error": None}


def straggler(directory: str, *late: str) -> dict:
    """The processes named in ``late`` (default: 1) arrive long after the timeout."""
    mesh = _job_mesh()
    tree = {"w": _global_array(mesh, P("data", "model"))}
    if jax.process_index() in ({int(p) for p in late} or {1}):
        time.sleep(8)
    options = tc.CheckpointOptions(coordination_timeout=3)
    try:
        tc.save(os.path.join(directory, "ckpt"), tree, options=options)
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e), "missing": getattr(e, "missing", None)}
    return {"error": None}


def async_save_with_buffers_deleted(directory: str) -> dict:
    """An async save whose device buffers are deleted the moment save returns; the
    background writers of both processes still commit a complete checkpoint."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = _global_array(mesh, P("data", "model"))
    path = os.path.join(directory, "ckpt")
    result = tc.save(path, {"w": w}, options=tc.CheckpointOptions(enable_async=True))
    w.delete()
    result.wait()
    restored = tc.restore(
        path, {"w": jax.ShapeDtypeStruct(GLOBAL.shape, GLOBAL.dtype, sharding=NamedSharding(mesh, P("model")))}
    )
    return {"mismatches": _shard_mismatches(restored["w"], GLOBAL, "w")}


def _job_mesh() -> jax.sharding.Mesh:
    """A (devices/2, 2) mesh over every device of the job, whatever the process count."""
    return jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))


def _reversed_mesh() -> jax.sharding.Mesh:
    """The same shape with the device order reversed: each process needs others' pieces."""
    return jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, -1), ("data", "model"))


def _bytes_written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def _targets(tree: dict, mesh: jax.sharding.Mesh) -> dict:
    return {
        key: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, P("model")))
        if isinstance(value, jax.Array) else 0
        for key, value in tree.items()
    }


def _mismatches(restored: dict, values: dict) -> list[str]:
    """What differs between ``restored`` and the expected ``values``, described."""
    out: list[str] = []
    for key, value in values.items():
        if isinstance(value, np.ndarray):
            out += _shard_mismatches(restored[key], value, key)
        elif restored[key] != value:
            out.append(f"{key}: {restored[key]!r} != {value!r}")
    return out


def io_device_save_and_restore(directory: str, io: str) -> dict:
    """Each process works in its own directory, standing in for its host's local disk: the
    relative checkpoint path exists only on the io_device process. Saves (sync, and async
    with the buffers deleted at once) and restores onto a reversed mesh with io_device;
    restores with io_device a checkpoint written without it on shared storage."""
    me, io = jax.process_index(), int(io)
    local = os.path.join(directory, f"host{me}")
    os.makedirs(local)
    os.chdir(local)
    mesh = _job_mesh()
    values = {"w": GLOBAL, "big_replicated": BIG, "step": 7}
    tree = {
        "w": _global_array(mesh, P("data", "model")),
        "big_replicated": _global_array(mesh, P(), BIG),
        "step": 7,
    }
    options = tc.CheckpointOptions(io_device=f"/job:worker/task:{io}", coordination_timeout=60)
    before = _bytes_written()
    tc.save("ckpt", tree, options=options)
    written = _bytes_written() - before
    copy = {key: (value + 0 if isinstance(value, jax.Array) else value) for key, value in tree.items()}
    result = tc.save("ckpt_async", copy, options=options.replace(enable_async=True))
    for value in copy.values():
        if isinstance(value, jax.Array):
            value.delete()
    result.wait()
    targets = _targets(tree, _reversed_mesh())
    restored = tc.restore("ckpt", targets, options=tc.CheckpointOptions(io_device=io))
    restored_async = tc.restore("ckpt_async", targets, options=tc.CheckpointOptions(io_device=io))
    shared = os.path.join(directory, "shared")
    tc.save(shared, tree)
    from_shared = tc.restore(shared, targets, options=tc.CheckpointOptions(io_device=io))
    try:
        tc.restore("missing", targets, options=tc.CheckpointOptions(io_device=io))
        missing_error = None
    except tc.CheckpointError as e:
        missing_error = type(e).__name__
    return {
        "process": me,
        "bytes_written_by_save": written,
        "local_files": sorted(os.listdir(local)),
        "mismatches": (
            _mismatches(restored, values) + _mismatches(restored_async, values) + _mismatches(from_shared, values)
        ),
        "needs_other_process_pieces": _needs_pieces_of_other_processes(tree["w"], restored["w"]),
        "missing_error": missing_error,
    }


def save_to_unshared_local_disks(directory: str) -> dict:
    """Each process in its own directory (its host's local disk) saves to the same relative
    path without io_device; then a checkpoint only process 0's disk holds (saved with
    io_device=0) is restored with load_and_broadcast."""
    me = jax.process_index()
    local = os.path.join(directory, f"host{me}")
    os.makedirs(local)
    os.chdir(local)
    tree = {"w": _global_array(_job_mesh(), P("data", "model"), BIG), "step": 1}  # 4 MiB per process
    out = {"process": me}
    before = _bytes_written()
    try:
        tc.save("ckpt", tree, options=tc.CheckpointOptions(coordination_timeout=60))
        out["save_error"] = None
    except tc.CheckpointError as e:
        out.update(save_error=type(e).__name__, save_message=str(e))
    out["bytes_written_by_save"] = _bytes_written() - before
    tc.save("only_on_0", tree, options=tc.CheckpointOptions(io_device=0, coordination_timeout=60))
    try:
        tc.restore("only_on_0", options=tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=60))
        out["restore_error"] = None
    except tc.CheckpointError as e:
        out.update(restore_error=type(e).__name__, restore_message=str(e))
    return out


def save_restore_many_processes(directory: str) -> dict:
    """Any number of processes: save on the job mesh, restore onto the reversed one, and
    report the bytes each process wrote for a tree dominated by replicated arrays; then an
    async save whose device buffers are deleted as soon as ``save`` returns."""
    mesh = _job_mesh()
    replicated = {f"r{i}": np.full((512, 1024), i, np.float32) for i in range(4)}  # 4 x 2 MiB, on every device
    values = {"w": GLOBAL, "big_replicated": BIG, **replicated}
    tree = {key: _global_array(mesh, P("data", "model") if key == "w" else P(), v) for key, v in values.items()}
    path = os.path.join(directory, "ckpt")
    before = _bytes_written()
    tc.save(path, tree, options=tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(1 << 20)))
    written = _bytes_written() - before
    restored = tc.restore(path, _targets(tree, _reversed_mesh()))
    copy = {key: value + 0 for key, value in tree.items()}
    result = tc.save(path + "_async", copy, options=tc.CheckpointOptions(enable_async=True))
    for value in copy.values():
        value.delete()  # the snapshot was taken: the device buffers may go at once
    result.wait()
    restored_async = tc.restore(path + "_async", _targets(tree, _reversed_mesh()))
    return {
        "process": jax.process_index(),
        "bytes_written": written,
        "mismatches": _mismatches(restored, values) + _mismatches(restored_async, values),
        "needs_other_process_pieces": _needs_pieces_of_other_processes(tree["w"], restored["w"]),
    }


class _KillsProcessOne(tc.ShardingCallback):
    description = "kills process 1"

    def __call__(self, pieces):
        if jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return [{p.checkpoint_key: {p.slice_spec: p.tensor}} for p in pieces]


def peer_killed_before_commit(directory: str, io: str = "") -> dict:
    """Process 1 dies (SIGKILL) in the middle of a save; the survivors must raise within
    the coordination timeout and commit nothing."""
    mesh = _job_mesh()
    tree = {"w": _global_array(mesh, P("data", "model"))}
    options = tc.CheckpointOptions(
        sharding_callback=_KillsProcessOne(), coordination_timeout=10, io_device=int(io) if io else None
    )
    started = time.monotonic()
    try:
        tc.save(os.path.join(directory, "ckpt"), tree, options=options)
    except Exception as e:  # noqa: BLE001 - the scenario reports what was raised
        return {"error": type(e).__name__, "message": str(e), "missing": getattr(e, "missing", None),
                "seconds": time.monotonic() - started, "peer_killed": True}
    return {"error": None, "peer_killed": True}


def _manager_loop(manager: tc.CheckpointManager, mesh: jax.sharding.Mesh, last: int) -> tuple[list[int], dict]:
    """Saves steps 1..last (``w`` = GLOBAL + step), waits, and returns the steps kept and the
    latest restored onto the reversed mesh."""
    for step in range(1, last + 1):
        manager.save(step, {"w": _global_array(mesh, P("data", "model"), GLOBAL + step), "step": step})
    manager.wait_until_finished()
    target = {
        "w": jax.ShapeDtypeStruct(GLOBAL.shape, GLOBAL.dtype, sharding=NamedSharding(_reversed_mesh(), P())), "step": 0
    }
    return manager.all_steps(), manager.restore(target=target)


def io_device_manager(directory: str, io: str) -> dict:
    """A CheckpointManager whose directory exists only on the io_device process's "local
    disk": every process sees the same steps, restores the latest, and retention runs there."""
    me, io = jax.process_index(), int(io)
    os.makedirs(os.path.join(directory, f"host{me}"))
    os.chdir(os.path.join(directory, f"host{me}"))
    mesh = _job_mesh()
    options = tc.CheckpointOptions(io_device=io, enable_async=True, coordination_timeout=60)
    with tc.CheckpointManager("run", max_to_keep=2, options=options) as manager:
        steps, restored = _manager_loop(manager, mesh, 3)
    return {
        "steps": steps,
        "mismatches": _mismatches(restored, {"w": GLOBAL + 3, "step": 3}),
        "local": sorted(os.listdir(".")) + (sorted(os.listdir("run")) if os.path.isdir("run") else []),
    }


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def load_and_broadcast_restore(directory: str) -> dict:
    """A replicated-heavy checkpoint restored with and without load_and_broadcast: the bytes
    each process reads from storage (rchar counts file reads, not sockets) and the values."""
    mesh = _job_mesh()
    replicated = {f"r{i}": np.full((512, 1024), i, np.float32) for i in range(4)}
    values = {"w": GLOBAL, "big_replicated": BIG, **replicated}
    tree = {key: _global_array(mesh, P("data", "model") if key == "w" else P(), v) for key, v in values.items()}
    path = os.path.join(directory, "ckpt")
    tc.save(path, {**tree, "host": np.arange(1 << 18, dtype=np.float32), "step": 3})
    targets = {key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for key, v in tree.items()}
    targets.update(host=np.zeros(1 << 18, np.float32), step=0)
    out = {"process": jax.process_index()}
    for label, share in (("plain", False), ("shared", True)):
        before = _bytes_read()
        restored = tc.restore(path, targets, options=tc.CheckpointOptions(load_and_broadcast=share))
        out[f"{label}_read"] = _bytes_read() - before
        out[f"{label}_mismatches"] = _mismatches(restored, {**values, "step": 3}) + (
            [] if np.array_equal(restored["host"], np.arange(1 << 18, dtype=np.float32)) else ["host differs"]
        )
    if jax.process_index() == 1:  # a wrong target on one process: the others hear of it at once
        targets["host"] = np.zeros(3, np.float32)
    started = time.monotonic()
    try:
        tc.restore(path, targets, options=tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=120))
        out["mismatch_error"] = None
    except tc.CheckpointError as e:
        out["mismatch_error"] = type(e).__name__
    out["mismatch_seconds"] = time.monotonic() - started
    return out


def coordination_keys_are_deleted(directory: str) -> dict:
    """Every kind of coordinated operation, one failing on process 1, then what the
    coordination service still holds under tpu_ckpt/ once all processes are past them."""
    from jax._src.distributed import global_state

    mesh = _job_mesh()
    tree = {"w": _global_array(mesh, P("data", "model")), "big_replicated": _global_array(mesh, P(), BIG)}
    target = {
        key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(_reversed_mesh(), P()))
        for key, v in tree.items()
    }
    tc.save(os.path.join(directory, "sync"), tree)  # the first save into a directory proves it shared
    tc.save(os.path.join(directory, "async"), tree, options=tc.CheckpointOptions(enable_async=True)).wait()
    tc.save(os.path.join(directory, "io"), tree, options=tc.CheckpointOptions(io_device=1))
    for options in (tc.CheckpointOptions(load_and_broadcast=True), tc.CheckpointOptions(io_device=1)):
        tc.restore(os.path.join(directory, "sync"), target, options=options)
    try:
        tc.save(
            os.path.join(directory, "fails"), tree, options=tc.CheckpointOptions(sharding_callback=_FailsOnProcessOne())
        )
        failed = None
    except Exception as e:  # noqa: BLE001 - the scenario reports what was raised
        failed = type(e).__name__
    options = tc.CheckpointOptions(io_device=1, enable_async=True)
    with tc.CheckpointManager(
        os.path.join(directory, "run"), max_to_keep=2, save_interval_seconds=0, options=options
    ) as manager:
        for step in range(1, 4):
            manager.save(step, tree)
        manager.wait_until_finished()
        manager.restore(target=target)
    global_state.client.wait_at_barrier("coordination_keys_are_deleted", 60_000)  # all have finished every operation
    return {"failed": failed, "keys": [key for key, _ in global_state.client.key_value_dir_get("tpu_ckpt/")]}


def _watch_storage(directory: str) -> list[list[str]]:
    """From now on, notes in the returned list every listing (``os.scandir``, ``os.listdir``:
    ``os.walk`` and every local listing go through them) and every tree removal
    (``shutil.rmtree``) this process makes of ``directory`` or anything under it, as
    ``[event, path relative to directory]``.

    A Python audit hook: the interpreter's own report of the calls it makes to the OS, not a
    stand-in for them; it cannot be removed, so only scenarios, each in its own process, use it.
    Calls on a file descriptor (inside ``shutil.rmtree``) name no path and are not noted."""
    root = os.path.abspath(directory)
    seen: list[list[str]] = []

    def hook(event: str, args: tuple) -> None:
        if event in ("os.scandir", "os.listdir", "shutil.rmtree") and args and isinstance(args[0], str):
            path = os.path.abspath(args[0])
            if path == root or path.startswith(root + os.sep):
                seen.append([event, os.path.relpath(path, root)])

    sys.addaudithook(hook)
    return seen


def manager_lists_on_the_leader_only(directory: str) -> dict:
    """A manager loop on shared storage (async saves, max_to_keep=2, a leftover ``step_0``
    left by the test), every process noting what it lists and removes under the run directory
    (``_watch_storage``): which process lists, how often, and how deep."""
    run = os.path.join(directory, "run")
    seen = _watch_storage(run)
    mesh = _job_mesh()
    with tc.CheckpointManager(run, max_to_keep=2, options=tc.CheckpointOptions(enable_async=True)) as manager:
        steps, restored = _manager_loop(manager, mesh, 4)
    return {"process": jax.process_index(), "steps": steps, "seen": seen,
            "mismatches": _mismatches(restored, {"w": GLOBAL + 4, "step": 4})}


def pod_like(directory: str, late: str) -> dict:
    """One job doing what a pod's does, whatever its shape (test_multiprocess.py runs 16 x 1
    and 4 x 2 devices): a save restored onto the reversed mesh; the same through the last
    process as io_device; a manager loop with retention, noting what each process lists
    (``_watch_storage``); then a save that process ``late`` reaches only once the others
    have given up on it."""
    late, last = int(late), jax.process_count() - 1
    mesh, reversed_mesh = _job_mesh(), _reversed_mesh()
    values = {"w": GLOBAL, "replicated": np.arange(16, dtype=np.int32), "step": 7}
    tree = {
        "w": _global_array(mesh, P("data", "model")), "replicated": _global_array(mesh, P(), values["replicated"]),
        "step": 7,
    }
    targets = _targets(tree, reversed_mesh)
    tc.save(os.path.join(directory, "ckpt"), tree)
    restored = tc.restore(os.path.join(directory, "ckpt"), targets)
    io = tc.CheckpointOptions(io_device=last)
    tc.save(os.path.join(directory, "io"), tree, options=io)
    through_io = tc.restore(os.path.join(directory, "io"), targets, options=io)
    run = os.path.join(directory, "run")
    seen = _watch_storage(run)
    with tc.CheckpointManager(run, max_to_keep=2, options=tc.CheckpointOptions(enable_async=True)) as manager:
        for step in range(1, 4):
            manager.save(step, {**tree, "step": step})
        manager.wait_until_finished()
        steps = manager.all_steps()
        latest = manager.restore(target=targets)
    return {
        "process": jax.process_index(),
        "mismatches": (
            _mismatches(restored, values) + _mismatches(through_io, values)
            + _mismatches(latest, {**values, "step": 3})
        ),
        "needs_other_process_pieces": _needs_pieces_of_other_processes(tree["w"], restored["w"]),
        "steps": steps,
        "seen": seen,
        **_save_with_a_straggler(os.path.join(directory, "late"), tree, late),
    }


def _save_with_a_straggler(path: str, tree: dict, late: int, **options: Any) -> dict:
    """A save (with ``coordination_timeout``) that process ``late`` starts only once the
    leader (process 0) has reported giving up on it, in the coordination service: late for
    sure, however slow the machine, and no later than needed: the leader may still be removing
    the staging area, where the late process then writes. (Only once the leader has: the late
    one, failing to write there, learns why only from the leader's report.)

    Its directory was proved shared by an earlier save, so every process waits for the late
    one at the same stage (all written). At the proof of a new directory the others wait
    for the leader's verdict, and with three processes or more one of them may time out on
    the leader before the leader times out on the late one, naming the leader. The timeout is
    generous: a process waiting on the leader names the late one only if the leader's own
    timeout ends at most a few seconds after its own (``Coordinator._blocking_get``), and on
    a loaded machine the leader may start waiting that much later than the others."""
    from jax._src.distributed import global_state

    if jax.process_index() == late:
        while not any(key.endswith("/error/0") for key, _ in global_state.client.key_value_dir_get("tpu_ckpt/")):
            time.sleep(0.01)
    try:
        tc.save(path, tree, options=tc.CheckpointOptions(coordination_timeout=20, **options))
    except Exception as e:  # noqa: BLE001 - the scenario reports what was raised
        return {"late_error": type(e).__name__, "late_missing": getattr(e, "missing", None), "late_message": str(e)}
    return {"late_error": None}


def straggler_while_the_staging_area_is_removed(directory: str, files: str) -> dict:
    """``_save_with_a_straggler`` where the leader's removal of the staging area is slow and
    the late process has many files to write: once the leader has created the staging area,
    a thread of the leader's fills a subdirectory of it with ``files`` empty files (a slow
    file system, in effect), and the sharding callback cuts each process's part into 256
    files. The late process then writes while the leader removes the staging area. A save
    before it proves the directory shared, as in ``pod_like``."""
    value = np.arange(1 << 19, dtype=np.float32).reshape(512, 1024)  # 1 MiB per process
    tree = {"w": _global_array(_job_mesh(), P("model"), value)}
    tc.save(os.path.join(directory, "ckpt"), tree)
    if jax.process_index() == 0:
        threading.Thread(target=_fill_the_staging_area, args=(directory, int(files)), daemon=True).start()
    many_files = tc.MaxShardSizePolicy(4 << 10)
    return _save_with_a_straggler(
        os.path.join(directory, "late"), tree, jax.process_count() - 1, sharding_callback=many_files
    )


def _fill_the_staging_area(directory: str, files: int) -> None:
    while not (staging := [n for n in os.listdir(directory) if n.startswith("late.tmp-")]):
        time.sleep(0.01)
    slow = os.path.join(directory, staging[0], "slow")
    try:
        os.mkdir(slow)
        for i in range(files):
            os.close(os.open(os.path.join(slow, f"{i}"), os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:  # the leader removed the staging area first
        pass


def exec_file(directory: str, code_path: str) -> dict:
    """Runs a Python file on every process, in ``directory`` (shared by all of them): used by
    tests/test_readme.py for the README's multi-host examples. An exception fails the process."""
    os.chdir(directory)
    with open(code_path) as f:
        source = f.read()
    exec(compile(source, code_path, "exec"), {"__name__": "__main__"})
    return {"ok": True, "process": jax.process_index()}


class _CountingClient:
    """JAX's real distributed-runtime client, with every call counted by method name."""

    def __init__(self, client):
        self.client, self.calls = client, {}

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*args, **kwargs)

        return counted


def coordination_calls_while_waiting(directory: str, late_seconds: str) -> dict:
    """A save and an io_device restore with the last process ``late_seconds`` late to each,
    and the coordination calls each process made in them: a wait blocks in the service, so
    the count must not grow with how long it waits."""
    from jax._src.distributed import global_state

    mesh = _job_mesh()
    tree = {"w": _global_array(mesh, P("data", "model"))}
    target = {"w": jax.ShapeDtypeStruct(GLOBAL.shape, GLOBAL.dtype, sharding=NamedSharding(_reversed_mesh(), P()))}
    late = jax.process_index() == jax.process_count() - 1
    path = os.path.join(directory, "ckpt")
    tc.save(path, tree)  # the first save into a directory proves it shared: not counted
    real, global_state.client = global_state.client, _CountingClient(global_state.client)
    try:
        if late:
            time.sleep(float(late_seconds))
        tc.save(path + "-2", tree, options=tc.CheckpointOptions(coordination_timeout=60))
        if late:
            time.sleep(float(late_seconds))
        restored = tc.restore(path + "-2", target, options=tc.CheckpointOptions(io_device=0, coordination_timeout=60))
        calls = global_state.client.calls
    finally:
        global_state.client = real
    return {"calls": calls, "mismatches": _shard_mismatches(restored["w"], GLOBAL)}
