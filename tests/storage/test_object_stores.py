"""gs:// and s3:// end to end, against real emulators (tests/support/object_stores.py): save, restore,
metadata, the commit marker, corruption, CheckpointManager, async saves, the export script,
and retries of transient errors. Every test runs once on GCS and once on S3."""

import json
import os
import subprocess
import sys
import urllib.parse

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import bits
from tpu_ckpt.format import token_of as format_token_of

pytestmark = [pytest.mark.emulator]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def weights() -> np.ndarray:
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    w.view(np.uint32)[0, 0] = 0x7FC12345  # a NaN with a payload: compared bit for bit
    return w


def state(mesh) -> dict:
    return {
        "params": {
            "w": jax.device_put(weights(), NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16), NamedSharding(mesh, P("model"))),
        },
        "ids": np.arange(5, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "step": 7,
        "lr": 0.25,
        "name": "run",
        "nothing": None,
    }


def manifest(bucket, path: str) -> dict:
    return json.loads(bucket.get(f"{path}/manifest.json"))


def test_save_restore_is_bit_exact_onto_another_mesh(bucket, mesh42, mesh24):
    tc.save(bucket.url("c"), state(mesh42)).wait()
    files = [name for name, _ in manifest(bucket, "c")["files"]]
    tables = [name for name, _ in manifest(bucket, "c")["tables"]]
    assert bucket.keys() == sorted(f"c/{name}" for name in [*files, *tables, "manifest.json"])

    target = state(mesh42)
    target["params"]["w"] = jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(mesh24, P(None, "model")))
    out = tc.restore(bucket.url("c"), target)
    assert out["params"]["w"].sharding == target["params"]["w"].sharding
    np.testing.assert_array_equal(bits(out["params"]["w"]), bits(weights()))
    assert out["params"]["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(out["params"]["b"]), bits(np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16)))
    plain = tc.restore(bucket.url("c"))  # no target: numpy and Python values
    np.testing.assert_array_equal(bits(plain["params"]["w"]), bits(weights()))
    np.testing.assert_array_equal(plain["ids"], np.arange(5))
    np.testing.assert_array_equal(plain["mask"], [True, False, True])
    assert (plain["step"], plain["lr"], plain["name"], plain["nothing"]) == (7, 0.25, "run", None)


def test_metadata_reads_shapes_and_values(bucket, mesh42):
    tc.save(bucket.url("c"), state(mesh42)).wait()
    meta = tc.metadata(bucket.url("c"))
    assert meta["params"]["w"].shape == (16, 8) and meta["params"]["w"].dtype == np.float32
    assert meta["params"]["b"].dtype == ml_dtypes.bfloat16 and meta["ids"].nbytes == 40
    assert meta["params"]["w"].saved_sharding["spec"] == ["data", "model"]
    assert (meta["step"], meta["name"]) == (7, "run")


def test_a_prefix_without_its_manifest_is_uncommitted_and_an_empty_one_absent(bucket):
    bucket.put("half/d00000-00000.safetensors", b"partial")  # an interrupted save
    with pytest.raises(tc.UncommittedCheckpointError, match="uncommitted") as raised:
        tc.restore(bucket.url("half"))
    assert raised.value.file == bucket.url("half")
    with pytest.raises(tc.UncommittedCheckpointError):
        tc.metadata(bucket.url("half"))
    with pytest.raises(tc.CheckpointNotFoundError, match="No checkpoint at") as raised:
        tc.restore(bucket.url("hal"))  # a prefix of a prefix holds nothing
    assert not isinstance(raised.value, tc.UncommittedCheckpointError)


def test_saving_over_anything_is_refused_and_leaves_it_intact(bucket):
    tc.save(bucket.url("c"), {"x": np.ones(4)}).wait()
    before = {key: bucket.get(key) for key in bucket.keys()}
    with pytest.raises(tc.CheckpointExistsError, match="already exists"):
        tc.save(bucket.url("c"), {"x": np.zeros(4)}).wait()
    bucket.put("leftover/x", b"?")
    with pytest.raises(tc.CheckpointExistsError):
        tc.save(bucket.url("leftover"), {"x": np.zeros(4)}).wait()
    assert {key: bucket.get(key) for key in bucket.keys("c/")} == before
    np.testing.assert_array_equal(tc.restore(bucket.url("c"))["x"], np.ones(4))


def test_a_flipped_byte_a_truncated_or_a_missing_object_is_named(bucket):
    tc.save(bucket.url("c"), {"x": np.arange(256, dtype=np.float32)}).wait()
    name = manifest(bucket, "c")["files"][0][0]
    original = bucket.get(f"c/{name}")
    flipped = bytearray(original)
    flipped[-1] ^= 0x01
    bucket.put(f"c/{name}", bytes(flipped))
    with pytest.raises(tc.CorruptCheckpointError, match="crc32c mismatch for key 'x'") as raised:
        tc.restore(bucket.url("c"))
    assert (raised.value.key, raised.value.file) == ("x", bucket.url(f"c/{name}"))
    bucket.put(f"c/{name}", original[:-8])
    with pytest.raises(tc.CorruptCheckpointError, match="truncated") as raised:
        tc.restore(bucket.url("c"))
    assert raised.value.file == bucket.url(f"c/{name}")
    bucket.delete(f"c/{name}")
    with pytest.raises(tc.CorruptCheckpointError, match="missing") as raised:
        tc.restore(bucket.url("c"))
    assert raised.value.file == bucket.url(f"c/{name}")


def tree(step: int) -> dict:
    return {"w": np.full((4, 2), step, np.float32), "step": step}


def test_manager_lists_committed_steps_only_and_retention_deletes_the_objects(bucket):
    bucket.put("run/step_7/d00000-00000.safetensors", b"partial")  # uncommitted: ours, removable
    bucket.put("run/notes/readme.txt", b"not ours")
    manager = tc.CheckpointManager(bucket.url("run"), max_to_keep=2)
    assert manager.latest_step() is None and manager.all_steps() == []
    for step in (1, 10):  # step_1 is a prefix of step_10's name, not of its objects
        manager.save(step, tree(step))
    manager.save(11, tree(11))
    assert manager.all_steps() == [10, 11]
    assert not bucket.keys("run/step_1/") and not bucket.keys("run/step_7/")
    assert bucket.keys("run/step_10/") and tc.restore(bucket.url("run/step_10"))["step"] == 10
    manager.save(12, tree(12))
    steps = sorted({key.split("/")[1] for key in bucket.keys("run/step_")})
    assert steps == ["step_11", "step_12"]
    assert bucket.keys("run/notes/") == ["run/notes/readme.txt"]
    again = tc.CheckpointManager(bucket.url("run"))  # a new manager sees exactly the same
    assert again.all_steps() == [11, 12]
    np.testing.assert_array_equal(again.restore()["w"], tree(12)["w"])


def test_async_saves_commit_in_the_background(bucket, mesh42):
    options = tc.CheckpointOptions(enable_async=True)
    result = tc.save(bucket.url("c"), state(mesh42), options=options)
    assert result.wait() == bucket.url("c")
    np.testing.assert_array_equal(bits(tc.restore(bucket.url("c"))["params"]["w"]), bits(weights()))
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=1, options=options) as manager:
        for step in range(3):
            assert manager.save(step, tree(step))
    assert {key.split("/")[1] for key in bucket.keys("run/")} == {"step_2"}
    assert tc.CheckpointManager(bucket.url("run")).restore()["step"] == 2


