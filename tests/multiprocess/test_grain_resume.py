"""A real Grain pipeline (a shuffled, batched ``grain.MapDataset``, sharded by process) in a real
2-process JAX job (gloo) under ``CheckpointManager`` with async saves, SIGKILLed mid-run:

- resumed by 2 processes, it yields exactly the batches the uninterrupted run yields, bit
  for bit, with the same PRNG stream and the same trained state;
- resumed by 1 and by 4 processes with the reshard function docs/per_process.md gives for
  index-based sampling, every record of the epoch is trained on exactly once (the trained
  state counts each record it saw), and the PRNG stream goes on where it stopped;
- the same job run by 4 processes and killed, resumed by 2: the same.

The scenarios run in every process (tests/support/mp_worker.py imports this module after
``jax.distributed.initialize``); each process has one CPU device.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
grain = pytest.importorskip("grain")  # the [grain] extra, which `make test` installs

RECORDS, BATCH, SEED = 24, 2, 5  # 6 steps of 2 x 2 records; divisible by 1, 2 and 4 processes
KILL_AT = 3  # the step whose async save is in flight when the job is killed
CONFIG = {"lr": 0.5, "records": RECORDS}


def dataset(start: int, stride: int):
    """This process's part of the epoch: positions start, start + stride, ... of the shuffled
    order, in batches (the last one short when the part does not fill it)."""
    return grain.MapDataset.range(RECORDS).shuffle(seed=SEED)[start::stride].map(np.int32).batch(BATCH)


def documented_reshard():
    """``reshard_index_sampling`` exactly as docs/per_process.md gives it (with its ``BATCH``)."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "per_process.md")) as f:
        page = f.read()
    source = re.search(r"^BATCH = .*?^def reshard_index_sampling\(.*?(?=^\S)", page, re.MULTILINE | re.DOTALL)
    assert source is not None, "docs/per_process.md no longer gives reshard_index_sampling"
    namespace: dict = {}
    exec(source[0], namespace)  # noqa: S102 - the page's own code
    assert namespace["BATCH"] == BATCH
    return namespace["reshard_index_sampling"]


def _step_function(replicated: NamedSharding):
    def step(state: dict, batch: jax.Array) -> dict:
        key, sub = jax.random.split(state["rng"])
        noise = jax.random.normal(sub, state["w"].shape, jnp.float32)
        w = state["w"] * 0.5 + noise + jnp.mean(batch.astype(jnp.float32)) * CONFIG["lr"]
        return {"w": w, "seen": state["seen"].at[batch].add(1), "rng": key}

    return jax.jit(step, out_shardings=replicated)


def _fresh_state(replicated: NamedSharding) -> dict:
    def init() -> dict:
        return {"w": jnp.zeros(8, jnp.float32), "seen": jnp.zeros(RECORDS, jnp.int32), "rng": jax.random.key(SEED)}

    return jax.jit(init, out_shardings=replicated)()


def _target(replicated: NamedSharding) -> dict:
    import tpu_ckpt as tc

    shapes = jax.eval_shape(lambda: _fresh_state(replicated))
    state = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in shapes.items()}
    return {"state": state, "data": tc.PerProcess(reshard=documented_reshard()), "config": {"lr": 0.0, "records": 0}}


def _host(array: jax.Array) -> np.ndarray:
    return np.asarray(array.addressable_shards[0].data)


def _die_together(directory: str, me: int, count: int) -> None:
    """Every process SIGKILLs itself once all have reached this point (a job preempted as a
    whole), while the step's async save is still in flight."""
    open(os.path.join(directory, f"dying-{me}"), "w").close()
    while not all(os.path.exists(os.path.join(directory, f"dying-{p}")) for p in range(count)):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)


def train(directory: str, kill_at: str = "") -> dict:
    """The training loop: resumes from the newest step if there is one, then trains to the
    end of the epoch, saving every step asynchronously (and dies at ``kill_at``)."""
    import tpu_ckpt as tc

    me, count = jax.process_index(), jax.process_count()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated, by_process = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    step_function = _step_function(replicated)
    options = tc.CheckpointOptions(enable_async=True)
    with tc.CheckpointManager(os.path.join(directory, "run"), max_to_keep=2, options=options) as manager:
        step = manager.latest_step()
        if step is None:
            position = {"start": me, "stride": count, "iterator": {"next_index": 0}}
            state, step = _fresh_state(replicated), 0
        else:
            back = manager.restore(step, _target(replicated))
            assert back["config"] == CONFIG, back["config"]
            state, position = back["state"], back["data"]
        resumed_from, log = step, []
        iterator = iter(dataset(position["start"], position["stride"]).to_iter_dataset())
        iterator.set_state(position["iterator"])
        for batch in iterator:
            step += 1
            key = _host(jax.random.key_data(state["rng"]))
            state = step_function(state, jax.make_array_from_process_local_data(by_process, batch))
            log.append(
                {"step": step, "batch": batch.tolist(), "key": key.tolist(), "w": _host(state["w"]).tobytes().hex()}
            )
            position = {"start": position["start"], "stride": position["stride"], "iterator": iterator.get_state()}
            manager.save(step, {"state": state, "data": tc.PerProcess(position), "config": CONFIG})
            if step == int(kill_at or -1):
                _die_together(directory, me, count)
        manager.wait_until_finished()
    return {
        "process": me, "resumed_from": resumed_from, "log": log, "seen": _host(state["seen"]).tolist(),
        "rng": _host(jax.random.key_data(state["rng"])).tolist(), "w": _host(state["w"]).tobytes().hex(),
    }


