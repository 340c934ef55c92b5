"""A writer that stalls (SIGSTOP: a preempted VM, a zombie of an earlier incarnation) in the
middle of its data, while another process saves the same checkpoint and commits: the
uncommitted objects do not block the new save, and when the stalled writer resumes (SIGCONT)
it fails with a typed error, removes only its own objects, and the committed checkpoint
restores bit-exactly. A real subprocess against moto, through a FaultyProxy that slows every
request so the stall lands between two data objects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tpu_ckpt as tc

pytestmark = [pytest.mark.emulator]

WORKER = """
import sys
import numpy as np
import tpu_ckpt as tc

rng = np.random.default_rng(int(sys.argv[2]))
tree = {"w": rng.standard_normal((64, 33)).astype(np.float32), "ids": rng.integers(0, 1 << 40, 3000), "step": 1}
try:
    tc.save(sys.argv[1], tree, options=tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(4096)))
except tc.CheckpointError as error:
    print("FAILED", type(error).__name__, error, flush=True)
    sys.exit(3)
print("COMMITTED", flush=True)
"""


def state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "ids": rng.integers(0, 1 << 40, 3000), "step": 1}


def data_objects(bucket) -> list[str]:
    return [key for key in bucket.keys("c/") if key.endswith(".safetensors")]


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the stalled writer never got to {what}: {proc.communicate()[0]}")
        time.sleep(0.01)


def test_a_stalled_writer_resumes_after_another_committed_and_fails_typed(faulty, tmp_path):
    proxy, bucket = faulty
    if bucket.scheme == "gs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch (tests/storage/test_object_retries.py)")
    worker = tmp_path / "stalled_writer.py"
    worker.write_text(WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    proxy.delay_s = 0.3  # every request of the writer: its ~20 data objects take seconds
    proc = subprocess.Popen(
        [sys.executable, str(worker), bucket.url("c"), "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        wait_for(lambda: bool(data_objects(bucket)), "its first data object", proc)
        os.kill(proc.pid, signal.SIGSTOP)
        token = data_objects(bucket)[0].split("/")[-1].split("-")[1]  # <hash>-<token>-dPPPPP-NNNNN.safetensors
        proxy.delay_s = 0.0
        tc.save(bucket.url("c"), state(2), options=tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(4096)))
        committed = {key for key in bucket.keys("c/") if f"-{token}-" not in key}
        os.kill(proc.pid, signal.SIGCONT)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, output
    assert "FAILED CheckpointExistsError" in output and "another save committed" in output, output
    # none of the winner's went, all of its own did
    assert "c/manifest.json" in committed and set(bucket.keys("c/")) == committed
    restored = tc.restore(bucket.url("c"))
    for key, expected in state(2).items():
        assert np.asarray(restored[key]).tobytes() == np.asarray(expected).tobytes(), key
