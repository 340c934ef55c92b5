"""Multi-tier CheckpointManager scenarios, run by every process (see tests/support/process_group.py).

Each process works in its own directory, standing in for its host's local SSD (the local tier
path "local" is relative, so no process sees another's); the persistent tier is one directory
every process sees (in production ``gs://``). With 4 processes and ``local_replicas=1``,
process p's part is kept by p and by p + 1 (mod 4).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.mp_scenarios import GLOBAL, _global_array, _job_mesh, _mismatches, _reversed_mesh, _targets
from tpu_ckpt.tiers import _local_steps as local_steps
from tpu_ckpt.tiers import _upload as uploads


def _enter_host(directory: str) -> str:
    """This process's private directory (its host's disk), as the working directory; returns
    the shared persistent directory."""
    local = os.path.join(directory, f"host{jax.process_index()}")
    os.makedirs(local, exist_ok=True)
    os.chdir(local)
    return os.path.join(directory, "persistent")


def _manager(persistent: str, enable_async: bool = True, every: int = 4, keep: int = 2) -> tc.CheckpointManager:
    options = tc.CheckpointOptions(enable_async=enable_async, coordination_timeout=30)
    return tc.CheckpointManager(persistent, save_interval_steps=every, local_directory="local",
                                local_interval_steps=1, local_max_to_keep=keep, local_replicas=1, options=options)


def _state(step: int) -> dict:
    return {"w": _global_array(_job_mesh(), P("data", "model"), GLOBAL + step), "step": step}


def _watch_opens(root: str) -> list[str]:
    """Every file this process opens under ``root`` from now on (a Python audit hook, which
    ``os.open`` and ``open`` both report), relative to it."""
    root = os.path.abspath(root)
    opened: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], str):
            path = os.path.abspath(args[0])
            if path.startswith(root + os.sep):
                opened.append(os.path.relpath(path, root))

    sys.addaudithook(hook)
    return opened


def _restore(manager: tc.CheckpointManager, opened: list[str], step: int) -> dict:
    """Restores the newest step onto the reversed mesh: its values against step ``step``'s,
    and the persistent files this process opened meanwhile."""
    before = len(opened)
    restored = manager.restore(None, _targets(_state(0), _reversed_mesh()))
    return {"step": int(restored["step"]), "mismatches": _mismatches(restored, {"w": GLOBAL + step, "step": step}),
            "persistent_opened": opened[before:]}


def _gated_uploads() -> threading.Event:
    """From now on every upload to the persistent tier waits, before its first byte, until
    the returned event is set: the upload is then provably still running."""
    gate = threading.Event()
    original = uploads._copy

    def copy(*args):
        gate.wait(60)
        return original(*args)

    uploads._copy = copy
    return gate


def _local_steps() -> list[str]:
    return sorted(os.listdir("local")) if os.path.isdir("local") else []


def survivors_and_lost_hosts(directory: str) -> dict:
    """(e) steps 1-4, then step 5 whose upload is held back while steps 6 and 7 are saved
    locally; (a) all hosts alive: step 8 from the local tier; (b) process 2's disk wiped: still
    step 8, its part from its replica on process 3; (c) process 1's disk wiped too (its part's
    only replica was on 2): step 5, from the persistent tier."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    opened = _watch_opens(persistent)
    out: dict = {"process": me}
    manager = _manager(persistent, keep=3)  # step 5 stays on disk through step 7, to compare with its upload
    for step in range(1, 5):
        manager.save(step, _state(step))
    manager.wait_until_finished()
    gate = _gated_uploads()
    manager.save(5, _state(5))  # local step 5, and its upload (held back)
    manager.save(6, _state(6))
    manager.save(7, _state(7))  # waits until local step 6 is committed (not for the upload)
    out["while_uploading"] = {"local": _local_steps(), "persistent": sorted(os.listdir(persistent))}
    gate.set()
    manager.wait_until_finished()
    out["uploaded_same_bytes"] = _same_files(os.path.join("local", "step_5"), os.path.join(persistent, "step_5"), me)
    manager.save(8, _state(8))
    manager.wait_until_finished()
    out["persistent_steps"] = manager.all_steps()
    out["local"] = {name: sorted(os.listdir(os.path.join("local", name))) for name in _local_steps()}
    out["all_alive"] = _restore(manager, opened, 8)
    if me == 2:
        shutil.rmtree("local")  # a replaced host: its local SSD is empty
    out["one_lost"] = _restore(_manager(persistent), opened, 8)
    if me == 1:
        shutil.rmtree("local")
    replaced = _manager(persistent)
    out["latest_two_lost"] = replaced.latest_step()
    out["two_lost"] = _restore(replaced, opened, 5)
    out["plain_restore_mismatches"] = _mismatches(
        tc.restore(os.path.join(persistent, "step_5"), _targets(_state(0), _job_mesh())), {"w": GLOBAL + 5, "step": 5})
    from jax._src.distributed import global_state

    global_state.client.wait_at_barrier("tiers_done", 60_000)  # every process has ended every operation
    out["keys_left"] = [key for key, _ in global_state.client.key_value_dir_get("tpu_ckpt/")]
    return out


