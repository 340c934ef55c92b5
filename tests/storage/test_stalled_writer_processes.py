"""Two real JAX processes save one checkpoint to S3 (moto): every process names its data files
and its staged index with the save's token (the leader's, shared when the save starts), the
leader finds the others' indexes under those names, and the checkpoint restores bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support import process_group
from tests.support.object_stores import Bucket

pytestmark = [pytest.mark.emulator]

SCRIPT = """
import sys
import jax
import numpy as np

port, count, me, url = sys.argv[1:]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(count), process_id=int(me))
import tpu_ckpt as tc
from jax.sharding import NamedSharding, PartitionSpec

mesh = jax.make_mesh((len(jax.devices()),), ("d",))
full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, PartitionSpec("d")), lambda index: full[index])
tc.save(url, {"x": x, "step": 4})
print("SAVED", flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_save_to_s3_with_token_names(s3_server, tmp_path):
    bucket = Bucket(s3_server, f"two-processes-{tmp_path.name[-8:]}")
    script = tmp_path / "save_two.py"
    script.write_text(SCRIPT)
    results = process_group.run_script(str(script), 2, bucket.url("c"), timeout=180)
    for result in results:
        assert result.returncode == 0 and "SAVED" in result.output, result.output
    names = [key.removeprefix("c/") for key in bucket.keys("c/")]
    data = [name for name in names if name.endswith(".safetensors")]
    assert {name.split("-")[2] for name in data} == {"d00000", "d00001"}  # <hash>-<token>-d<p>-<n>
    assert len({name.split("-")[1] for name in data}) == 1
    assert "manifest.json" in names and not [name for name in names if "index-" in name]  # the commit deleted them
    restored = tc.restore(bucket.url("c"))
    assert restored["step"] == 4
    assert np.asarray(restored["x"]).tobytes() == np.arange(64 * 8, dtype=np.float32).reshape(64, 8).tobytes()