def uninterrupted_then_killed(directory: str) -> dict:
    """The whole epoch in ``directory``/whole, its log kept on disk; then the same job in
    ``directory``/killed, killed at step KILL_AT (this returns nothing)."""
    whole = train(os.path.join(directory, "whole"))
    with open(os.path.join(directory, "whole", f"result-{whole['process']}.json"), "w") as f:
        json.dump(whole, f)
    killed = os.path.join(directory, "killed")
    os.makedirs(killed, exist_ok=True)
    return train(killed, str(KILL_AT))


def killed_by_four(directory: str) -> dict:
    """The same job with 4 processes (3 steps of 8 records), killed at step 2 (this returns nothing)."""
    return train(os.path.join(directory, "killed"), "2")


def _succeeded(results: list[process_group.ProcessResult]) -> list[dict]:
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    return sorted((r.result for r in results), key=lambda result: result["process"])


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """The uninterrupted 2-process run's results, and the killed run's directory (kept as the
    kill left it: each test resumes a copy)."""
    root = tmp_path_factory.mktemp("grain")
    results = process_group.run(
        "multiprocess.test_grain_resume.uninterrupted_then_killed", 2, str(root), timeout=300, devices_per_process=1
    )
    for r in results:
        assert r.returncode == -signal.SIGKILL and r.result is None, r.output[-4000:]
    whole = []
    for p in range(2):
        with open(root / "whole" / f"result-{p}.json") as f:
            whole.append(json.load(f))
    return whole, root / "killed"


def _resume(killed, tmp_path, processes: int) -> list[dict]:
    copy = tmp_path / f"resumed-by-{processes}"
    shutil.copytree(killed, copy, ignore=shutil.ignore_patterns("dying-*"))
    results = process_group.run(
        "multiprocess.test_grain_resume.train", processes, str(copy), timeout=300, devices_per_process=1
    )
    return _succeeded(results)


def test_killed_grain_job_resumes_with_exactly_the_uninterrupted_batches(killed_job, tmp_path):
    whole, killed = killed_job
    assert [len(w["log"]) for w in whole] == [RECORDS // BATCH // 2] * 2
    resumed = _resume(killed, tmp_path, 2)
    for before, after in zip(whole, resumed):
        start = after["resumed_from"]
        assert KILL_AT - 2 <= start <= KILL_AT, start  # a committed step, at most the one in flight
        assert after["log"] == before["log"][start:]  # the same batches, keys and trained weights, bit for bit
        assert (after["seen"], after["rng"], after["w"]) == (before["seen"], before["rng"], before["w"])
    assert whole[0]["seen"] == [1] * RECORDS


@pytest.mark.parametrize("processes", [1, 4])
def test_killed_grain_job_resharded_sees_every_record_once(killed_job, tmp_path, processes):
    whole, killed = killed_job
    resumed = _resume(killed, tmp_path, processes)
    start = resumed[0]["resumed_from"]
    assert KILL_AT - 2 <= start <= KILL_AT, start
    assert all(r["seen"] == [1] * RECORDS for r in resumed), resumed[0]["seen"]  # trained on each record once
    read_after = sorted(x for r in resumed for line in r["log"] for x in line["batch"])
    read_before = sorted(x for w in whole for line in w["log"][:start] for x in line["batch"])
    assert sorted(read_before + read_after) == list(range(RECORDS))
    assert resumed[0]["log"][0]["key"] == whole[0]["log"][start]["key"]  # the PRNG stream goes on


def test_a_grain_job_killed_with_four_processes_resumes_with_two(killed_job, tmp_path):
    """4 -> 2: the 4-process run's records per step differ from the 2-process run's, so the
    check is the trained state's count of each record (saved with the weights) and the PRNG
    stream, which is one key per step whatever the process count."""
    whole, _ = killed_job
    results = process_group.run(
        "multiprocess.test_grain_resume.killed_by_four", 4, str(tmp_path), timeout=300, devices_per_process=1
    )
    for r in results:
        assert r.returncode == -signal.SIGKILL and r.result is None, r.output[-4000:]
    resumed = _resume(tmp_path / "killed", tmp_path, 2)
    start = resumed[0]["resumed_from"]
    assert 1 <= start <= 2, start  # a step of the 4-process run, so the values were resharded 4 -> 2
    assert all(r["seen"] == [1] * RECORDS for r in resumed), resumed[0]["seen"]  # each record trained once
    assert resumed[0]["log"][0]["key"] == whole[0]["log"][start]["key"]  # the PRNG stream goes on