def _same_files(local: str, persistent: str, me: int) -> bool:
    """Whether this process's data files in the persistent step are byte for byte its local ones."""
    names = sorted(n for n in os.listdir(local) if n.startswith(f"d{me:05d}-"))
    return bool(names) and all(_read(os.path.join(local, n)) == _read(os.path.join(persistent, n)) for n in names)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def killed_during_a_local_save(directory: str, phase: str) -> dict:
    """``kill``: local steps 1 and 2, then process 1 dies (SIGKILL) during local step 3, with
    its own part written and none of its replicas sent. ``resume``: a new job restores the
    newest whole step, 2, from the local tier, and its next save removes the leftovers."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    manager = _manager(persistent, enable_async=False, every=100)
    if phase == "kill":
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        manager.wait_until_finished()
        if me == 1:
            local_steps._LocalSave._replicate = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        try:
            manager.save(3, _state(3))
        except tc.CheckpointError as e:
            return {"error": type(e).__name__, "local": _local_steps(), "peer_killed": True}
        return {"error": None, "peer_killed": True}
    out = {"before": _local_steps(), "latest": manager.latest_step()}
    out.update(_restore(manager, _watch_opens(persistent), 2))
    manager.save(3, _state(3))
    manager.wait_until_finished()
    out["after"] = _local_steps()
    return out


def shared_local_directory(directory: str) -> dict:
    """Both processes given one local_directory that both see (a shared file system)."""
    persistent = os.path.join(directory, "persistent")
    options = tc.CheckpointOptions(coordination_timeout=30)
    manager = tc.CheckpointManager(persistent, local_directory=os.path.join(directory, "local"), options=options)
    try:
        manager.save(1, _state(1))
    except tc.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def another_process_count(directory: str, phase: str) -> dict:
    """``save``: 4 processes, each part kept by two others (local_replicas=2), local steps 1
    and 2. ``restore``: 2 processes on the disks of hosts 0 and 1, which between them hold
    every part (0 holds 0, 3, 2; 1 holds 1, 0, 3): step 2 from the local tier, onto 8 devices."""
    persistent = _enter_host(directory)
    options = tc.CheckpointOptions(coordination_timeout=30)
    manager = tc.CheckpointManager(persistent, save_interval_steps=100, local_directory="local",
                                   local_replicas=2, options=options)
    if phase == "save":
        manager.save(1, _state(1))
        manager.save(2, _state(2))
        manager.wait_until_finished()
        return {"local": {name: sorted(os.listdir(os.path.join("local", name))) for name in _local_steps()}}
    return _restore(manager, _watch_opens(persistent), 2)


def damaged_index(directory: str, fanout: str = "") -> dict:
    """Local step 1 on 2 processes, its upload removed (so there is nothing to fall back to),
    process 1's part removed from host 0 (its replica: no other holder to take it from);
    process 1 then damages its own part's index (the part it serves, and checks): the restore fails on
    both processes, naming the file, instead of hanging. ``fanout``: the control plane's, set in
    both processes (1: the merge goes through the tree's gatherers and relayers)."""
    from tests.cluster.fanout import set_fanout

    set_fanout(fanout)
    me = jax.process_index()
    persistent = _enter_host(directory)
    manager = _manager(persistent, enable_async=False, every=100)
    manager.save(1, _state(1))
    manager.wait_until_finished()  # the upload of step 1 read the index before it is damaged
    if me == 0:
        shutil.rmtree(os.path.join(persistent, "step_1"))  # process 0 lists for both
        for name in os.listdir(os.path.join("local", "step_1")):
            if name.startswith(("d00001-", "index-00001")):
                os.unlink(os.path.join("local", "step_1", name))
    if me == 1:
        with open(os.path.join("local", "step_1", "index-00001.bin"), "r+b") as f:
            f.seek(10)
            f.write(b"#")
    try:
        manager.restore(None, _targets(_state(0), _job_mesh()))
    except tc.CheckpointError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def async_local_saves_under_a_memory_limit(directory: str) -> dict:
    """Async local steps of 32 MiB per process under host_memory_limit=16 MiB (each process
    writes the files that do not fit before save returns), step 1 also uploaded; restored
    from the local tier, then from the persistent one, onto the reversed mesh."""
    persistent = _enter_host(directory)
    big = np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096) / 7  # 64 MiB in the job
    state = {"w": _global_array(_job_mesh(), P("data", "model"), big), "step": 2}
    options = tc.CheckpointOptions(enable_async=True, coordination_timeout=30, host_memory_limit=16 << 20)
    with tc.CheckpointManager(persistent, save_interval_steps=4, local_directory="local", local_replicas=1,
                              options=options) as manager:
        manager.save(1, {**state, "step": 1})
        manager.save(2, state)
    target = _targets(state, _reversed_mesh())
    with tc.CheckpointManager(persistent, local_directory="local", options=options) as manager:
        local = manager.restore(None, target)
    uploaded = tc.restore(os.path.join(persistent, "step_1"), target)
    return {
        "local": _mismatches(local, {"w": big, "step": 2}), "persistent": _mismatches(uploaded, {"w": big, "step": 1})
    }


