"""tc.abstract_target: the checkpoint's tree as a target with the saved shardings, so a resumed
run compiles the same program and its losses are bit-identical to an uninterrupted run's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def _init(mesh):
    rng = np.random.default_rng(0)
    params = {
        "w": jax.device_put(rng.standard_normal((16, 8), dtype=np.float32), NamedSharding(mesh, P("data", "model"))),
        "b": jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P("model"))),
    }
    return {"params": params, "step": jax.device_put(jnp.int32(0), NamedSharding(mesh, P())), "rng": jax.random.key(3)}


@functools.partial(jax.jit, donate_argnums=0)
def _train_step(state, x):
    rng, dropout = jax.random.split(state["rng"])

    def loss_fn(params):
        h = x @ params["w"] + params["b"]
        keep = jax.random.bernoulli(dropout, 0.9, h.shape)
        return jnp.mean(jnp.where(keep, h, 0.0) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, state["params"], grads)
    return {"params": params, "step": state["step"] + 1, "rng": rng}, loss


def _batch(step):
    return np.random.default_rng(100 + step).standard_normal((32, 16), dtype=np.float32)


def _run(state, steps):
    losses = []
    for step in steps:
        state, loss = _train_step(state, _batch(step))
        losses.append(np.asarray(loss).tobytes())
    return state, losses


def test_an_interrupted_and_resumed_run_has_bit_identical_losses(tmp_path):
    mesh = _mesh()
    _, uninterrupted = _run(_init(mesh), range(8))
    state, first = _run(_init(mesh), range(4))
    tc.save(tmp_path / "c", {**state, "it": tc.PerProcess({"next": 4}), "config": "lr=0.01"}).wait()
    del state
    target = tc.abstract_target(tmp_path / "c")
    assert target["params"]["w"].sharding == NamedSharding(mesh, P("data", "model"))
    assert target["rng"].dtype == jax.random.key(0).dtype and isinstance(target["it"], tc.PerProcess)
    assert target["config"] == "lr=0.01"
    restored = tc.restore(tmp_path / "c", target)
    assert restored["it"] == {"next": 4} and restored["step"].sharding == NamedSharding(mesh, P())
    state = {k: restored[k] for k in ("params", "step", "rng")}
    _, second = _run(state, range(4, 8))
    assert first + second == uninterrupted


def test_leaves_saved_on_one_device_or_the_host_come_back_replicated(tmp_path):
    tc.save(tmp_path / "c", {"host": np.arange(4), "one": jnp.ones(3), "blob": b"xyz", "n": 1}).wait()
    target = tc.abstract_target(tmp_path / "c")
    assert target["host"].sharding.spec == P() and len(target["host"].sharding.device_set) == len(jax.devices())
    assert target["blob"] == b"" and target["n"] == 1
    back = tc.restore(tmp_path / "c", target)
    assert back["blob"] == b"xyz" and len(back["one"].sharding.device_set) == len(jax.devices())


def test_another_mesh_and_a_subtree(tmp_path):
    tc.save(tmp_path / "c", _init(_mesh())).wait()
    other = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
    target = tc.abstract_target(tmp_path / "c", other, subtree="params")
    assert set(target) == {"w", "b"} and target["w"].sharding.mesh == other
    back = tc.restore(tmp_path / "c", target, subtree="params")
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(_init(_mesh())["params"]["w"]))
    with pytest.raises(ValueError, match="'params/b'.*'model'"):
        tc.abstract_target(tmp_path / "c", jax.sharding.Mesh(np.array(jax.devices()), ("data",)))
    with pytest.raises(tc.TargetMismatchError):
        tc.abstract_target(tmp_path / "c", subtree="nope")


def test_64_bit_leaves_without_x64_come_back_exact_on_the_host(tmp_path):
    """JAX without jax_enable_x64 holds int64 as int32: "restore as saved" keeps such leaves
    numpy targets (exact), and a device target of a 64-bit dtype is refused, not narrowed.
    (The suite runs with x64 on: JAX's default is off.)"""
    jax.config.update("jax_enable_x64", False)
    try:
        _without_x64(tmp_path)
    finally:
        jax.config.update("jax_enable_x64", True)


def _without_x64(tmp_path) -> None:
    saved = {"count": np.array([2**40 + 7, -1], np.int64), "u": np.array([2**63 + 5], np.uint64),
             "f": np.array([1e300]), "w": jnp.ones(3)}
    tc.save(tmp_path / "c", saved).wait()
    target = tc.abstract_target(tmp_path / "c")
    assert all(isinstance(target[k], np.ndarray) for k in ("count", "u", "f")), target
    assert isinstance(target["w"], jax.ShapeDtypeStruct)
    back = tc.restore(tmp_path / "c", target)
    for key in ("count", "u", "f"):
        assert back[key].dtype == saved[key].dtype and np.array_equal(back[key], saved[key]), (key, back[key])
    device = {"count": jax.ShapeDtypeStruct((2,), np.int64, sharding=NamedSharding(_mesh(), P()))}
    with pytest.raises(tc.TargetMismatchError, match="'count'.*jax_enable_x64 would narrow it"):
        tc.restore(tmp_path / "c", device)


def test_a_mesh_or_subtree_of_the_wrong_type_is_a_type_error(tmp_path):
    tc.save(tmp_path / "c", [{"w": np.ones(2, np.float32)}, {"b": np.ones(1, np.float32)}]).wait()
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        tc.abstract_target(tmp_path / "c", jax.devices())
    for subtree in (0, ("0",), ["0"]):
        with pytest.raises(TypeError, match="subtree must be a key path string"):
            tc.restore(tmp_path / "c", subtree=subtree)
        with pytest.raises(TypeError, match="subtree must be a key path string"):
            tc.check_restore(tmp_path / "c", subtree=subtree)
    assert np.array_equal(tc.restore(tmp_path / "c", subtree="0")["w"], np.ones(2, np.float32))