def test_a_multi_tier_manager_uploads_its_persistent_steps_from_the_local_tier(bucket, tmp_path):
    options = tc.CheckpointOptions(enable_async=True)
    tiers = dict(save_interval_steps=2, local_directory=str(tmp_path / "local"), local_max_to_keep=1, options=options)
    with tc.CheckpointManager(bucket.url("run"), **tiers) as manager:
        for step in range(1, 5):
            manager.save(step, tree(step))
    assert {key.split("/")[1] for key in bucket.keys("run/")} == {"step_1", "step_3"}
    # local_max_to_keep=1, and step 3 while it was being uploaded
    assert sorted(os.listdir(tmp_path / "local")) in (["step_4"], ["step_3", "step_4"])
    assert tc.restore(bucket.url("run/step_3"))["step"] == 3  # an ordinary checkpoint
    with tc.CheckpointManager(bucket.url("run"), **tiers) as manager:
        assert manager.latest_step() == 4 and manager.restore()["step"] == 4  # the local tier
    os.rename(tmp_path / "local", tmp_path / "lost")
    with tc.CheckpointManager(bucket.url("run"), **tiers) as manager:
        assert manager.latest_step() == 3
        np.testing.assert_array_equal(manager.restore()["w"], tree(3)["w"])  # the bucket


def test_an_upload_from_the_local_tier_names_its_objects_as_any_save_there(bucket, tmp_path):
    """An upload shares the step's prefix with any other save of that step, so its data
    files carry its token (FORMAT.md "File names"), as a tc.save's do."""
    tiers = dict(save_interval_steps=2, local_directory=str(tmp_path / "local"))
    with tc.CheckpointManager(bucket.url("run"), **tiers) as manager:
        manager.save(1, tree(1))
    names = [key.split("/", 2)[2] for key in bucket.keys("run/step_1/")]
    data = [name for name in names if name.endswith(".safetensors")]
    assert data and all(format_token_of(name) is not None for name in data), names
    assert len({format_token_of(name) for name in names if format_token_of(name)}) == 1  # one upload's token
    assert all(name == "manifest.json" or format_token_of(name) for name in names), names
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_1"))["w"], tree(1)["w"])


