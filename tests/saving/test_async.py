"""Asynchronous saves: host snapshot, no device references, single flight, errors surface."""

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc

ASYNC = tc.CheckpointOptions(enable_async=True)


def sharded(mesh, value):
    return jax.device_put(value, NamedSharding(mesh, P("data", "model")))


def test_async_save_round_trips_and_reports_completion(tmp_path, mesh42):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    result = tc.save(tmp_path / "c", {"w": sharded(mesh42, value), "step": 3}, options=ASYNC)
    assert result.wait() == str(tmp_path / "c") and result.done()
    out = tc.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], value)
    assert out["step"] == 3


def test_device_buffers_can_be_deleted_and_donated_right_after_save(tmp_path, mesh42):
    value = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    x = sharded(mesh42, value)
    gate = threading.Event()
    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[lambda: gate.wait()])
    result = tc.save(tmp_path / "c", {"w": x, "h": np.array(value)}, options=options)
    x.delete()  # the snapshot must not need it
    y = sharded(mesh42, value)
    step = jax.jit(lambda a: a * 2, donate_argnums=0)
    z = step(y)
    assert y.is_deleted()
    gate.set()
    result.wait()
    np.testing.assert_array_equal(tc.restore(tmp_path / "c")["w"], value)
    np.testing.assert_array_equal(np.asarray(z), value * 2)


def test_mutation_after_return_is_not_in_the_checkpoint(tmp_path):
    host = np.zeros(1000, np.float32)
    result = tc.save(tmp_path / "c", {"h": host}, options=ASYNC)
    host[:] = 7
    result.wait()
    np.testing.assert_array_equal(tc.restore(tmp_path / "c")["h"], np.zeros(1000, np.float32))


def test_second_save_waits_for_the_first(tmp_path):
    order = []

    def slow(path):
        time.sleep(1.0)
        order.append(("first done", os.path.basename(path)))

    first = tc.save(
        tmp_path / "a", {"x": np.ones(2)}, options=tc.CheckpointOptions(enable_async=True, write_callbacks=[slow])
    )
    assert not first.done()  # still in its callback
    second = tc.save(tmp_path / "b", {"x": np.ones(2)}, options=ASYNC)
    assert first.done() and order == [("first done", "a")]  # the second save waited for all of it
    second.wait()


def test_callbacks_run_in_order_on_the_background_thread_after_commit(tmp_path):
    seen = []

    def record(path):
        seen.append(
            (threading.current_thread() is threading.main_thread(), os.path.exists(os.path.join(path, "manifest.json")))
        )

    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[record, lambda: seen.append("second")])
    tc.save(tmp_path / "c", {"x": np.ones(2)}, options=options).wait()
    assert seen == [(False, True), "second"]


def test_background_failure_is_raised_by_wait_and_not_twice(tmp_path):
    def boom():
        raise RuntimeError("callback failed")

    result = tc.save(
        tmp_path / "c", {"x": np.ones(2)}, options=tc.CheckpointOptions(enable_async=True, write_callbacks=[boom])
    )
    with pytest.raises(RuntimeError, match="callback failed"):
        result.wait()
    with pytest.raises(RuntimeError, match="callback failed"):
        result.wait()  # asking again tells again
    tc.save(tmp_path / "d", {"x": np.ones(2)}, options=ASYNC).wait()  # already seen: no re-raise
    assert tc.restore(tmp_path / "c")["x"].tolist() == [1.0, 1.0]  # a callback failure keeps the commit


def test_unseen_background_failure_is_raised_by_the_next_save(tmp_path):
    def fail():
        raise OSError("the callback's disk is gone")

    failing = tc.CheckpointOptions(enable_async=True, write_callbacks=[fail])
    tc.save(tmp_path / "c", {"x": np.ones(2)}, options=failing)  # fails in the background
    with pytest.raises(OSError, match="the callback's disk is gone"):
        tc.save(tmp_path / "next", {"x": np.ones(2)}, options=ASYNC)
    assert not (tmp_path / "next").exists()
    tc.save(tmp_path / "after", {"x": np.ones(2)}, options=ASYNC).wait()  # the one after succeeds
    assert sorted(os.listdir(tmp_path)) == ["after", "c"]  # a failed callback's checkpoint stays committed


def test_planning_errors_are_raised_synchronously(tmp_path):
    tc.save(tmp_path / "c", {"x": np.ones(2)})
    with pytest.raises(tc.CheckpointExistsError):
        tc.save(tmp_path / "c", {"x": np.ones(2)}, options=ASYNC)
    with pytest.raises(TypeError, match="'bad'"):
        tc.save(tmp_path / "d", {"bad": object()}, options=ASYNC)


def test_wait_with_timeout(tmp_path):
    gate = threading.Event()
    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[lambda: gate.wait()])
    result = tc.save(tmp_path / "c", {"x": np.ones(2)}, options=options)
    with pytest.raises(TimeoutError, match="still in progress"):
        result.wait(timeout=0.05)
    assert not result.done()
    gate.set()
    assert result.wait(timeout=30) == str(tmp_path / "c")


def test_interpreter_exit_finishes_the_in_flight_save(tmp_path):
    import subprocess
    import sys

    script = (
        "import numpy as np, tpu_ckpt as tc, time\n"
        "def slow(): time.sleep(1)\n"
        f"tc.save({str(tmp_path / 'c')!r}, {{'x': np.arange(5)}}, "
        "options=tc.CheckpointOptions(enable_async=True, write_callbacks=[slow]))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    np.testing.assert_array_equal(tc.restore(tmp_path / "c")["x"], np.arange(5))


def test_interpreter_exit_logs_an_unseen_failure(tmp_path):
    import subprocess
    import sys

    script = (
        "import numpy as np, tpu_ckpt as tc\n"
        "def boom(): raise RuntimeError('late failure')\n"
        f"tc.save({str(tmp_path / 'c')!r}, {{'x': np.arange(5)}}, "
        "options=tc.CheckpointOptions(enable_async=True, write_callbacks=[boom]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "late failure" in out.stderr and "never waited on" in out.stderr


def test_async_jnp_scalar_and_bfloat16(tmp_path):
    tree = {"s": jnp.float32(1.5), "b": jnp.arange(4, dtype=jnp.bfloat16)}
    tc.save(tmp_path / "c", tree, options=ASYNC).wait()
    out = tc.restore(tmp_path / "c")
    assert out["s"] == 1.5 and out["b"].dtype == jnp.bfloat16
