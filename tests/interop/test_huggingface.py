"""The Hugging Face layout both ways: export_for_serving(layout="huggingface") read back by
the safetensors library itself, and load_safetensors of files that library wrote, onto meshes."""

import json
import os
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save_file

import tpu_ckpt as tc
from tests.interop.hf_scenarios import VALUES
from tests.support import process_group
from tests.support.flax_mlp import X, new_state
from tpu_ckpt.cli import main

RNG = np.random.default_rng(0)
PARAMS = {
    "embed": RNG.normal(size=(64, 32)).astype(ml_dtypes.bfloat16),
    "layer": {"kernel": RNG.normal(size=(32, 48)).astype(np.float32), "bias": RNG.normal(size=48).astype(np.float16)},
    "ids": np.arange(40, dtype=np.int32).reshape(8, 5),
    "scale": np.float32(2.5),
}


def _mesh(shape, names=("a", "b")):
    return Mesh(np.array(jax.devices()[: np.prod(shape)]).reshape(shape), names)


def _on(mesh, spec, value):
    return jax.device_put(value, NamedSharding(mesh, spec))


def _tensors(path):
    """Every tensor of every safetensors file in ``path``, read by the safetensors library."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "flax") as f:
                out.update({key: (name, np.asarray(f.get_tensor(key))) for key in f.keys()})
    return out


@pytest.fixture
def training(tmp_path):
    mesh = _mesh((4, 2))
    params = {**PARAMS, "embed": _on(mesh, P("a", "b"), PARAMS["embed"]), "layer": {
        "kernel": _on(mesh, P(None, "a"), PARAMS["layer"]["kernel"]), "bias": PARAMS["layer"]["bias"]}}
    tc.save(tmp_path / "train", {"params": params, "opt_state": {"mu": np.ones(3)}, "step": 7})
    return tmp_path / "train"


def test_export_several_shards_read_back_bit_exact_by_safetensors(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "hf", layout="huggingface", max_shard_size=4000)
    found = _tensors(tmp_path / "hf")
    expected = {"embed": PARAMS["embed"], "layer.kernel": PARAMS["layer"]["kernel"],
                "layer.bias": PARAMS["layer"]["bias"], "ids": PARAMS["ids"], "scale": np.asarray(PARAMS["scale"])}
    assert set(found) == set(expected)
    for name, value in expected.items():
        assert found[name][1].dtype == value.dtype and found[name][1].tobytes() == value.tobytes(), name
    # huggingface_hub's packing of these sizes in leaf order (embed 4096 B, ids 160, bias 96, kernel 6144, scale 4)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(v.nbytes for v in expected.values())}
    assert index["weight_map"] == {name: found[name][0] for name in expected}
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert index["weight_map"]["layer.kernel"] == "model-00002-of-00003.safetensors"  # bigger than the limit: alone


def test_one_file_when_it_fits_and_dtype_cast(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "hf", layout="huggingface", dtype="bfloat16")
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"]
    found = _tensors(tmp_path / "hf")
    assert found["layer.kernel"][1].dtype == jnp.bfloat16 and found["ids"][1].dtype == np.int32
    np.testing.assert_array_equal(found["layer.kernel"][1], PARAMS["layer"]["kernel"].astype(ml_dtypes.bfloat16))


def test_round_trip_onto_another_mesh(training, tmp_path):
    tc.export_for_serving(training, tmp_path / "hf", layout="huggingface", max_shard_size="5KB")
    mesh = _mesh((2, 4), ("x", "y"))
    target = {
        "embed": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16, sharding=NamedSharding(mesh, P("y", "x"))),
        "layer": {
            "kernel": jax.ShapeDtypeStruct((32, 48), jnp.float32, sharding=NamedSharding(mesh, P(None, ("x", "y")))),
            "bias": np.zeros(48, np.float16),
        },
        "ids": jax.ShapeDtypeStruct((8, 5), jnp.int32, sharding=NamedSharding(mesh, P("x"))),
        "scale": np.zeros((), np.float32),
    }
    out = tc.load_safetensors(tmp_path / "hf", target)
    assert out["embed"].sharding == target["embed"].sharding
    np.testing.assert_array_equal(np.asarray(out["embed"]), PARAMS["embed"])
    np.testing.assert_array_equal(np.asarray(out["layer"]["kernel"]), PARAMS["layer"]["kernel"])
    np.testing.assert_array_equal(out["layer"]["bias"], PARAMS["layer"]["bias"])
    np.testing.assert_array_equal(np.asarray(out["ids"]), PARAMS["ids"])
    assert out["scale"] == 2.5


def _hub_layout(path, shards):
    """Files and index as huggingface_hub/transformers write them, by the safetensors library."""
    os.makedirs(path)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(v.nbytes for s in shards for v in s.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def test_load_hub_files_written_by_the_safetensors_library(tmp_path):
    w = {"a.weight": RNG.normal(size=(16, 8)).astype(np.float32), "a.bias": RNG.normal(size=8).astype(np.float16),
         "b.weight": RNG.normal(size=(8, 16)).astype(ml_dtypes.bfloat16), "b.count": np.arange(6, dtype=np.int64)}
    _hub_layout(
        tmp_path / "hub", [{k: w[k] for k in ("a.weight", "a.bias")}, {k: w[k] for k in ("b.weight", "b.count")}]
    )
    mesh = _mesh((4, 2))
    target = {"a": {"weight": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("a", "b"))),
                    "bias": np.zeros(8, np.float16)},
              "b": {"weight": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "a"))),
                    "count": np.zeros(6, np.int64)}}
    out = tc.load_safetensors(tmp_path / "hub", target)
    np.testing.assert_array_equal(np.asarray(out["a"]["weight"]), w["a.weight"])
    np.testing.assert_array_equal(out["a"]["bias"], w["a.bias"])
    np.testing.assert_array_equal(np.asarray(out["b"]["weight"]), w["b.weight"].astype(np.float32))  # cast asked for
    np.testing.assert_array_equal(out["b"]["count"], w["b.count"])
    one = tc.load_safetensors(tmp_path / "hub" / "model-00001-of-00002.safetensors", {"a": target["a"]})
    np.testing.assert_array_equal(one["a"]["bias"], w["a.bias"])
    os.remove(tmp_path / "hub" / "model.safetensors.index.json")  # a directory without index: every file
    np.testing.assert_array_equal(tc.load_safetensors(tmp_path / "hub", target)["b"]["count"], w["b.count"])


def test_the_params_level_of_a_target_finds_what_an_export_of_params_named(tmp_path):
    """export_for_serving names tensors below the exported subtree (``Dense_0.kernel``); a
    target that keeps the ``{"params": ...}`` level loads them by default, and a tensor named
    with the whole path is still preferred where the file has it."""
    kernel, bias = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(4, np.float32)
    tc.save(tmp_path / "c", {"params": {"Dense_0": {"kernel": kernel, "bias": bias}}}).wait()
    tc.export_for_serving(tmp_path / "c", tmp_path / "hf", layout="huggingface")
    like = {"params": {"Dense_0": {"kernel": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)}}}
    out = tc.load_safetensors(tmp_path / "hf", like)
    np.testing.assert_array_equal(out["params"]["Dense_0"]["kernel"], kernel)
    np.testing.assert_array_equal(out["params"]["Dense_0"]["bias"], bias)
    save_file({"params.b": np.full(2, 7, np.float32), "b": np.zeros(2, np.float32)}, str(tmp_path / "both.safetensors"))
    loaded = tc.load_safetensors(tmp_path / "both.safetensors", {"params": {"b": np.zeros(2, np.float32)}})
    assert loaded["params"]["b"][0] == 7


def test_mismatches_are_reported_all_at_once(tmp_path):
    save_file({"w": np.zeros((4, 4), np.float32), "n": np.zeros(3, np.int32)}, str(tmp_path / "m.safetensors"))
    target = {"w": np.zeros((4, 5), np.float32), "n": np.zeros(3, np.float32), "gone": np.zeros(2, np.float32)}
    with pytest.raises(tc.TargetMismatchError) as err:
        tc.load_safetensors(tmp_path / "m.safetensors", target)
    message = str(err.value)
    assert "3 target leaves" in message and "'w': shape (4, 5)" in message
    assert "only float->float" in message and "no tensor 'gone'" in message
    others = {"w": np.zeros((4, 4), np.float32), "key": jax.random.key(0), "b": b"x", "s": "x"}  # not arrays
    with pytest.raises(tc.TargetMismatchError) as err:
        tc.load_safetensors(tmp_path / "m.safetensors", others)
    assert "3 target leaves" in str(err.value) and "'b': a bytes target" in str(err.value), err.value
    assert "'key': a PRNGKeyArray target" in str(err.value), err.value


def test_a_tied_embedding_loads_into_both_leaves(tmp_path):
    """A Hub model with tied embeddings stores ``embed_tokens`` once; a model with its own
    output head reads that one tensor twice, once transposed."""
    embed = RNG.normal(size=(8, 4)).astype(np.float32)
    save_file({"model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    names = {"embed": "model.embed_tokens.weight", "head": {"name": "model.embed_tokens.weight", "transpose": True}}
    mesh = _mesh((4, 2))
    target = {"embed": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("a", "b"))),
              "head": np.zeros((4, 8), np.float32)}
    out = tc.load_safetensors(tmp_path / "model.safetensors", target, names=names)
    np.testing.assert_array_equal(np.asarray(out["embed"]), embed)
    np.testing.assert_array_equal(out["head"], embed.T)


def test_no_tensor_takes_the_header_metadata_name(tmp_path):
    """``__metadata__`` is the safetensors header's own entry: an export naming a tensor so
    would write a file no reader opens; it is refused before anything is written."""
    tc.save(tmp_path / "c", {"params": {"w": np.ones(2, np.float32), "__metadata__": np.ones(2, np.float32)}}).wait()
    with pytest.raises(ValueError, match="'params/__metadata__' would be the tensor '__metadata__'"):
        tc.export_for_serving(tmp_path / "c", tmp_path / "hf", layout="huggingface")
    names = {"params/w": "__metadata__", "params/__metadata__": "meta"}
    with pytest.raises(ValueError, match="'params/w' would be the tensor '__metadata__'"):
        tc.export_for_serving(tmp_path / "c", tmp_path / "hf", layout="huggingface", names=names)
    assert not (tmp_path / "hf").exists()
    tc.export_for_serving(tmp_path / "c", tmp_path / "hf", layout="huggingface", names={**names, "params/w": "w"})
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "numpy") as f:
        assert sorted(f.keys()) == ["meta", "w"] and f.metadata() == {"format": "pt"}


def test_flax_mlp_with_transposing_name_map(tmp_path):
    state = new_state(optax.adam(1e-3))
    tc.save(tmp_path / "train", state)

    def torch_names(path):
        layer, kind = path.split("/")[-2:]
        index = layer.split("_")[1]
        if kind == "kernel":
            return {"name": f"layers.{index}.weight", "transpose": True}
        return f"layers.{index}.bias"

    tc.export_for_serving(tmp_path / "train", tmp_path / "hf", layout="huggingface", names=torch_names)
    found = _tensors(tmp_path / "hf")
    kernel = np.asarray(state.params["params"]["Dense_0"]["kernel"])
    assert found["layers.0.weight"][1].shape == kernel.T.shape == (1, 32)  # PyTorch Linear: (out, in)
    np.testing.assert_array_equal(found["layers.0.weight"][1], kernel.T)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
    loaded = tc.load_safetensors(tmp_path / "hf", abstract, names=torch_names)
    np.testing.assert_array_equal(np.asarray(state.apply_fn(loaded, X)), np.asarray(state.apply_fn(state.params, X)))


def test_names_dict_must_name_every_leaf(training, tmp_path):
    with pytest.raises(tc.TargetMismatchError, match="no entry for 4 key"):
        tc.export_for_serving(training, tmp_path / "hf", layout="huggingface", names={"params/embed": "embed_tokens"})
    names = {
        "params/embed": "x", "params/ids": "x", "params/layer/kernel": None, "params/layer/bias": None,
        "params/scale": None,
    }
    with pytest.raises(tc.TargetMismatchError, match="the same tensor name 'x'"):
        tc.export_for_serving(training, tmp_path / "hf", layout="huggingface", names=names)


def test_refuses_a_destination_that_holds_files(training, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("")
    with pytest.raises(tc.CheckpointExistsError):
        tc.export_for_serving(training, tmp_path / "hf", layout="huggingface")


def test_a_leaf_bigger_than_host_memory_limit_is_written_in_blocks(tmp_path):
    big = RNG.integers(0, 1 << 30, size=(640, 16384), dtype=np.int32)  # 40 MiB; limit 16 MiB: 4 MiB blocks
    tc.save(tmp_path / "train", {"params": {"w": big}})
    limited = tc.CheckpointOptions(host_memory_limit=16 << 20)
    names = {"params/w": {"name": "w", "transpose": True}}
    tc.export_for_serving(tmp_path / "train", tmp_path / "hf", layout="huggingface", names=names, options=limited)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        assert f.get_tensor("w").tobytes() == np.ascontiguousarray(big.T).tobytes()
    out = tc.load_safetensors(
        tmp_path / "hf", {"w": np.zeros_like(big)}, names={"w": names["params/w"]}, options=limited
    )
    assert out["w"].tobytes() == big.tobytes()


def test_cli_export_huggingface(training, tmp_path):
    (tmp_path / "names.json").write_text(json.dumps(
        {"params/embed": "model.embed_tokens.weight",
         "params/layer/kernel": {"name": "lm_head.weight", "transpose": True},
         "params/layer/bias": None, "params/ids": None, "params/scale": None}))
    assert main(["export", str(training), str(tmp_path / "hf"), "--layout", "huggingface",
                 "--names", str(tmp_path / "names.json"), "--dtype", "bfloat16", "--max-shard-size", "5GB"]) == 0
    found = _tensors(tmp_path / "hf")
    assert set(found) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert found["lm_head.weight"][1].shape == (48, 32)


def test_object_store_both_ways(tmp_path):
    tc.save("memory://hf-src/train", {"params": {"w": PARAMS["layer"]["kernel"]}})
    tc.export_for_serving("memory://hf-src/train", "memory://hf-dst/hf", layout="huggingface", max_shard_size=100)
    out = tc.load_safetensors("memory://hf-dst/hf", {"w": np.zeros((32, 48), np.float32)})
    np.testing.assert_array_equal(out["w"], PARAMS["layer"]["kernel"])


def _file(path, header, data=b""):
    """A safetensors file with a hand-written header (bytes or a JSON-able dict)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _tensor(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


HOSTILE = {
    "past the end": ({"w": _tensor("F32", [4], 0, 16)}, b"\0" * 8, "past its end"),
    "overlapping": ({"w": _tensor("F32", [2], 0, 8), "v": _tensor("F32", [2], 4, 12)}, b"\0" * 12, "overlapping"),
    "size not dtype x shape": ({"w": _tensor("F32", [3], 0, 8)}, b"\0" * 8, "not the 12 its shape needs"),
    "not UTF-8": (b'{"w\xff": 1}', b"", "not UTF-8"),
    "duplicate names": (b'{"w": ' + json.dumps(_tensor("U8", [1], 0, 1)).encode() + b', "w": '
                        + json.dumps(_tensor("U8", [1], 1, 2)).encode() + b"}", b"\0\0", "appears twice"),
    "unknown dtype": ({"w": _tensor("Q9", [1], 0, 1)}, b"\0", "describes tensor 'w' wrongly"),
    "negative shape": ({"w": _tensor("U8", [-1], 0, 0)}, b"", "describes tensor 'w' wrongly"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_typed_errors(tmp_path, case):
    header, data, message = HOSTILE[case]
    path = _file(tmp_path / "m.safetensors", header, data)
    with pytest.raises(tc.CorruptCheckpointError, match=message):
        tc.load_safetensors(path, {"w": np.zeros(1, np.uint8)})


def test_a_huge_header_claim_is_refused_before_any_allocation(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(tc.CorruptCheckpointError, match="claims a 1099511627776-byte header"):
        tc.load_safetensors(path, {"w": np.zeros(1, np.uint8)})


def test_a_fifo_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "m.safetensors")
    with pytest.raises(tc.CorruptCheckpointError, match="FIFO"):
        tc.load_safetensors(tmp_path / "m.safetensors", {"w": np.zeros(1, np.uint8)})


def test_an_index_naming_a_file_without_the_tensor(tmp_path):
    save_file({"a": np.zeros(2, np.float32)}, str(tmp_path / "one.safetensors"))
    index = {"metadata": {"total_size": 8}, "weight_map": {"a": "one.safetensors", "b": "one.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(tc.CorruptCheckpointError, match="puts tensor 'b' in one.safetensors"):
        tc.load_safetensors(tmp_path, {"a": np.zeros(2, np.float32)})


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_every_process_writes_its_files_of_one_export(tmp_path, processes):
    """Each process writes its share of the files (4 MiB over the job) and loads back only the
    bytes its devices hold, onto a mesh whose devices are reversed (headers aside)."""
    results = process_group.run("interop.hf_scenarios.export_from_every_process", processes, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        assert r.result["mismatches"] == [], r.result["mismatches"]
        assert r.result["written"] >= (4 << 20) // processes, r.result  # its files, 1 MiB each
        assert r.result["held"] <= r.result["read"] <= 1.05 * r.result["held"] + (64 << 10), r.result
    files = results[0].result["files"]
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)] + ["model.safetensors.index.json"]
    found = _tensors(tmp_path / "hf")
    assert {key: value[1].tobytes() for key, value in found.items()} == {k: v.tobytes() for k, v in VALUES.items()}


@pytest.mark.emulator
def test_export_and_load_on_object_stores(bucket):
    tc.save(bucket.url("train"), {"params": {"a": PARAMS["layer"]["kernel"], "b": PARAMS["ids"]}}).wait()
    tc.export_for_serving(bucket.url("train"), bucket.url("hf"), layout="huggingface", max_shard_size=1000)
    assert bucket.keys("hf") == ["hf/model-00001-of-00002.safetensors", "hf/model-00002-of-00002.safetensors",
                                 "hf/model.safetensors.index.json"]
    first = safetensors_load(bucket.get("hf/model-00001-of-00002.safetensors"))
    assert first["a"].tobytes() == PARAMS["layer"]["kernel"].tobytes()
    out = tc.load_safetensors(bucket.url("hf"), {"a": np.zeros((32, 48), np.float32), "b": np.zeros((8, 5), np.int32)})
    np.testing.assert_array_equal(out["a"], PARAMS["layer"]["kernel"])
    np.testing.assert_array_equal(out["b"], PARAMS["ids"])


@pytest.mark.slow
def test_peak_memory_under_host_memory_limit_both_ways(tmp_path):
    """A 1 GiB leaf under a 64 MiB limit, issue #36's sizes (tests/interop/hf_memory_probe.py, a fresh
    process: ~22 s on 2 cores, 10 s at 256 MiB): the export, a transposed one, peaks within
    limit + 32 MiB; the load holds its result and, beyond it, as much."""
    probe = os.path.join(os.path.dirname(__file__), "hf_memory_probe.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    limit = 64 << 20
    done = subprocess.run([sys.executable, probe, str(tmp_path), "1024", str(limit)], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(probe), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["exact"]
    assert out["export"] <= limit + (32 << 20), out
    assert out["load"] - out["load_held"] <= limit + (32 << 20), out


@pytest.mark.parametrize("limit", [None, 16 << 20])  # the piece read whole, or in blocks
def test_a_corrupt_source_piece_fails_the_export_and_leaves_no_file(tmp_path, limit):
    big = np.arange(1 << 20, dtype=np.float32).reshape(256, 4096)  # 4 MiB: blocks of 4 MiB / 4 under a 16 MiB limit
    tc.save(tmp_path / "train", {"params": {"w": big}})
    (data,) = [p for p in (tmp_path / "train").iterdir() if p.suffix == ".safetensors"]
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # in the last block of the piece: every earlier block was already written
    data.write_bytes(bytes(raw))
    with pytest.raises(tc.CorruptCheckpointError, match="does not match its crc32c"):
        tc.export_for_serving(tmp_path / "train", tmp_path / "hf", layout="huggingface",
                              options=tc.CheckpointOptions(host_memory_limit=limit))
    assert os.listdir(tmp_path / "hf") == []
