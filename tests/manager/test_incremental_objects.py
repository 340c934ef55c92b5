"""CheckpointManager(incremental=True) on object stores (moto, gcp-storage-emulator), as on a
local run directory: a LoRA-style loop writes only what it trains, every kept step restores
bit-exactly after retention, a retired step goes once nothing references it, references
are read only from sibling steps of the run, with their recorded size, and the command line
follows them."""

import json
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpu_ckpt as tc
from tests.manager.test_run_directory import listings
from tests.support.helpers import sealed
from tpu_ckpt.catalog import verify
from tpu_ckpt.cli import main

pytestmark = pytest.mark.emulator

LAYERS, WIDTH, RANK = 4, 256, 4
DATA = "d00000-00000.safetensors"  # the end of a data file's name (object names start with a token)


def frozen_base(seed: int = 0) -> dict:
    """A base model: jax.Arrays (compared by identity) and a numpy table (by digest)."""
    keys = jax.random.split(jax.random.key(seed), LAYERS)
    layers = {f"dense_{i}": jax.random.normal(k, (WIDTH, WIDTH)) for i, k in enumerate(keys)}
    return {**layers, "embed": np.random.default_rng(seed).standard_normal((512, 64)).astype(np.float32)}


def train(trained: dict, step: int) -> dict:
    """One step of a LoRA adapter and its Adam-like state: every trained array is new."""
    a = trained["a"] + 0.01 * (step + 1)
    return {"a": a, "b": trained["b"] - 0.01, "mu": 0.9 * trained["mu"] + a, "nu": 0.99 * trained["nu"] + a * a,
            "count": trained["count"] + 1}


def first_adapter() -> dict:
    a = jax.random.normal(jax.random.key(7), (LAYERS, WIDTH, RANK)) * 0.01
    return {"a": a, "b": jnp.zeros((LAYERS, RANK, WIDTH)), "mu": jnp.zeros_like(a), "nu": jnp.zeros_like(a),
            "count": jnp.zeros((), jnp.int32)}


def nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def written(bucket, step: int) -> int:
    """Bytes of the objects a save created in its own step prefix (data files, piece tables)."""
    return sum(size for key, size in bucket.sizes(f"run/step_{step}/").items() if not key.endswith("/manifest.json"))


def steps_stored(bucket) -> dict[str, list[str]]:
    """The run's step prefixes and the objects in each."""
    found: dict[str, list[str]] = {}
    for key in bucket.keys("run/"):
        _, step, name = key.split("/", 2)
        found.setdefault(step, []).append(name)
    return found


def assert_bit_exact(restored, expected) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e), strict=True)


def test_lora_loop_on_an_object_store_writes_the_trained_part_and_every_kept_step_restores(bucket):
    run, base, trained = bucket.url("run"), frozen_base(), first_adapter()
    states = {}
    with tc.CheckpointManager(run, max_to_keep=2, incremental=True) as manager:
        for step in range(5):
            trained = train(trained, step)
            manager.save(step, {"base": base, "trained": trained})
            states[step] = jax.tree.map(np.asarray, {"base": base, "trained": trained})
            if step:
                assert written(bucket, step) <= 1.05 * nbytes(trained), (step, written(bucket, step), nbytes(trained))
        assert written(bucket, 0) > 10 * nbytes(trained)  # the base is ≥ 10x what is trained
        assert manager.all_steps() == [3, 4]
        stored = steps_stored(bucket)
        assert sorted(stored) == ["step_0", "step_3", "step_4"]  # step_0 retired: steps 3 and 4 read its base
        assert "referenced.json" in stored["step_0"] and "manifest.json" not in stored["step_0"]
        assert all(name.endswith(".safetensors") for name in stored["step_0"] if name != "referenced.json")
        for step in (3, 4):
            assert_bit_exact(manager.restore(step), states[step])
            assert_bit_exact(tc.restore(bucket.url(f"run/step_{step}")), states[step])
            report = verify(bucket.url(f"run/step_{step}"))
            assert report.ok and report.nbytes >= nbytes(states[step]["base"]), report.problems
    new_base = frozen_base(seed=1)  # a restarted manager learns of the retired step from its listing
    with tc.CheckpointManager(run, max_to_keep=2, incremental=True) as manager:
        with pytest.raises(tc.CheckpointExistsError, match="retired"):
            manager.save(0, {"base": base, "trained": trained})  # its objects are other steps' data
        for step in (5, 6):
            trained = train(trained, step)
            manager.save(step, {"base": new_base, "trained": trained})
        assert sorted(steps_stored(bucket)) == ["step_5", "step_6"]  # nothing references step_0 any more
        assert_bit_exact(manager.restore(6), jax.tree.map(np.asarray, {"base": new_base, "trained": trained}))


def test_an_incremental_run_is_not_listed_again_at_each_save(faulty):
    proxy, bucket = faulty
    base, trained = frozen_base(), first_adapter()
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=2, incremental=True) as manager:
        manager.save(0, {"base": base, "trained": trained})
        proxy.requests.clear()
        for step in range(1, 5):
            trained = train(trained, step)
            manager.save(step, {"base": base, "trained": trained})
    run_prefix = urllib.parse.urlparse(bucket.url("run/")).path.lstrip("/")
    assert listings(proxy) and not [p for p in listings(proxy) if p.endswith(run_prefix)], listings(proxy)
    assert sorted(steps_stored(bucket)) == ["step_0", "step_3", "step_4"]


