"""A small real Flax model and its training step, shared by the tests that train one."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state

X = np.random.default_rng(0).normal(size=(32, 16)).astype(np.float32)
Y = X.sum(axis=1, keepdims=True)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))


@jax.jit
def train_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((state.apply_fn(p, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def new_state(tx):
    model = MLP()
    return train_state.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), X[:1]), tx=tx)
