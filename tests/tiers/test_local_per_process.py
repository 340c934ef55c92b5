"""tc.PerProcess values in the local tier of a multi-tier CheckpointManager, in a real 2-process
job: each process's value goes into its part (``values-<p>.bin``), is replicated with it and
uploaded with it; a restore from the local tier gives each process its own value, from a
replica when its host's disk is gone, and a 1-process job on one host's disk reshards them.

The scenarios run in every process (tests/support/mp_worker.py imports this module after
``jax.distributed.initialize``); each process's working directory stands in for its host's disk."""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group
from tests.support.process_group import results_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

W = np.arange(32, dtype=np.float32).reshape(8, 4)


def own(process: int, step: int) -> dict:
    return {"process": process, "step": step, "state": bytes([process + 1]) * (4096 + process)}


def _seen(value: dict) -> list:
    """A restored value, told in JSON: whose, of which step, and whether its bytes are that one's."""
    return [value["process"], value["step"], value["state"] == own(value["process"], value["step"])["state"]]


def _manager(persistent: str):
    import tpu_ckpt as tc

    return tc.CheckpointManager(persistent, save_interval_steps=100, local_directory="local", local_max_to_keep=2,
                                local_replicas=1,
                                options=tc.CheckpointOptions(enable_async=True, coordination_timeout=60))


def _tree(step: int) -> dict:
    import tpu_ckpt as tc

    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("x",)), P("x"))
    w = jax.make_array_from_callback(W.shape, sharding, lambda i: W[i] + step)
    return {"w": w, "it": tc.PerProcess(own(jax.process_index(), step)), "cfg": {"lr": 0.5}}


def _enter_host(directory: str) -> str:
    os.makedirs(os.path.join(directory, f"host{jax.process_index()}"), exist_ok=True)
    os.chdir(os.path.join(directory, f"host{jax.process_index()}"))
    return os.path.join(directory, "persistent")


def saved_by_two(directory: str, fanout: str = "") -> dict:
    """``fanout``: the control plane's, in both processes (1: each is its own group, so the parts'
    rows and values records reach the merger through a gatherer, the merged ranges come back
    through a relayer: tiers/_merge_tree.py)."""
    import tpu_ckpt as tc
    from tests.cluster.fanout import set_fanout

    set_fanout(fanout)

    me, persistent = jax.process_index(), _enter_host(directory)
    with _manager(persistent) as manager:
        for step in (1, 2, 3):
            manager.save(step, _tree(step))
        manager.wait_until_finished()
        files = sorted(n for n in os.listdir(os.path.join("local", "step_3")) if n.startswith("values-"))
        alive = manager.restore(None, {"it": tc.PerProcess(), "cfg": {"lr": 0.0}})
        persistent_steps = manager.all_steps()
    uploaded = tc.restore(os.path.join(persistent, "step_1"), {"it": tc.PerProcess()})["it"]
    if me == 1:
        shutil.rmtree("local")  # a replaced host: its disk is empty
    with _manager(persistent) as manager:
        step = manager.latest_step()
        lost = manager.restore(None, {"it": tc.PerProcess()})["it"]
    return {"process": me, "files": files, "alive": [_seen(alive["it"]), alive["cfg"]],
            "persistent_steps": persistent_steps, "uploaded": _seen(uploaded), "latest_after_loss": step,
            "lost": _seen(lost)}


def restored_by_one(directory: str) -> dict:
    """One process on host 0's disk, which holds its own part and process 1's replica."""
    import tpu_ckpt as tc

    def reshard(values, process_index, process_count):
        return {
            "from": [(v["process"], v["step"], len(v["state"])) for v in values], "as": [process_index, process_count]
        }

    with _manager(_enter_host(directory)) as manager:
        return {
            "step": manager.latest_step(), "it": manager.restore(None, {"it": tc.PerProcess(reshard=reshard)})["it"]
        }


@pytest.mark.parametrize("fanout", ["", "1"], ids=["flat", "tree"])
def test_per_process_values_live_in_the_local_tier_its_replicas_and_its_uploads(tmp_path, fanout):
    results = process_group.run("tiers.test_local_per_process.saved_by_two", 2, str(tmp_path), fanout,
                                devices_per_process=2)
    for res in results_of(results):
        me = res["process"]
        assert res["files"] == ["values-00000.bin", "values-00001.bin"]  # its own, and its peer's replica
        assert res["alive"] == [[me, 3, True], {"lr": 0.5}]  # local step 3 (the persistent tier has step 1)
        assert res["persistent_steps"] == [1] and res["uploaded"] == [me, 1, True]
        assert res["latest_after_loss"] == 3 and res["lost"] == [me, 3, True]  # process 1's from its replica on 0
    (res,) = results_of(
        process_group.run("tiers.test_local_per_process.restored_by_one", 1, str(tmp_path), devices_per_process=2)
    )
    assert res["step"] == 3
    assert res["it"] == {"from": [[0, 3, 4096], [1, 3, 4097]], "as": [0, 1]}  # both saved values, in process order


def test_a_per_process_leaf_restored_by_another_process_count_is_raised_not_fallen_back_from():
    """Restoring a local step with a tc.PerProcess leaf in another process count without
    ``reshard`` is the target's mistake: the persistent tier would refuse it the same way, so
    the tier restore raises it for the step asked for rather than falling back."""
    from tpu_ckpt.errors import CorruptCheckpointError, ProcessCountMismatchError, RemoteProcessError
    from tpu_ckpt.tiers._fallback import recoverable

    assert not recoverable(ProcessCountMismatchError("it", key="it", saved_count=2, process_count=1))
    assert not recoverable(RemoteProcessError("process 1: ...", remote_type="ProcessCountMismatchError"))
    assert recoverable(CorruptCheckpointError("a part is damaged"))
