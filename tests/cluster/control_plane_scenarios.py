"""The restores' control plane counted per process (run by tests/support/process_group.py at several
process counts): the coordination service's key-value calls and the relay connections each
process opens and accepts, for a tier restore and a load_and_broadcast restore of a small
state (one sharded array, one replicated, a host value)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax._src.distributed import global_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.cluster.fanout import set_fanout
from tests.support.mp_scenarios import GLOBAL, _global_array, _mismatches
from tests.tiers.tier_scenarios import _enter_host
from tpu_ckpt import relay, settings


class _CountingClient:
    """JAX's distributed client, each method call counted."""

    def __init__(self, client):
        self.client, self.calls = client, 0

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def _counting_connections() -> dict[str, int]:
    """Relay connections this process opens (past the handshake) and accepts from now on."""
    got = {"opened": 0, "accepted": 0}
    connect, admit = relay.RelayStore._connect, relay.RelayServer._admit

    def counted_connect(self):
        conn = connect(self)
        got["opened"] += 1
        return conn

    def counted_admit(self, conn, deadline):
        admitted = admit(self, conn, deadline)
        got["accepted"] += int(admitted)
        return admitted

    relay.RelayStore._connect, relay.RelayServer._admit = counted_connect, counted_admit
    return got


def _counted(restore) -> tuple[dict, dict[str, int]]:
    client = _CountingClient(global_state.client)
    global_state.client = client
    originals = relay.RelayStore._connect, relay.RelayServer._admit
    got = _counting_connections()
    try:
        restored = restore()
    finally:
        global_state.client = client.client
        relay.RelayStore._connect, relay.RelayServer._admit = originals
    return restored, {"kv_calls": client.calls, **got}


def _relayed(restore):
    """``restore`` with a read batch of one byte: every numpy target here (all of more than a
    byte) is then bigger than a device's part of it, so the relay brings it rather than the
    collective (restoring/_fanout.py ``_on_devices``)."""

    def relayed():
        previous = settings.configure(settings.Settings(read_batch_bytes=1))
        try:
            return restore()
        finally:
            settings.configure(previous)

    return relayed


def control_plane_counts(directory: str) -> dict:
    """A local step (each process's part and one replica) restored by the tier, and the same
    state saved to ``directory`` restored with load_and_broadcast: the counts of each."""
    persistent = _enter_host(directory)
    mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("model",))
    state = {"w": _global_array(mesh, P("model")), "b": _global_array(mesh, P(), GLOBAL[:1]), "step": 3}
    expected = {"w": GLOBAL, "b": GLOBAL[:1], "step": 3}
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, v.sharding.spec))
               for k, v in state.items() if isinstance(v, jax.Array)} | {"step": 0}
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=60)
    out = {}
    with tc.CheckpointManager(persistent, save_interval_steps=10, local_directory="local", local_replicas=1,
                              options=options) as manager:
        manager.save(3, state)
        restored, out["tier"] = _counted(lambda: manager.restore(None, targets))
    out["tier_mismatches"] = _mismatches(restored, expected)
    path = os.path.join(directory, "ckpt")
    tc.save(path, state)
    shared = tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=60)
    restored, out["shared"] = _counted(lambda: tc.restore(path, targets, options=shared))
    out["shared_mismatches"] = _mismatches(restored, expected)
    on_host = {"w": np.zeros_like(GLOBAL), "b": np.zeros_like(GLOBAL[:1]), "step": 0}  # numpy targets
    restored, out["shared_host"] = _counted(_relayed(lambda: tc.restore(path, on_host, options=shared)))
    out["shared_host_mismatches"] = [key for key, value in expected.items() if not np.array_equal(restored[key], value)]
    return out



def fanout_counts(directory: str, fanout: str) -> dict:
    """With the control plane's fan-out set to ``fanout`` (as every process must): a local step
    of 6 sharded leaves, a step and each process's own value (``tc.PerProcess``: every part's
    values record goes to one merger) restored by the tier (no leaf replicated across processes:
    each process's connections are then the merge's alone), and the same state (values aside) saved to
    ``directory`` restored onto numpy targets with load_and_broadcast (every process needs every
    piece; :func:`_relayed`: the relay's path). The counts of each, and whether they are bit-exact."""
    set_fanout(fanout)
    persistent = _enter_host(directory)
    mesh = jax.sharding.Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("model",))
    state = {f"w{i}": _global_array(mesh, P("model"), GLOBAL + i) for i in range(6)} | {"step": 3}
    expected = {f"w{i}": GLOBAL + i for i in range(6)} | {"step": 3}
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, v.sharding.spec))
               for k, v in state.items() if isinstance(v, jax.Array)} | {"step": 0}
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=60)
    out = {}
    mine = {"process": jax.process_index(), "cursor": b"x" * (100 + jax.process_index())}  # a data iterator's state
    with tc.CheckpointManager(persistent, save_interval_steps=10, local_directory="local", local_replicas=1,
                              options=options) as manager:
        manager.save(3, {**state, "it": tc.PerProcess(mine)})
        restored, out["tier"] = _counted(lambda: manager.restore(None, {**targets, "it": tc.PerProcess()}))
    out["tier_mismatches"] = _mismatches(restored, expected) + ([] if restored["it"] == mine else ["it"])
    path = os.path.join(directory, "ckpt")
    tc.save(path, state)
    shared = tc.CheckpointOptions(load_and_broadcast=True, coordination_timeout=60)
    on_host = {k: np.zeros_like(v) for k, v in expected.items() if isinstance(v, np.ndarray)} | {"step": 0}
    restored, out["shared_host"] = _counted(_relayed(lambda: tc.restore(path, on_host, options=shared)))
    out["shared_host_mismatches"] = [key for key, value in expected.items() if not np.array_equal(restored[key], value)]
    return out
