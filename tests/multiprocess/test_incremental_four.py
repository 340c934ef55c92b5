"""Incremental saves in a real 4-process JAX job (2 CPU devices each, gloo): frozen arrays
sharded over all 8 devices, so every leaf spans processes, are passed unchanged as the same
jax.Array objects, and a trained part changes every step. Each save after the first writes
about the trained part alone; retention (max_to_keep=2) keeps the files that kept steps
reference; every kept step restores bit-exactly, on the saved layout and on another mesh.

``incremental_loop`` is the scenario each process runs (tests/support/mp_worker.py imports this
module after ``jax.distributed.initialize``)."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import helpers, process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PROCESSES, DEVICES_PER_PROCESS, STEPS = 4, 2, 5
FROZEN = {  # key -> (values, spec on the (data, model) mesh)
    "embed": (np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024), P(("data", "model"))),
    "tower": ((np.arange(512 * 512) % 251).astype(ml_dtypes.bfloat16).reshape(512, 512), P("data", "model")),
    "norm": (np.linspace(-1, 1, 1024, dtype=np.float32), P()),  # replicated on every process
}
TRAINED_SPECS = {"adapter": P("data", None), "mu": P(None, "model"), "nu": P(("model", "data"))}
SAVED_SPECS = {**{key: spec for key, (_, spec) in FROZEN.items()}, **TRAINED_SPECS}
# The restore onto another layout: devices reversed, the mesh transposed, the specs crossed.
OTHER_SPECS = {
    "embed": P("model", "data"), "tower": P(None, ("data", "model")), "norm": P("model"),
    "adapter": P(None, "data"), "mu": P(("data", "model")), "nu": P("model"),
}


def trained(step: int) -> dict[str, np.ndarray]:
    """The trained part at ``step``: other values every step (an adapter and its Adam state)."""
    rng = np.random.default_rng(step)
    return {key: rng.standard_normal((512, 64), dtype=np.float32) for key in TRAINED_SPECS}


def trained_bytes() -> int:
    return sum(value.nbytes for value in trained(0).values())


def expected(step: int) -> dict[str, np.ndarray]:
    return {**{key: value for key, (value, _) in FROZEN.items()}, **trained(step)}


def _global(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _written(step_dir: str) -> int:
    """Every byte on disk in the step's own directory: data files, piece tables, manifest."""
    return sum(os.path.getsize(os.path.join(step_dir, name)) for name in os.listdir(step_dir))


def _check(restored: dict, step: int, specs: dict, mesh: jax.sharding.Mesh) -> None:
    """Each local shard of each leaf bit for bit against the step's values, on ``specs``."""
    assert int(restored["step"]) == step, restored["step"]
    for key, value in expected(step).items():
        array = restored[key]
        assert array.sharding.is_equivalent_to(NamedSharding(mesh, specs[key]), value.ndim), (key, array.sharding)
        assert array.dtype == value.dtype, (key, array.dtype)
        for shard in array.addressable_shards:
            assert (helpers.bits(shard.data) == helpers.bits(value[shard.index])).all(), (key, step, shard.index)


def _target(mesh: jax.sharding.Mesh, specs: dict) -> dict:
    return {
        **{
            key: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[key]))
            for key, v in expected(0).items()
        },
        "step": 0,
    }


def _save_loop(manager, run: str, mesh: jax.sharding.Mesh) -> dict[int, int]:
    """STEPS saves: the frozen arrays made once and passed as they are, the trained part anew."""
    from jax.experimental import multihost_utils

    frozen = {key: _global(value, NamedSharding(mesh, spec)) for key, (value, spec) in FROZEN.items()}
    written = {}
    for step in range(STEPS):
        new = {key: _global(value, NamedSharding(mesh, TRAINED_SPECS[key])) for key, value in trained(step).items()}
        manager.save(step, {**frozen, **new, "step": step})
        manager.wait_until_finished()
        multihost_utils.sync_global_devices(f"incremental_four saved {step}")  # every process's files are there
        written[step] = _written(os.path.join(run, f"step_{step}"))
    return written


def incremental_loop(directory: str) -> dict:
    import tpu_ckpt as tc

    mesh = jax.make_mesh((PROCESSES, DEVICES_PER_PROCESS), ("data", "model"))
    run = os.path.join(directory, "run")
    with tc.CheckpointManager(run, max_to_keep=2, incremental=True) as manager:
        written = _save_loop(manager, run, mesh)
        steps = manager.all_steps()
    for step in range(1, STEPS):
        assert written[step] <= 1.05 * trained_bytes(), (step, written, trained_bytes())
    assert steps == [STEPS - 2, STEPS - 1], steps
    manager = tc.CheckpointManager(run, max_to_keep=2, incremental=True)  # a new job's view of the run
    assert manager.all_steps() == steps
    for step in steps:
        _check(manager.restore(step, _target(mesh, SAVED_SPECS)), step, SAVED_SPECS, mesh)
    other = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(DEVICES_PER_PROCESS, PROCESSES), ("model", "data"))
    restored = tc.restore(os.path.join(run, f"step_{steps[-1]}"), _target(other, OTHER_SPECS))
    _check(restored, steps[-1], OTHER_SPECS, other)
    return {"process": jax.process_index(), "steps": steps, "written": written}


def test_four_processes_save_incrementally_and_every_kept_step_restores(tmp_path):
    results = process_group.run(
        "multiprocess.test_incremental_four.incremental_loop", PROCESSES, str(tmp_path),
        timeout=600, devices_per_process=DEVICES_PER_PROCESS,
    )
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    assert sorted(r.result["process"] for r in results) == list(range(PROCESSES))
    frozen_bytes = sum(value.nbytes for value, _ in FROZEN.values())
    assert frozen_bytes >= 10 * trained_bytes()
    for r in results:
        written = {int(step): n for step, n in r.result["written"].items()}
        assert written[0] >= frozen_bytes + trained_bytes(), written
        for step in range(1, STEPS):  # the trained part is written, the frozen part is not
            assert trained_bytes() <= written[step] <= 1.05 * trained_bytes(), (step, written)
    # The retired step 0 keeps only what steps 3 and 4 reference (the frozen part's files), unlisted.
    assert sorted(os.listdir(tmp_path / "run")) == ["step_0", "step_3", "step_4"]
    assert not (tmp_path / "run" / "step_0" / "manifest.json").exists()
