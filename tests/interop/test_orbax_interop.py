"""Orbax interop: real Orbax checkpoints, written by orbax-checkpoint itself, converted to
tpu_ckpt and back, bit for bit (tc.import_orbax, tc.export_orbax, tpu-ckpt import-orbax/export-orbax)."""

import ast
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import bits, manifest, read_chars
from tpu_ckpt import cli
from tpu_ckpt.format import flatten

BIG = 256 * 128 * 4  # the float32 kernel, and its mu and nu: each larger than BOUND
BOUND = 64 << 10


def make_state(mesh, steps=1, seed=0):
    """A Flax TrainState with Adam after ``steps`` updates, sharded over the (4, 2) mesh."""
    params = {
        "dense": {"kernel": jnp.zeros((256, 128), jnp.float32), "bias": jnp.zeros(128, jnp.float32)},
        "embed": jnp.zeros((64, 64), jnp.bfloat16),
    }
    specs = {"dense": {"kernel": P("data", "model"), "bias": P("data")}, "embed": P("model", "data")}
    params = jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    key = jax.random.key(seed)
    for _ in range(steps):
        key, *subkeys = jax.random.split(key, 4)
        grads = jax.tree_util.tree_map(
            lambda p, k: jax.random.normal(k, p.shape, p.dtype), state.params, jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(state.params), subkeys
            ),
        )
        state = state.apply_gradients(grads=grads)
    return state


def abstract(state):
    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map(one, state)


def by_key(tree):
    return {key: leaf for key, _, leaf in flatten(tree)[0]}


def assert_bit_exact(restored, original):
    got, want = by_key(restored), by_key(original)
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, jax.Array | np.ndarray):
            assert np.asarray(got[key]).dtype == value.dtype, key
            np.testing.assert_array_equal(bits(got[key]), bits(value), err_msg=key)
        else:
            assert got[key] == value, key


def array_leaves(path):
    """(key, dtype, shape, is_slot) of each array leaf in a tpu_ckpt manifest."""
    return {
        (e["key"], e["dtype"], tuple(e["shape"]), e["is_slot"])
        for e in manifest(path)["leaves"] if e["kind"] == "array"
    }


def orbax_save(path, state):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()


@pytest.fixture(scope="module")
def state(mesh42):
    return make_state(mesh42, steps=2)


@pytest.fixture(scope="module")
def orbax_ckpt(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    orbax_save(path, state)
    return path


def test_a_standard_checkpoint_converts_bit_exactly_with_tc_saves_slot_flags(orbax_ckpt, state, mesh42, tmp_path):
    [report] = tc.import_orbax(orbax_ckpt, tmp_path / "tc")
    assert report.dst == str(tmp_path / "tc") and report.step is None and not report.skipped

    assert_bit_exact(tc.restore(tmp_path / "tc"), state)  # to numpy, no target
    restored = tc.restore(tmp_path / "tc", abstract(state))  # onto the saved shardings
    assert type(restored) is train_state.TrainState
    assert restored.params["dense"]["kernel"].sharding == state.params["dense"]["kernel"].sharding
    assert_bit_exact(restored, state)

    # The flags and dtypes tc.save gives the original state, and exactly the leaves (Nones
    # included) that tc.save gives the tree Orbax restores without a target.
    tc.save(tmp_path / "saved", state).wait()
    assert array_leaves(tmp_path / "tc") == array_leaves(tmp_path / "saved")
    assert ("params/embed", "bfloat16", (64, 64), False) in array_leaves(tmp_path / "tc")
    assert ("opt_state/0/mu/embed", "bfloat16", (64, 64), True) in array_leaves(tmp_path / "tc")
    tc.save(tmp_path / "from_orbax", ocp.StandardCheckpointer().restore(orbax_ckpt)).wait()
    placement = ("pieces", "sharding", "grid", "table")
    strip = [{k: v for k, v in e.items() if k not in placement} for e in manifest(tmp_path / "from_orbax")["leaves"]]
    assert [{k: v for k, v in e.items() if k not in placement} for e in manifest(tmp_path / "tc")["leaves"]] == strip
    kernel = next(e for e in manifest(tmp_path / "tc")["leaves"] if e["key"] == "params/dense/kernel")
    assert kernel["sharding"] == {"type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}


def test_leaves_are_read_in_batches_within_the_bound(orbax_ckpt, state, tmp_path):
    """The bound is checked on the bytes each batch held, as the converter counts them."""
    [report] = tc.import_orbax(orbax_ckpt, tmp_path / "tc", max_batch_bytes=BOUND)
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array))
    assert report.nbytes == sum(report.batches) == total
    assert all(b <= BOUND or b == BIG for b in report.batches), report.batches
    assert report.batches.count(BIG) == 3  # the kernel, its mu and its nu: each read alone
    assert report.peak_batch_bytes == BIG and len(report.batches) > 4
    assert_bit_exact(tc.restore(tmp_path / "tc"), state)
    [one] = tc.import_orbax(orbax_ckpt, tmp_path / "one_batch")
    assert one.batches == (total,)


