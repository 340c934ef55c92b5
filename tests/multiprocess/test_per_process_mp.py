"""tc.PerProcess, typed keys and differing Python values in a real 2-process JAX job (gloo),
and the 2 -> 1 restore of what it saved (this pytest process is a 1-process job).

``per_process_job`` is the scenario each process runs (tests/support/mp_worker.py imports this module
after ``jax.distributed.initialize``)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

W = np.arange(64, dtype=np.float32).reshape(8, 8)
KEY_DATA = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), 8)))


def own_value(process: int) -> dict:
    """What process ``process`` keeps for itself: an iterator position and a 1 MiB state."""
    return {"next_index": [96, 129][process], "state": bytes([process + 1]) * (1 << 20), "seen": np.arange(process + 2)}


def per_process_job(directory: str) -> dict:
    import tpu_ckpt as tc

    me = jax.process_index()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    w = jax.make_array_from_callback(W.shape, sharding, lambda i: W[i])
    data = jax.make_array_from_callback(KEY_DATA.shape, sharding, lambda i: KEY_DATA[i])
    keys = jax.random.wrap_key_data(data)
    path = os.path.join(directory, "c")
    same = {"tok": b"same on every process", "rng": np.array([1, 2], np.uint32)}  # host leaves: checked, equal
    tc.save(path, {"w": w, "keys": keys, "it": tc.PerProcess(own_value(me)), "cfg": {"lr": 0.5}, "step": 3,
                   **same}).wait()
    target = {
        "w": jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=sharding),
        "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=sharding),
        "it": tc.PerProcess(),
    }
    back = tc.restore(path, target)
    plain = tc.restore(path)["it"]
    options = tc.CheckpointOptions(enable_async=True)
    with tc.CheckpointManager(os.path.join(directory, "run"), options=options) as manager:
        state = {"next_index": me}
        manager.save(0, {"w": w, "it": tc.PerProcess(state)})
        state["next_index"] = -1
        manager.wait_until_finished()
        managed = manager.restore(0, {"w": target["w"], "it": tc.PerProcess()})["it"]
    relayed_path = os.path.join(directory, "relayed")  # io_device: the others write their values through the leader
    tc.save(
        relayed_path, {"w": w, "it": tc.PerProcess(own_value(me))}, options=tc.CheckpointOptions(io_device=0)
    ).wait()
    relayed = tc.restore(relayed_path, {"it": tc.PerProcess()}, options=tc.CheckpointOptions(io_device=0))["it"]
    try:
        tc.save(os.path.join(directory, "bad"), {"w": w, "cfg": {"name": f"process-{me}"}}).wait()
        refused = None
    except tc.CheckpointError as error:
        refused = f"{type(error).__name__}: {error}"
    forgotten = {}  # an iterator's state saved without tc.PerProcess: one process's would be kept
    for kind, state in (("bytes", f"next_index={96 + 33 * me}".encode()), ("numpy", np.array([me, 7]))):
        try:
            tc.save(os.path.join(directory, f"bad-{kind}"), {"w": w, "it_state": state}).wait()
            forgotten[kind] = None
        except tc.CheckpointError as error:
            forgotten[kind] = f"{type(error).__name__}: {error}"
    return {
        "same_host_leaves": tc.restore(path)["tok"] == same["tok"],
        "forgotten": forgotten,
        "process": me,
        "own_value": back["it"]["next_index"] == own_value(me)["next_index"]
        and back["it"]["state"] == own_value(me)["state"]
        and np.array_equal(back["it"]["seen"], own_value(me)["seen"]),
        "plain_is_own": plain["next_index"] == own_value(me)["next_index"],
        "keys_typed_exact": back["keys"].dtype == keys.dtype and all(
            np.array_equal(np.asarray(s.data), KEY_DATA[s.index])
            for s in jax.random.key_data(back["keys"]).addressable_shards
        ),
        "managed": managed,
        "relayed": relayed["state"] == own_value(me)["state"],
        "refused": refused,
        "bad_committed": os.path.exists(os.path.join(directory, "bad")),
    }


def test_two_processes_save_their_own_values_and_one_restores_them(tmp_path):
    import tpu_ckpt as tc

    results = process_group.run("multiprocess.test_per_process_mp.per_process_job", 2, str(tmp_path), timeout=600)
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    for r in results:
        me = r.result["process"]
        assert r.result["own_value"] and r.result["plain_is_own"] and r.result["keys_typed_exact"], r.result
        assert r.result["relayed"], r.result
        assert r.result["managed"] == {"next_index": me}  # the value as given to save, not as changed after
        assert not r.result["bad_committed"] and r.result["refused"] is not None
    leader = next(r.result for r in results if r.result["process"] == 0)
    assert leader["refused"].startswith("ProcessValueMismatchError") and "'cfg/name'" in leader["refused"]
    assert "tc.PerProcess" in leader["refused"]
    assert all(r.result["same_host_leaves"] for r in results)
    for kind, refused in leader["forgotten"].items():  # bytes and small numpy leaves that differ: refused too
        assert refused is not None and refused.startswith("ProcessValueMismatchError"), (kind, refused)
        assert "'it_state'" in refused and "tc.PerProcess" in refused, refused
    assert all(value is not None for r in results for value in r.result["forgotten"].values())
    assert not (tmp_path / "bad-bytes").exists() and not (tmp_path / "bad-numpy").exists()

    path = tmp_path / "c"
    meta = tc.metadata(path)["it"]
    assert meta.process_count == 2 and all(size > 1 << 20 for size in meta.sizes)
    with pytest.raises(tc.ProcessCountMismatchError, match=r"'it'.* 2 processes.* has 1") as caught:
        tc.restore(path)
    assert (caught.value.key, caught.value.saved_count, caught.value.process_count) == ("it", 2, 1)
    report = tc.check_restore(path)
    assert not report.ok and any("'it'" in p and "2 processes" in p for p in report.problems)

    def reshard(values, process_index, process_count):  # index-based sampling: resume after the furthest
        assert (process_index, process_count) == (0, 1)
        return {"next_index": max(v["next_index"] for v in values), "states": [v["state"][:1] for v in values]}

    key_type = jax.random.key(0).dtype
    back = tc.restore(
        path, {"it": tc.PerProcess(reshard=reshard), "keys": jax.ShapeDtypeStruct((8,), key_type), "step": 0}
    )
    assert back["it"] == {"next_index": 129, "states": [b"\x01", b"\x02"]} and back["step"] == 3
    assert back["keys"].dtype == key_type
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(back["keys"])), KEY_DATA)


def reshard_one_to_two(directory: str) -> dict:
    import tpu_ckpt as tc

    def split(values, process_index, process_count):  # one saved stream, dealt out by stride
        (saved,) = values
        return {"start": saved["next_index"] + process_index, "stride": process_count}

    back = tc.restore(os.path.join(directory, "one"), {"it": tc.PerProcess(reshard=split)})
    try:
        tc.restore(os.path.join(directory, "one"))
        refused = None
    except tc.ProcessCountMismatchError as error:
        refused = [error.key, error.saved_count, error.process_count]
    return {"process": jax.process_index(), "it": back["it"], "refused": refused}


def test_one_process_saves_and_two_reshard(tmp_path):
    import tpu_ckpt as tc

    tc.save(tmp_path / "one", {"it": tc.PerProcess({"next_index": 40})}).wait()
    results = process_group.run("multiprocess.test_per_process_mp.reshard_one_to_two", 2, str(tmp_path), timeout=600)
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        me = r.result["process"]
        assert r.result["it"] == {"start": 40 + me, "stride": 2} and r.result["refused"] == ["it", 1, 2]
