"""Slot classification at save time and skip_slot_variables on restore, with real optax/Flax."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import tpu_ckpt as tc
from tests.support.helpers import manifest

PARAMS = {"Dense_0": {"kernel": jnp.ones((64, 128)), "bias": jnp.zeros(128)}, "scale": jnp.float32(2.0)}

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def slots_of(path) -> set[str]:
    return {leaf["key"] for leaf in manifest(path)["leaves"] if leaf.get("is_slot")}


def linen_state(tx):
    return train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)


def test_adamw_train_state(tmp_path):
    tc.save(tmp_path / "c", linen_state(optax.adamw(1e-3)))
    assert slots_of(tmp_path / "c") == {
        "opt_state/0/mu/Dense_0/kernel", "opt_state/0/mu/Dense_0/bias",
        "opt_state/0/nu/Dense_0/kernel", "opt_state/0/nu/Dense_0/bias",
    }  # scalar moments (of the scalar param) and count are not slots
    meta = tc.metadata(tmp_path / "c")
    assert meta["opt_state"][0]["mu"]["Dense_0"]["kernel"].is_slot
    assert not meta["params"]["Dense_0"]["kernel"].is_slot and not meta["opt_state"][0]["count"].is_slot


@pytest.mark.parametrize(
    ("tx", "field"),
    [(optax.sgd(0.1, momentum=0.9), "trace"), (optax.rmsprop(1e-3), "nu"), (optax.adafactor(1e-3), "v_row")],
)
def test_other_optimizers(tmp_path, tx, field):
    tc.save(tmp_path / "c", linen_state(tx))
    slots = slots_of(tmp_path / "c")
    assert any(f"/{field}/" in key for key in slots), slots
    assert not any(key.startswith("params/") for key in slots)


def test_plain_optax_state_under_any_name(tmp_path):
    tree = {"params": PARAMS, "optimizer": optax.adam(1e-3).init(PARAMS), "ema": PARAMS}
    tc.save(tmp_path / "c", tree)
    assert slots_of(tmp_path / "c") == {
        "optimizer/0/mu/Dense_0/kernel", "optimizer/0/mu/Dense_0/bias",
        "optimizer/0/nu/Dense_0/kernel", "optimizer/0/nu/Dense_0/bias",
    }


def test_nnx_optimizer_state(tmp_path):
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tc.save(tmp_path / "c", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    slots = slots_of(tmp_path / "c")
    assert "optimizer/opt_state/0/mu/kernel/value" in slots and "optimizer/opt_state/0/nu/bias/value" in slots
    assert not any(k.startswith("model/") or k.endswith("count/value") for k in slots)


def test_user_predicate_replaces_the_rule(tmp_path):
    tree = {"w": np.ones(4), "my_moments": {"w": np.ones(4)}}
    tc.save(tmp_path / "c", tree, is_slot=lambda key, leaf: key.startswith("my_moments/"))
    assert slots_of(tmp_path / "c") == {"my_moments/w"}


def test_skip_slots_with_a_train_state_target(tmp_path):
    state = linen_state(optax.adamw(1e-3))
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads)
    tc.save(tmp_path / "c", state)
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), state)
    out = tc.restore(tmp_path / "c", target, options=tc.CheckpointOptions(skip_slot_variables=True))
    assert type(out) is train_state.TrainState
    np.testing.assert_array_equal(
        np.asarray(out.params["Dense_0"]["kernel"]), np.asarray(state.params["Dense_0"]["kernel"])
    )
    assert int(out.opt_state[0].count) == 1  # non-slot optimizer state is restored
    assert out.opt_state[0].mu["Dense_0"]["kernel"] is target.opt_state[0].mu["Dense_0"]["kernel"]  # unchanged
    assert isinstance(out.opt_state[0].mu["Dense_0"]["kernel"], jax.ShapeDtypeStruct)


def test_skip_slots_without_target_leaves_them_out(tmp_path):
    tc.save(tmp_path / "c", linen_state(optax.adam(1e-3)))
    out = tc.restore(tmp_path / "c", options=tc.CheckpointOptions(skip_slot_variables=True))
    assert set(out["opt_state"][0]) == {"count", "mu", "nu"}  # only the scalar moments remain
    assert set(out["opt_state"][0]["mu"]) == {"scale"}
    assert "kernel" in out["params"]["Dense_0"]


SERVING_SCRIPT = """
import json, sys
sys.modules["optax"] = None  # a serving job without optax installed
import tpu_ckpt as tc

from tests.support.helpers import read_chars

path, skip = sys.argv[1], sys.argv[2] == "skip"
options = tc.CheckpointOptions(skip_slot_variables=skip)
tc.restore(path, options=options)  # what a restore imports (JAX, the library's modules) is read here, not counted
before = read_chars()
out = tc.restore(path, options=options)
print(json.dumps({"read": read_chars() - before, "top": sorted(out)}))
"""


def test_a_serving_restore_reads_no_slot_bytes_and_needs_no_optax(tmp_path):
    big = {"Dense_0": {"kernel": jnp.ones((512, 512)), "bias": jnp.zeros(512)}}
    tc.save(tmp_path / "c", train_state.TrainState.create(apply_fn=None, params=big, tx=optax.adam(1e-3)))

    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", SERVING_SCRIPT, str(tmp_path / "c"), mode],
            capture_output=True, text=True, check=True, cwd=ROOT,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    full, serving = run("full"), run("skip")
    assert serving["read"] < 0.4 * full["read"], (serving, full)
    assert serving["top"] == ["opt_state", "params", "step"]
    assert os.path.getsize(tmp_path / "c" / "manifest.json") < serving["read"]
