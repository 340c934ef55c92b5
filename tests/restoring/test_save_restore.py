"""End-to-end save/restore on 8 simulated devices: values, dtypes, targets, errors, files."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import as_format_1_2, axis_types, bits, files, leaf, manifest, read_chars, write_manifest

DTYPES = [
    np.float32, np.float16, np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz, ml_dtypes.int4,
    ml_dtypes.uint4, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
]


def random_array(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.name in ("int4", "uint4"):
        lo = -8 if dtype.name == "int4" else 0
        return rng.integers(lo, lo + 16, size=shape).astype(dtype)
    # Random bit patterns (NaNs with payloads included) prove the bytes are kept verbatim.
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exactly(tmp_path, dtype, mesh42):
    host = random_array(dtype, (8, 6))
    tree = {"numpy": host, "sharded": jax.device_put(host, NamedSharding(mesh42, P("data", "model")))}
    tc.save(tmp_path / "c", tree)
    out = tc.restore(tmp_path / "c")
    for name in tree:
        assert out[name].dtype == np.dtype(dtype)
        np.testing.assert_array_equal(bits(out[name]), bits(host))
    assert leaf(tmp_path / "c", "sharded")["dtype"] == np.dtype(dtype).name


def test_scalars_zero_size_arrays_and_python_values(tmp_path):
    tree = {
        "scalar": jnp.float32(2.5), "np_scalar": np.int64(-7), "empty": np.zeros((0, 4), np.float32),
        "empty_jax": jnp.zeros((3, 0), jnp.bfloat16), "i": 3, "f": 0.1, "b": True, "s": "hello", "n": None,
        "big": 2**62 + 1, "nested": [1, {"x": 2.0}],
    }
    tc.save(tmp_path / "c", tree)
    out = tc.restore(tmp_path / "c")
    assert out["scalar"].shape == () and out["scalar"] == np.float32(2.5)
    assert out["np_scalar"] == -7 and out["np_scalar"].dtype == np.int64
    assert out["empty"].shape == (0, 4) and out["empty_jax"].shape == (3, 0)
    assert out["empty_jax"].dtype == ml_dtypes.bfloat16
    assert out["i"] == 3 and type(out["i"]) is int
    assert out["f"] == 0.1 and out["b"] is True and out["s"] == "hello" and out["n"] is None
    assert out["big"] == 2**62 + 1 and out["nested"] == [1, {"x": 2.0}]


def test_restore_onto_other_mesh_single_device_and_numpy(tmp_path, mesh42, mesh24):
    host = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    x = jax.device_put(host, NamedSharding(mesh42, P("data", "model")))
    tc.save(tmp_path / "c", {"x": x})
    targets = {
        "other mesh": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh24, P("model", "data"))),
        "replicated": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh24, P())),
        "partially replicated": jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh24, P(None, "model"))
        ),
        "single device": jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[5])
        ),
        "no sharding": jax.ShapeDtypeStruct(x.shape, x.dtype),
        "array": jnp.zeros_like(host),
    }
    for name, target in targets.items():
        out = tc.restore(tmp_path / "c", {"x": target})["x"]
        assert isinstance(out, jax.Array), name
        if getattr(target, "sharding", None) is not None:
            assert out.sharding == target.sharding, name
        np.testing.assert_array_equal(np.asarray(out), host, err_msg=name)
    out = tc.restore(tmp_path / "c", {"x": np.zeros_like(host)})["x"]
    assert isinstance(out, np.ndarray) and out.flags.writeable
    np.testing.assert_array_equal(out, host)


def test_flax_train_state_restores_into_a_train_state(tmp_path, mesh42, mesh24):
    params = {"params": {"Dense_0": {"kernel": jnp.arange(32.0).reshape(8, 4), "bias": jnp.ones(4)}}}
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adam(1e-3))
    state = jax.tree_util.tree_map(
        lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh42, P("data") if jnp.ndim(x) == 2 else P())), state
    )
    tc.save(tmp_path / "c", state)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh24, P("model") if x.ndim == 2 else P())
        ),
        state,
    )
    out = tc.restore(tmp_path / "c", abstract)
    assert type(out) is train_state.TrainState
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(out)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert out.params["params"]["Dense_0"]["kernel"].sharding.mesh.shape == mesh24.shape


def test_subtree_and_partial_targets_read_only_their_part(tmp_path):
    big = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)  # 4 MiB
    tc.save(tmp_path / "c", {"params": {"w": np.arange(10.0)}, "opt": {"mu": big, "nu": big + 1}})
    before = read_chars()
    params = tc.restore(tmp_path / "c", subtree="params")
    read = read_chars() - before
    np.testing.assert_array_equal(params["w"], np.arange(10.0))
    assert read < big.nbytes / 4, f"a params-only restore read {read} bytes"
    before = read_chars()
    part = tc.restore(tmp_path / "c", {"opt": {"nu": np.zeros_like(big)}})
    read = read_chars() - before
    np.testing.assert_array_equal(part["opt"]["nu"], big + 1)
    assert big.nbytes <= read < 1.5 * big.nbytes
    sub = tc.restore(tmp_path / "c", {"w": jax.ShapeDtypeStruct((10,), jnp.float64)}, subtree="params")
    np.testing.assert_array_equal(np.asarray(sub["w"]), np.arange(10.0))


def test_cast_rule_float_to_float_only(tmp_path):
    tc.save(tmp_path / "c", {"w": np.linspace(0, 1, 8, dtype=np.float32), "i": np.array([16777217], np.int32)})
    out = tc.restore(tmp_path / "c", {"w": jax.ShapeDtypeStruct((8,), jnp.bfloat16)})
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(out["w"]), np.linspace(0, 1, 8, dtype=np.float32).astype(ml_dtypes.bfloat16)
    )
    with pytest.raises(tc.TargetMismatchError, match="'i'.*int32.*float->float") as e:
        tc.restore(tmp_path / "c", {"i": np.zeros(1, np.float32)})
    assert e.value.key == "i"
    with pytest.raises(tc.TargetMismatchError, match="'i'"):
        tc.restore(tmp_path / "c", {"i": np.zeros(1, np.int64)})


def test_target_mismatch_errors_name_the_key(tmp_path):
    tc.save(tmp_path / "c", {"params": {"kernel": np.zeros((4, 4), np.float32)}})
    with pytest.raises(tc.TargetMismatchError, match=r"'params/kernel'.*shape \(4, 5\).*\(4, 4\)"):
        tc.restore(tmp_path / "c", {"params": {"kernel": np.zeros((4, 5), np.float32)}})
    with pytest.raises(tc.TargetMismatchError, match="'params/kernal'.*similar keys.*params/kernel"):
        tc.restore(tmp_path / "c", {"params": {"kernal": np.zeros((4, 4), np.float32)}})
    with pytest.raises(tc.TargetMismatchError, match="subtree 'opt' is not in checkpoint.*'params'"):
        tc.restore(tmp_path / "c", subtree="opt")
    with pytest.raises(tc.TargetMismatchError, match="'params/kernel' is a str"):
        tc.restore(tmp_path / "c", {"params": {"kernel": "zeros"}})


def test_refuses_to_overwrite(tmp_path):
    tc.save(tmp_path / "c", {"a": np.ones(3)})
    with pytest.raises(tc.CheckpointExistsError, match="never overwrites"):
        tc.save(tmp_path / "c", {"a": np.zeros(3)})
    np.testing.assert_array_equal(tc.restore(tmp_path / "c")["a"], np.ones(3))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(tc.CheckpointExistsError):
        tc.save(tmp_path / "other", {"a": np.zeros(3)})
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    tc.save(tmp_path / "empty", {"a": np.zeros(3)})  # an empty directory is fine


def test_missing_and_uncommitted_checkpoints(tmp_path):
    with pytest.raises(tc.CheckpointNotFoundError, match="No checkpoint"):
        tc.restore(tmp_path / "nothing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "d00000-00000.safetensors").write_bytes(b"x")
    with pytest.raises(tc.UncommittedCheckpointError, match="uncommitted"):
        tc.restore(tmp_path / "half")
    (tmp_path / "gone.tmp-abc").mkdir()
    with pytest.raises(tc.UncommittedCheckpointError):
        tc.metadata(tmp_path / "gone")
    assert issubclass(tc.UncommittedCheckpointError, FileNotFoundError)


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    class Boom(tc.ShardingCallback):
        description = "boom"

        def __call__(self, pieces):
            raise RuntimeError("callback exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        tc.save(tmp_path / "c", {"a": np.ones(3)}, options=tc.CheckpointOptions(sharding_callback=Boom()))
    assert os.listdir(tmp_path) == []

    def fail(path):
        raise OSError("disk on fire")

    with pytest.raises(TypeError, match="'bad'.*object"):
        tc.save(tmp_path / "d", {"bad": object()})
    assert os.listdir(tmp_path) == []
    # A callback failure happens after the commit: the checkpoint stays valid.
    with pytest.raises(OSError, match="disk on fire"):
        tc.save(tmp_path / "e", {"a": np.ones(3)}, options=tc.CheckpointOptions(write_callbacks=[fail]))
    np.testing.assert_array_equal(tc.restore(tmp_path / "e")["a"], np.ones(3))


def test_corruption_is_detected_and_named(tmp_path, mesh42):
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh42, P("data")))
    tc.save(tmp_path / "c", {"w": x})
    piece = leaf(tmp_path / "c", "w")["pieces"][1]
    data_file = tmp_path / "c" / piece["file"]
    raw = bytearray(data_file.read_bytes())
    raw[piece["offset"] + 3] ^= 0x40
    data_file.write_bytes(bytes(raw))
    with pytest.raises(tc.CorruptCheckpointError, match=f"crc32c mismatch for key 'w'.*{piece['file']}") as e:
        tc.restore(tmp_path / "c")
    assert e.value.key == "w" and e.value.file.endswith(piece["file"])
    data_file.write_bytes(bytes(raw[: piece["offset"] + 2]))
    with pytest.raises(tc.CorruptCheckpointError, match=f"{piece['file']} is truncated.*'w'"):
        tc.restore(tmp_path / "c")
    data_file.unlink()
    with pytest.raises(tc.CorruptCheckpointError, match=f"{piece['file']} is missing.*'w'"):
        tc.restore(tmp_path / "c")


def test_newer_format_major_version_is_refused(tmp_path):
    tc.save(tmp_path / "c", {"a": np.ones(3)})
    write_manifest(tmp_path / "c", {**manifest(tmp_path / "c"), "format_version": "3.0"})
    with pytest.raises(tc.FormatVersionError, match="format version 3.0.*upgrade tpu_ckpt"):
        tc.restore(tmp_path / "c")


def test_replicas_are_written_once(tmp_path, mesh42):
    replicated = jax.device_put(np.arange(8.0), NamedSharding(mesh42, P()))
    half = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(mesh42, P("model")))
    tc.save(tmp_path / "c", {"r": replicated, "h": half})
    assert [p["slice"] for p in leaf(tmp_path / "c", "r")["pieces"]] == [[[0, 8]]]
    assert sorted(p["slice"] for p in leaf(tmp_path / "c", "h")["pieces"]) == [[[0, 2], [0, 4]], [[2, 4], [0, 4]]]
    sizes = sum(os.path.getsize(tmp_path / "c" / f) for f in files(tmp_path / "c"))
    assert sizes < (8 + 16) * 8 + 4096


def test_data_files_are_valid_safetensors(tmp_path, mesh42):
    from safetensors.numpy import load_file

    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh42, P("data", "model")))
    tc.save(tmp_path / "c", {"w": x, "i4": np.arange(6).astype(ml_dtypes.int4)})
    seen = {}
    for name in files(tmp_path / "c"):
        seen.update(load_file(str(tmp_path / "c" / name)))
    np.testing.assert_array_equal(seen["w[0:2,0:2]"], np.asarray(x)[0:2, 0:2])
    assert seen["i4[0:6]"].dtype == np.uint8  # no safetensors code: raw bytes, real dtype in the manifest


def test_max_shard_size_policy_end_to_end(tmp_path):
    w = np.arange(1000, dtype=np.float32).reshape(100, 10)
    options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(1000))
    tc.save(tmp_path / "c", {"w": w, "b": np.ones(300, np.float32)}, options=options)
    written = files(tmp_path / "c")
    assert len(written) == 6  # 4000 + 1200 bytes in 1000-byte shards
    for name, size in written.items():
        assert size == os.path.getsize(tmp_path / "c" / name)
    pieces = leaf(tmp_path / "c", "w")["pieces"] + leaf(tmp_path / "c", "b")["pieces"]
    payload = [sum(p["length"] for p in pieces if p["file"] == f) for f in written]
    assert max(payload) <= 1000
    out = tc.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], w)
    assert manifest(tmp_path / "c")["sharding_callback"] == tc.MaxShardSizePolicy(1000).description


def test_invalid_callback_result_is_rejected_before_writing(tmp_path):
    class DropsEverything(tc.ShardingCallback):
        description = "drops everything"

        def __call__(self, pieces):
            return []

    with pytest.raises(tc.InvalidShardsError, match="drops everything.*'a'") as e:
        tc.save(tmp_path / "c", {"a": np.ones(3)}, options=tc.CheckpointOptions(sharding_callback=DropsEverything()))
    assert isinstance(e.value, ValueError)
    assert not (tmp_path / "c").exists()


def test_write_callbacks_run_in_order_after_commit(tmp_path):
    calls = []

    def with_path(path):
        calls.append(("path", path, os.path.exists(os.path.join(path, "manifest.json"))))

    def without():
        calls.append(("none",))

    options = tc.CheckpointOptions(write_callbacks=[with_path, without, lambda p: calls.append(("lambda", p))])
    result = tc.save(tmp_path / "c", {"a": np.ones(2)}, options=options)
    assert result.done() and result.wait() == str(tmp_path / "c")
    assert calls == [("path", str(tmp_path / "c"), True), ("none",), ("lambda", str(tmp_path / "c"))]


def test_io_device_in_a_single_process_job(tmp_path):
    tree = {"x": np.arange(4.0)}
    tc.save(tmp_path / "a", tree, options=tc.CheckpointOptions(io_device="/job:localhost"))
    restored = tc.restore(tmp_path / "a", options=tc.CheckpointOptions(io_device=jax.devices()[0]))
    np.testing.assert_array_equal(restored["x"], tree["x"])
    with pytest.raises(ValueError, match=r"io_device names process 1, but this job has 1 process"):
        tc.save(tmp_path / "b", tree, options=tc.CheckpointOptions(io_device="/job:worker/task:1"))
    assert not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="io_device names process 3"):
        tc.restore(tmp_path / "a", options=tc.CheckpointOptions(io_device=3))


def test_memory_store_round_trip():
    tc.save("memory://tests/round_trip", {"a": np.arange(5), "s": "x"})
    out = tc.restore("memory://tests/round_trip")
    np.testing.assert_array_equal(out["a"], np.arange(5))
    with pytest.raises(tc.CheckpointExistsError):
        tc.save("memory://tests/round_trip", {"a": np.arange(5)})
    with pytest.raises(tc.CheckpointNotFoundError):
        tc.restore("memory://tests/absent")


def test_metadata_describes_without_reading_data(tmp_path, mesh42):
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh42, P("data", "model")))
    tc.save(tmp_path / "c", {"w": x, "step": 7})
    meta = tc.metadata(tmp_path / "c")
    assert meta["step"] == 7
    assert meta["w"] == tc.ArrayMetadata((8, 4), np.dtype(np.float32), 128, False, meta["w"].saved_sharding)
    assert meta["w"].saved_sharding == {
        "type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": ["data", "model"], **axis_types(mesh42)
    }


def test_objects_are_refused_with_the_key():  # typed PRNG keys are leaves now: tests/sharding/test_prng_keys.py
    with pytest.raises(TypeError, match="'rng' is a object"):
        tc.save("memory://tests/keys", {"rng": object()})


def test_library_never_uses_pickle():
    import pathlib

    source = pathlib.Path(tc.__file__).parent
    for path in source.glob("*.py"):
        assert "pickle" not in path.read_text(), path


def test_an_io_error_names_the_file_and_leaves_nothing(tmp_path):
    (tmp_path / "plain_file").write_text("not a directory")
    with pytest.raises(
        tc.CheckpointError, match=r"staging directory .*plain_file/\.c\.tmp-\w+ failed: Not a directory"
    ) as e:
        tc.save(tmp_path / "plain_file" / "c", {"a": np.ones(3)})
    assert "plain_file/.c.tmp-" in e.value.file
    assert sorted(os.listdir(tmp_path)) == ["plain_file"]


def test_python_scalar_targets_take_any_width_of_their_kind(tmp_path):
    tc.save(tmp_path / "c", {"step": jnp.int32(7), "lr": jnp.bfloat16(0.5), "flag": np.bool_(True)})
    out = tc.restore(tmp_path / "c", {"step": 0, "lr": 0.0, "flag": False})
    assert out == {"step": 7, "lr": 0.5, "flag": True} and type(out["step"]) is int
    with pytest.raises(tc.TargetMismatchError, match="'step'"):
        tc.restore(tmp_path / "c", {"step": 0.0})
    tc.save(tmp_path / "u", {"count": np.uint8(200), "big": np.uint64(2**63 + 5)})
    out = tc.restore(tmp_path / "u", {"count": 0, "big": 0})
    assert out == {"count": 200, "big": 2**63 + 5} and type(out["big"]) is int
    with pytest.raises(tc.TargetMismatchError, match="'count'"):
        tc.restore(tmp_path / "u", {"count": False, "big": 0})


def test_a_format_1_0_checkpoint_with_unaligned_pieces_restores(tmp_path):
    """Format 1.0 packed pieces back to back; 1.1 aligns each to 64 bytes. Rewrite a fresh
    checkpoint the 1.0 way (padding removed, offsets and version patched) and read it back."""
    tree = {"a": np.arange(3, dtype=np.int8), "b": np.arange(6, dtype=np.float32).reshape(2, 3)}
    tc.save(tmp_path / "c", tree)
    as_format_1_2(tmp_path / "c")
    doc = manifest(tmp_path / "c")
    (name, _), = doc["files"]
    data = (tmp_path / "c" / name).read_bytes()
    pieces = [leaf_doc["pieces"][0] for leaf_doc in doc["leaves"]]  # [slice, file, offset, length, crc]
    packed, offset = bytearray(data[: pieces[0][2]]), pieces[0][2]
    for piece in pieces:
        packed += data[piece[2] : piece[2] + piece[3]]
        piece[2], offset = offset, offset + piece[3]
    assert pieces[1][2] % 64 != 0  # "b" now starts unaligned
    (tmp_path / "c" / name).write_bytes(bytes(packed))
    doc["files"] = [[name, len(packed)]]
    doc["format_version"] = "1.0"
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "manifest_crc32c"}))
    out = tc.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["a"], tree["a"])
    np.testing.assert_array_equal(out["b"], tree["b"])
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    target = {"b": jax.ShapeDtypeStruct((2, 3), np.float32, sharding=NamedSharding(mesh, P("x")))}
    on_devices = tc.restore(tmp_path / "c", target, subtree="")
    np.testing.assert_array_equal(np.asarray(on_devices["b"]), tree["b"])
