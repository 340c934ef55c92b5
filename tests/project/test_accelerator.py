"""The accelerator tier: device-to-host paths as they run where numpy cannot view a device
buffer (JAX's fetched host copies, donation while an async save reads, host_memory_limit on
device memory). Runs on whatever non-CPU backend JAX finds; skipped on CPU, where those paths
are not the ones that run. ``TPU_CKPT_ACCELERATOR_TIER_ON_CPU=1`` runs it on CPU devices too
(to check the tests themselves). ``scripts/accelerator_check.sh`` runs it with the benchmark.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.flax_mlp import X, Y, new_state, train_step
from tests.support.helpers import bits

ON_CPU = os.environ.get("TPU_CKPT_ACCELERATOR_TIER_ON_CPU") == "1"
pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(
        jax.default_backend() == "cpu" and not ON_CPU,
        reason="needs a non-CPU JAX backend (TPU or GPU); run scripts/accelerator_check.sh there",
    ),
]


def exact(tree):
    """Every leaf's raw bytes, for bit-exact comparisons of whole trees."""
    return jax.tree.map(lambda x: bits(x).tobytes(), tree)


def devices():
    return jax.devices()[:4] if ON_CPU else jax.devices()


def on_devices(state):
    """``state`` on the accelerator's devices: 2-D leaves split by rows where they divide."""
    mesh = jax.make_mesh((len(devices()),), ("data",), devices=devices())

    def put(x):
        spec = P("data") if np.ndim(x) >= 1 and np.shape(x)[0] % len(devices()) == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, state)


def abstract(state, sharding=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding), state)


def test_a_sharded_train_state_restores_bit_exactly_on_the_same_devices_and_on_the_host_cpus(tmp_path):
    state = on_devices(train_step(new_state(optax.adamw(1e-2)), X, Y)[0])
    tc.save(tmp_path / "c", state).wait()
    same = tc.restore(tmp_path / "c", abstract(state))
    assert exact(same) == exact(state)
    assert same.params["params"]["Dense_0"]["kernel"].sharding == state.params["params"]["Dense_0"]["kernel"].sharding
    cpus = (
        jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices("cpu")[:8]) if len(jax.devices("cpu")) >= 8
        else None
    )
    elsewhere = (
        NamedSharding(cpus, P()) if cpus is not None else jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    )
    moved = tc.restore(tmp_path / "c", abstract(state, elsewhere))
    assert exact(moved) == exact(state)


def test_an_async_save_keeps_its_snapshot_while_the_next_step_donates_the_state(tmp_path):
    state = on_devices(new_state(optax.sgd(0.1)))
    step = jax.jit(lambda s: s.apply_gradients(grads=jax.tree.map(jnp.ones_like, s.params)), donate_argnums=0)
    saved_bits = exact(state)
    result = tc.save(tmp_path / "c", state, options=tc.CheckpointOptions(enable_async=True))
    after = step(state)  # donates the buffers the save was given
    after = step(after)
    result.wait()
    assert exact(tc.restore(tmp_path / "c", abstract(after))) == saved_bits


def test_one_host_copy_per_save_and_host_memory_limit_on_device_memory(tmp_path):
    """A sync save's host memory stays within 1.2x the state (one host copy at most, each let
    go once written); under host_memory_limit a save and a restore stay within it."""
    limit, megabytes = 128 << 20, 512
    probe = os.path.join(os.path.dirname(__file__), "accelerator_probe.py")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, probe, str(tmp_path), str(megabytes), str(limit)],
                         capture_output=True, text=True, check=True, env=env)
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    assert peaks["sync_save"] <= 1.2 * peaks["state_bytes"], peaks
    assert peaks["bounded_save"] <= limit + (64 << 20), peaks
    assert peaks["bounded_restore"] <= peaks["state_bytes"] + limit + (64 << 20), peaks
    assert peaks["restored_exactly"] and peaks["restored_on"], peaks


def test_a_skip_slot_restore_reads_the_params_and_keeps_the_targets_slots(tmp_path):
    state = on_devices(train_step(new_state(optax.adam(1e-2)), X, Y)[0])
    tc.save(tmp_path / "c", state).wait()
    fresh = on_devices(new_state(optax.adam(1e-2)))
    out = tc.restore(tmp_path / "c", abstract(fresh), options=tc.CheckpointOptions(skip_slot_variables=True))
    assert exact(out.params) == exact(state.params)
    assert out.opt_state[0].mu == abstract(fresh).opt_state[0].mu  # given back as the target had it


def test_a_local_tier_step_restores_bit_exactly(tmp_path):
    state = on_devices(train_step(new_state(optax.adamw(1e-2)), X, Y)[0])
    with tc.CheckpointManager(tmp_path / "run", save_interval_steps=100, local_directory=tmp_path / "local",
                              local_interval_steps=1) as manager:
        assert manager.save(1, state)
        manager.wait_until_finished()
        assert manager.all_steps() == [1] and os.path.isdir(tmp_path / "local")
        restored = manager.restore(1, abstract(state))
    assert exact(restored) == exact(state)
