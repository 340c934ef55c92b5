"""Real Flax models: Linen TrainState (AdamW, SGD momentum) and NNX, resumed after a restore."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.flax_mlp import X, Y, new_state, train_step


def train(state, steps):
    losses = []
    for _ in range(steps):
        state, loss = train_step(state, X, Y)
        losses.append(float(loss))
    return state, losses


@pytest.mark.parametrize("tx", [optax.adamw(1e-2), optax.sgd(1e-2, momentum=0.9)], ids=["adamw", "sgd_momentum"])
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_linen_train_state_resumes_exactly(tmp_path, mesh24, tx, sharded):
    state, _ = train(new_state(tx), 3)
    tc.save(tmp_path / "c", state)
    _, expected = train(state, 3)

    def abstract(x):
        x = jnp.asarray(x)
        sharding = NamedSharding(mesh24, P()) if sharded else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target = jax.tree_util.tree_map(abstract, new_state(tx))
    restored = tc.restore(tmp_path / "c", target)
    assert type(restored) is train_state.TrainState and int(restored.step) == 3
    restored = restored.replace(apply_fn=state.apply_fn, tx=state.tx)
    _, resumed = train(restored, 3)
    np.testing.assert_allclose(resumed, expected, rtol=1e-6)


def test_nnx_model_and_optimizer_resume_through_nnx_update(tmp_path):
    def build():
        model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 1, rngs=nnx.Rngs(1)))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model, optimizer = build()
    for _ in range(3):
        step(model, optimizer, X, Y)
    tc.save(tmp_path / "c", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    expected = [float(step(model, optimizer, X, Y)) for _ in range(3)]

    fresh_model, fresh_optimizer = build()
    target = {"model": nnx.state(fresh_model), "optimizer": nnx.state(fresh_optimizer)}
    restored = tc.restore(tmp_path / "c", target)
    nnx.update(fresh_model, restored["model"])
    nnx.update(fresh_optimizer, restored["optimizer"])
    resumed = [float(step(fresh_model, fresh_optimizer, X, Y)) for _ in range(3)]
    np.testing.assert_allclose(resumed, expected, rtol=1e-6)


def test_serving_restore_of_nnx_params_only(tmp_path):
    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tc.save(tmp_path / "c", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    serving = nnx.Linear(16, 4, rngs=nnx.Rngs(42))
    weights = tc.restore(tmp_path / "c", nnx.state(serving), subtree="model")
    nnx.update(serving, weights)
    np.testing.assert_array_equal(np.asarray(serving(X)), np.asarray(model(X)))