def test_each_batch_reads_its_own_leaves_only(orbax_ckpt, tmp_path):
    """Orbax skips the leaves left out of a batch (its PLACEHOLDER), so converting in ten
    batches reads the data once, as one restore does, not ten times; each batch reads
    Orbax's metadata again (tens of KB here, beside 419 KB of arrays)."""
    before = read_chars()
    ocp.PyTreeCheckpointer().restore(orbax_ckpt)
    once = read_chars() - before
    before = read_chars()
    [report] = tc.import_orbax(orbax_ckpt, tmp_path / "tc", max_batch_bytes=1)  # one leaf per batch
    assert len(report.batches) == 10
    assert read_chars() - before < 3 * once
    with pytest.raises(ValueError, match="positive"):
        tc.import_orbax(orbax_ckpt, tmp_path / "never", max_batch_bytes=0)


def test_a_checkpoint_manager_directory_converts_step_by_step_and_resumes(mesh42, tmp_path):
    states = {step: make_state(mesh42, steps=step // 10 + 1, seed=step) for step in (0, 10, 20)}
    options = ocp.CheckpointManagerOptions(save_interval_steps=10)
    with ocp.CheckpointManager(tmp_path / "orbax", options=options) as manager:
        for step in range(21):
            manager.save(step, args=ocp.args.StandardSave(states.get(step, states[0])))
        manager.wait_until_finished()
    assert sorted(p.name for p in (tmp_path / "orbax").iterdir() if p.is_dir()) == ["0", "10", "20"]

    reports = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc", max_batch_bytes=BOUND)
    assert [(r.step, pathlib.Path(r.dst).name, r.skipped) for r in reports] == [
        (0, "step_0", False), (10, "step_10", False), (20, "step_20", False)
    ]
    with tc.CheckpointManager(tmp_path / "tc") as ours:
        assert ours.all_steps() == [0, 10, 20]
        assert_bit_exact(ours.restore(abstract(states[20])), states[20])
        assert_bit_exact(ours.restore(10), states[10])
    again = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert [r.skipped for r in again] == [True, True, True]

    back = tc.export_orbax(tmp_path / "tc", tmp_path / "back")
    assert [pathlib.Path(p).name for p in back] == ["0", "10", "20"]
    with ocp.CheckpointManager(tmp_path / "back") as theirs:
        assert theirs.all_steps() == [0, 10, 20]
        assert_bit_exact(theirs.restore(10, args=ocp.args.StandardRestore(abstract(states[10]))), states[10])


def test_a_step_with_several_items_needs_the_item_named(state, tmp_path):
    with ocp.CheckpointManager(tmp_path / "orbax", item_names=("state", "ema", "notes")) as manager:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), ema=ocp.args.StandardSave(state.params),
            notes=ocp.args.JsonSave({"a": 1}),
        )
        manager.save(5, args=args)
        manager.wait_until_finished()
    with pytest.raises(tc.CheckpointNotFoundError, match=r"several \(ema, state\)"):
        tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    [report] = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc", item="ema")
    assert report.step == 5 and pathlib.Path(report.dst).name == "step_5"
    assert_bit_exact(tc.restore(report.dst), {"ema": state.params, "notes": {"a": 1}})  # with the JSON item
    # One step directory, named as such: its item is converted into one checkpoint.
    tc.import_orbax(tmp_path / "orbax" / "5", tmp_path / "one", item="state")
    assert_bit_exact(tc.restore(tmp_path / "one", abstract(state), subtree="state"), state)