@pytest.fixture
def run(bucket):
    """A run on an object store whose step_1 references step_0's data file for "base"."""
    base = {"w": np.arange(4096, dtype=np.float32)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    return bucket


def edit_files(bucket, edit) -> None:
    """Rewrites step_1's manifest ``files`` through ``edit`` and seals it again (a hostile edit)."""
    doc = json.loads(bucket.get("run/step_1/manifest.json"))
    doc["files"] = [edit(name, size) for name, size in doc["files"]]
    bucket.put("run/step_1/manifest.json", sealed(doc))


def referenced(bucket) -> list[str]:
    return [name for name, _ in json.loads(bucket.get("run/step_1/manifest.json"))["files"] if name.startswith("../")]


@pytest.mark.parametrize(
    "hostile",
    ["../../other/d00000-00000.safetensors", "../step_0/../../x", "../step_0/sub/d00000-00000.safetensors",
     "../notastep/d00000-00000.safetensors", "../step_9/d00000-00000.safetensors",
     "../step_7/d00000-00000.safetensors"],
)
def test_hostile_references_on_an_object_store_are_refused(run, hostile):
    [reference] = referenced(run)
    assert reference.startswith("../step_0/") and reference.endswith(DATA)
    for copy in ("other", "run/notastep", "run/step_7", "run/step_0/sub"):  # the bytes, where no step is
        run.put(f"{copy}/{DATA}", run.get(f"run/{reference[3:]}"))
    edit_files(run, lambda name, size: [hostile if name.startswith("../") else name, size])
    with pytest.raises(tc.CorruptCheckpointError) as raised:
        tc.restore(run.url("run/step_1"))
    assert hostile.split("/")[-1] in str(raised.value) and hostile.split("/")[1] in str(raised.value)
    assert not verify(run.url("run/step_1")).ok


@pytest.mark.parametrize("change", [64, -64])
def test_a_referenced_object_of_another_size_is_refused(run, change):
    """Checked before the first read of the object; a size too small for the pieces the
    tables place in it is refused before that, as the rows are loaded."""
    edit_files(run, lambda name, size: [name, size + change if name.startswith("../") else size])
    with pytest.raises(tc.CorruptCheckpointError, match=f"step_0/[^ ]*{DATA}.*((more|fewer) than|past its)"):
        tc.restore(run.url("run/step_1"))


def test_a_referenced_object_deleted_by_hand_fails_the_restore_naming_it(run):
    np.testing.assert_array_equal(tc.restore(run.url("run/step_1"))["base"]["w"], np.arange(4096, dtype=np.float32))
    [reference] = referenced(run)
    run.delete(f"run/{reference[3:]}")
    with pytest.raises(tc.CorruptCheckpointError, match=f"{reference[3:]}.*missing"):
        tc.restore(run.url("run/step_1"))
    report = verify(run.url("run/step_1"))
    assert not report.ok and reference[3:] in str(report.problems[0])


def test_a_restore_checks_only_the_references_it_reads(run):
    """A pod's restore must not probe every referenced object from every host: a reference
    is checked before its first read, so a restore of what step_1 wrote itself touches no
    object of step_0, and one of what lies in step_0 checks it then."""
    [reference] = referenced(run)
    run.delete(f"run/{reference[3:]}")
    np.testing.assert_array_equal(tc.restore(run.url("run/step_1"), subtree="t"), np.ones(4, np.float32))
    with pytest.raises(tc.CorruptCheckpointError, match=f"{reference[3:]}.*missing"):
        tc.restore(run.url("run/step_1"), subtree="base")


def test_cli_gc_verify_diff_export_follow_references_on_an_object_store(bucket, tmp_path, capsys):
    base = {"w": np.arange(4096, dtype=np.float32)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=1, incremental=True) as manager:
        manager.save(0, {"base": base, "t": np.zeros(4, np.float32)})
        manager.save(1, {"base": base, "t": np.ones(4, np.float32)})
    retired = sorted(steps_stored(bucket)["step_0"])
    assert len(retired) == 2 and retired[0].endswith(DATA) and retired[1] == "referenced.json"
    assert main(["gc", bucket.url("run")]) == 0
    assert sorted(steps_stored(bucket)["step_0"]) == retired  # referenced: kept
    step_1 = bucket.url("run/step_1")
    assert main(["verify", step_1]) == 0
    assert main(["diff", "--values", step_1, step_1]) == 0
    assert main(["export", "--subtree", "base", step_1, str(tmp_path / "serving")]) == 0
    np.testing.assert_array_equal(tc.restore(str(tmp_path / "serving"))["w"], base["w"])
    assert main(["ls", bucket.url("run")]) == 0
    assert "step_0" not in capsys.readouterr().out
    for key in bucket.keys("run/step_1/"):  # deleted by hand: nothing references step_0 any more
        bucket.delete(key)
    assert main(["gc", bucket.url("run")]) == 0
    assert steps_stored(bucket) == {}


def test_a_local_tier_is_not_combined_with_incremental_saves(tmp_path):
    with pytest.raises(ValueError, match="incremental=True is not combined with local_directory"):
        tc.CheckpointManager(tmp_path / "run", incremental=True, local_directory=tmp_path / "local")