def damaged_data_falls_back(directory: str) -> dict:
    """Steps 1-3 on 2 processes, step 1 also persistent; process 1 then flips a byte of its
    own part's data in local step 3: the local restore fails its crc32c there, and every
    process restores persistent step 1 instead."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    with _manager(persistent, enable_async=False, every=4) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    if me == 1:
        name = min(n for n in os.listdir(os.path.join("local", "step_3")) if n.startswith("d00001-"))
        with open(os.path.join("local", "step_3", name), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
    with _manager(persistent, enable_async=False, every=4) as manager:
        restored = manager.restore(None, _targets(_state(0), _job_mesh()))
    return {"step": int(restored["step"]), "mismatches": _mismatches(restored, {"w": GLOBAL + 1, "step": 1})}


def spread_merge(directory: str) -> dict:
    """4 processes, a state of 6 leaves, local step 2 restored: the names each process reads
    through the tier restore's store (its own disk, or a peer's relay), and the values."""
    from tpu_ckpt.tiers import _restore as tier_restore

    persistent = _enter_host(directory)
    state = lambda step: {  # noqa: E731
        **{f"w{i}": _global_array(_job_mesh(), P("data", "model"), GLOBAL + step + i) for i in range(5)}, "step": step
    }
    names: set[str] = set()
    read, read_file = tier_restore._Parts.read, tier_restore._Parts.read_file

    def recorded_read(self, name, *args, **kwargs):
        names.add(name)
        return read(self, name, *args, **kwargs)

    def recorded_read_file(self, name):
        names.add(name)
        return read_file(self, name)

    with _manager(persistent, enable_async=False, every=100) as manager:
        manager.save(1, state(1))
        manager.save(2, state(2))
        tier_restore._Parts.read, tier_restore._Parts.read_file = recorded_read, recorded_read_file
        try:
            restored = manager.restore(None, _targets(state(0), _reversed_mesh()))
        finally:
            tier_restore._Parts.read, tier_restore._Parts.read_file = read, read_file
    expected = {**{f"w{i}": GLOBAL + 2 + i for i in range(5)}, "step": 2}
    return {"step": int(restored["step"]), "mismatches": _mismatches(restored, expected), "names": sorted(names)}
