"""Multislice local tiers, run by every process (see tests/support/process_group.py): 4 processes as
2 simulated slices (``TPU_CKPT_SLICES=0,0,1,1``, set by the test: CPU devices report no
slice), with state sharded inside each slice and replicated across the two, as data
parallelism across slices lays it out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.mp_scenarios import GLOBAL, _global_array, _mismatches, _targets
from tests.tiers.tier_fallback_scenarios import _Warnings
from tests.tiers.tier_scenarios import _enter_host, _watch_opens
from tpu_ckpt import relay


def _slice_mesh() -> jax.sharding.Mesh:
    """(2 slices, 8 devices): each slice's row holds processes 0-1 or 2-3's devices."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(2, -1), ("slice", "model"))


def _state(step: int) -> dict:
    return {"w": _global_array(_slice_mesh(), P("model"), GLOBAL + step), "step": step}


def _counting_sends() -> list[int]:
    """Bytes this process sends to other hosts' relay servers from now on."""
    sent = [0]
    original = relay.RelayStore.write

    def write(self, name, chunks):
        sent[0] += sum(len(memoryview(c).cast("B")) if not hasattr(c, "nbytes") else int(c.nbytes) for c in chunks)
        return original(self, name, chunks)

    relay.RelayStore.write = write
    return sent


def whole_slice_lost(directory: str) -> dict:
    """Local steps 1-3 (step 1 also persistent), then slice 1's hosts (processes 2 and 3)
    lose their local directories: step 3 comes from slice 0's hosts, no persistent file read."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    sent = _counting_sends()
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=30)
    with tc.CheckpointManager(persistent, save_interval_steps=4, local_directory="local", local_replicas=1,
                              options=options) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    out: dict = {"sent_per_step": sent[0] / 3, "local": sorted(os.listdir(os.path.join("local", "step_3")))}
    with open(os.path.join("local", "step_3", "tier.json")) as f:
        out["copy"] = json.load(f)["copy"]
    target = _targets(_state(0), _slice_mesh())
    restored = tc.restore(os.path.join(persistent, "step_1"), target)
    out["persistent_1"] = _mismatches(restored, {"w": GLOBAL + 1, "step": 1})
    if me in (2, 3):
        shutil.rmtree("local")  # the slice was recreated: its hosts' RAM disks are empty
    opened = _watch_opens(persistent)
    with tc.CheckpointManager(persistent, save_interval_steps=4, local_directory="local", local_replicas=1,
                              options=options) as manager:
        restored = manager.restore(None, target)
        on_host = manager.restore(None, {"w": np.zeros_like(GLOBAL), "step": 0})  # numpy: by the collective too
    out.update(step=int(restored["step"]), mismatches=_mismatches(restored, {"w": GLOBAL + 3, "step": 3}),
               persistent_opened=opened)
    out["host_mismatches"] = [] if np.array_equal(on_host["w"], GLOBAL + 3) and on_host["step"] == 3 else [on_host]
    return out


def one_slice_warns(directory: str) -> dict:
    """A job on one slice: a manager with local replicas warns that they share the slice's
    fate; local_replicas=0 is accepted, without the warning."""
    persistent = _enter_host(directory)
    warnings = _Warnings()
    logging.getLogger("tpu_ckpt").addHandler(warnings)
    out = {}
    for replicas in (1, 0):
        tc.CheckpointManager(persistent, local_directory="local", local_replicas=replicas).close()
        out[str(replicas)] = [m for m in warnings.messages if "slice restart" in m]
    return out


def _counting_reads() -> dict[str, int]:
    """Bytes this process asks other hosts' relay servers for from now on: of data files
    (``data``: a part's pieces) and of everything else (``other``: plans, rows, manifests)."""
    from tpu_ckpt.format import written_by

    got = {"data": 0, "other": 0}
    read, read_file = relay.RelayStore.read, relay.RelayStore.read_file

    def kind(name: str) -> str:
        return "data" if written_by(name) is not None and not name.startswith("index-") else "other"

    def counted_read(self, name, start, lengths, then=None):
        got[kind(name)] += sum(lengths)
        return read(self, name, start, lengths, then)

    def counted_read_file(self, name):
        data = read_file(self, name)
        got[kind(name)] += 0 if data is None else len(data)
        return data

    relay.RelayStore.read, relay.RelayStore.read_file = counted_read, counted_read_file
    return got


def every_slice_own_copy(directory: str) -> dict:
    """Local step 3 saved as slice copies; restored with every copy whole (each slice reads
    its own disks, and its processes complete the leaf replicated on every device by one
    collective inside the slice), then again after slice 1's hosts lost theirs (only they are
    filled, from slice 0): the bytes each process asked other hosts for, both times."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=30)

    def manager() -> tc.CheckpointManager:
        return tc.CheckpointManager(persistent, save_interval_steps=10, local_directory="local", local_replicas=1,
                                    options=options)

    def state(step: int) -> dict:  # and a leaf replicated on every device, each slice's copy in one part
        return {**_state(step), "b": _global_array(_slice_mesh(), P(), GLOBAL[:2] + step)}

    with manager() as saving:
        for step in (1, 2, 3):
            saving.save(step, state(step))
    target = {**_targets(_state(0), _slice_mesh()), "b": jax.ShapeDtypeStruct(
        GLOBAL[:2].shape, GLOBAL.dtype, sharding=jax.sharding.NamedSharding(_slice_mesh(), P()))}
    out: dict = {}
    for case in ("intact", "slice_1_wiped"):
        if case == "slice_1_wiped" and me in (2, 3):
            shutil.rmtree("local")
        got = _counting_reads()
        with manager() as restoring:
            restored = restoring.restore(None, target)
        out[case] = {**got, "step": int(restored["step"]),
                     "mismatches": _mismatches(restored, {"w": GLOBAL + 3, "b": GLOBAL[:2] + 3, "step": 3})}
        relay.RelayStore.read, relay.RelayStore.read_file = _ORIGINAL_READS
    return out


_ORIGINAL_READS = (relay.RelayStore.read, relay.RelayStore.read_file)


def host_lost_with_two_processes(directory: str) -> dict:
    """2 processes per simulated host (``TPU_CKPT_HOSTS=0,0,1,1``, set by the test), one
    replica each: no part is kept on its owner's host, so host 0 losing both its processes'
    disks still leaves local step 2 whole on host 1."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("model",))
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=30)

    def manager() -> tc.CheckpointManager:
        return tc.CheckpointManager(persistent, save_interval_steps=10, local_directory="local", local_replicas=1,
                                    options=options)

    def state(step: int) -> dict:
        return {"w": _global_array(mesh, P("model"), GLOBAL + step), "step": step}

    with manager() as saving:
        for step in (1, 2):
            saving.save(step, state(step))
    out = {"indexes": sorted(n for n in os.listdir(os.path.join("local", "step_2")) if n.startswith("index-"))}
    if me in (0, 1):
        shutil.rmtree("local")  # host 0 is replaced: both its processes' RAM disks are empty
    with manager() as restoring:
        restored = restoring.restore(None, _targets(state(0), mesh))
    out.update(step=int(restored["step"]), mismatches=_mismatches(restored, {"w": GLOBAL + 2, "step": 2}))
    return out