def test_keep_every_n_hours_is_refused_where_there_are_no_mtimes(bucket):
    with pytest.raises(ValueError, match="object stores .* report no modification times"):
        tc.CheckpointManager(bucket.url("run"), keep_checkpoint_every_n_hours=1)


def test_cli_export_writes_params_only_into_the_bucket(bucket):
    params = {"dense": {"kernel": np.arange(32, dtype=np.float32).reshape(8, 4)}, "ids": np.arange(3)}
    opt_state = {"mu": {"dense": {"kernel": np.ones((8, 4))}}}
    tc.save(bucket.url("train"), {"params": params, "opt_state": opt_state, "step": 3}).wait()
    done = subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "export", bucket.url("train"), bucket.url("serve"), "--dtype", "bfloat16"],
        capture_output=True, text=True, env=os.environ.copy(), timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {bucket.url('serve')}: 88 B in " in done.stdout  # 64 B of bf16 + 24 B of ids
    out = tc.restore(bucket.url("serve"))
    assert set(out) == {"dense", "ids"} and out["dense"]["kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["dense"]["kernel"].astype(np.float32), params["dense"]["kernel"])
    assert "serve/manifest.json" in bucket.keys("serve/")
    with pytest.raises(tc.CheckpointExistsError):
        tc.export_for_serving(bucket.url("train"), bucket.url("serve"))
    with pytest.raises(ValueError, match="local directories only"):
        tc.export_for_serving(bucket.url("train"), bucket.url("link"), link=True)


def _is_upload(method: str, path: str) -> bool:
    return (method == "POST" and path.startswith("/upload/")) or method == "PUT"


def _is_manifest_upload(method: str, path: str) -> bool:
    return _is_upload(method, path) and "manifest.json" in urllib.parse.unquote(path)  # GCS: in the query


def test_the_manifest_is_the_last_object_written(faulty, mesh42):
    proxy, bucket = faulty
    tc.save(bucket.url("c"), state(mesh42)).wait()
    uploads = [(r.method, r.path) for r in proxy.requests if _is_upload(r.method, r.path)]
    doc = manifest(bucket, "c")
    assert len(uploads) == len(doc["files"]) + len(doc["tables"]) + 2  # + the staging marker, first
    assert "staging.json" in urllib.parse.unquote(uploads[0][1])
    assert _is_manifest_upload(*uploads[-1]) and not any(_is_manifest_upload(*u) for u in uploads[:-1])
    assert "c/staging.json" not in bucket.keys("c/")  # deleted once committed


def test_429_and_503_are_retried_with_backoff(faulty):
    proxy, bucket = faulty
    proxy.fail(_is_manifest_upload, [503, 429])
    tc.save(bucket.url("c"), {"x": np.arange(8)}).wait()
    attempts = [r for r in proxy.requests if _is_manifest_upload(r.method, r.path)]
    assert [r.status for r in attempts] == [503, 429, 200]
    # The first retries come quickly (object_store.RETRIES: after 0.1 s, then 0.2 s), not after
    # a second and then two more, as they did.
    assert attempts[2].at - attempts[0].at < 2.5
    np.testing.assert_array_equal(tc.restore(bucket.url("c"))["x"], np.arange(8))


def test_a_permanent_error_is_not_retried_and_nothing_is_left_behind(faulty):
    proxy, bucket = faulty
    second_file = lambda method, path: _is_upload(method, path) and "d00000-00001" in urllib.parse.unquote(path)  # noqa: E731
    proxy.fail(second_file, [403])
    options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(24))  # two files
    with pytest.raises(tc.CheckpointError, match="403") as raised:
        tc.save(bucket.url("c"), {"x": np.ones(3), "y": np.ones(2)}, options=options).wait()
    # <hash>-<token>-
    assert raised.value.file.startswith(bucket.url("c/")) and raised.value.file.endswith("-d00000-00001.safetensors")
    assert [r.status for r in proxy.requests if second_file(r.method, r.path)] == [403]
    assert bucket.keys("c/") == []  # the file that was written is removed again


def test_an_unknown_bucket_is_a_checkpoint_error_naming_it(bucket):
    url = f"{bucket.scheme}://no-such-bucket/c"
    with pytest.raises(tc.CheckpointError, match="no-such-bucket") as raised:
        tc.save(url, {"x": np.ones(3)}).wait()
    assert raised.value.file == url
    with pytest.raises(tc.CheckpointError, match="no-such-bucket"):
        tc.restore(url)