def test_export_writes_what_orbax_restores_bit_exactly(orbax_ckpt, state, tmp_path):
    tc.import_orbax(orbax_ckpt, tmp_path / "tc")
    assert tc.export_orbax(tmp_path / "tc", tmp_path / "back") == [str(tmp_path / "back")]
    checkpointer = ocp.StandardCheckpointer()
    assert_bit_exact(checkpointer.restore(tmp_path / "back", abstract(state)), state)
    restored = checkpointer.restore(tmp_path / "back")  # no target: numpy arrays
    assert restored["params"]["embed"].dtype == jnp.bfloat16
    assert_bit_exact(restored["opt_state"][0], state.opt_state[0]._asdict())


def test_a_target_decides_the_slot_flags_as_in_tc_save(mesh42, tmp_path):
    """Outside ``opt_state`` only optax's own state types mark slots; Orbax restores them as
    plain dicts, so the target carries them over, as ``tc.save(target)`` would."""
    params = {"w": jnp.ones((8, 4), jnp.float32)}
    tree = {"params": params, "opt": optax.adam(1e-3).init(params)}
    orbax_save(tmp_path / "orbax", tree)
    tc.import_orbax(tmp_path / "orbax", tmp_path / "plain")
    tc.import_orbax(tmp_path / "orbax", tmp_path / "typed", target=abstract(tree))
    tc.save(tmp_path / "saved", tree).wait()
    assert not any(slot for *_, slot in array_leaves(tmp_path / "plain"))
    assert array_leaves(tmp_path / "typed") == array_leaves(tmp_path / "saved")
    assert ("opt/0/mu/w", "float32", (8, 4), True) in array_leaves(tmp_path / "typed")
    with pytest.raises(ValueError, match="target has no leaves"):
        tc.import_orbax(tmp_path / "orbax", tmp_path / "wrong", target={"params": params})


def test_the_commands_convert_both_ways(orbax_ckpt, state, tmp_path, capsys):
    assert cli.main(["import-orbax", str(orbax_ckpt), str(tmp_path / "tc"), "--max-batch-bytes", str(BOUND)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"wrote {tmp_path / 'tc'}: 12 leaves, 419.3 KB read in ")
    assert out[0].endswith("batches of at most 131.1 KB")
    assert out[1].startswith("converted 1 checkpoint in ")
    assert cli.main(["inspect", "--json", str(tmp_path / "tc")]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert sum(leaf.get("is_slot", False) for leaf in inspected["leaves"]) == 6
    assert cli.main(["export-orbax", str(tmp_path / "tc"), str(tmp_path / "back")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {tmp_path / 'back'}"
    assert_bit_exact(ocp.StandardCheckpointer().restore(tmp_path / "back", abstract(state)), state)
    assert cli.main(["import-orbax", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "No Orbax checkpoint at" in capsys.readouterr().err


def test_without_orbax_the_error_says_what_to_install(orbax_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # what an absent package looks like to import
    with pytest.raises(ImportError, match="pip install orbax-checkpoint"):
        tc.import_orbax(orbax_ckpt, tmp_path / "tc")
    assert cli.main(["export-orbax", str(tmp_path / "tc"), str(tmp_path / "back")]) == 2
    assert "pip install orbax-checkpoint" in capsys.readouterr().err


def test_orbax_is_imported_inside_the_interop_functions_only():
    """The core never needs Orbax: no module imports it at module level, and only
    orbax_interop.py imports it at all."""
    package = pathlib.Path(tc.__file__).parent
    for path in package.glob("*.py"):
        module = ast.parse(path.read_text())
        top = {alias.name for node in module.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {node.module for node in module.body if isinstance(node, ast.ImportFrom) and node.module}
        assert not any(name.split(".")[0] in ("orbax", "etils") for name in top), path
        anywhere = ast.dump(module)
        assert ("'orbax.checkpoint'" in anywhere) == (path.name == "orbax_interop.py"), path
