"""Incremental saves compare pieces by content: the usual optax LoRA loop (one params tree,
``optax.multi_transform`` with ``set_to_zero`` for the frozen base, ``apply_updates`` making
new arrays every step) writes only the adapter and its optimizer state."""

import logging
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import tpu_ckpt as tc

LAYERS, WIDTH, RANK = 4, 512, 4


class LoraDense(nn.Module):
    """A dense layer with a low-rank adapter, in one params tree."""

    @nn.compact
    def __call__(self, x):
        a = self.param("lora_a", nn.initializers.normal(0.01), (x.shape[-1], RANK), jnp.float32)
        b = self.param("lora_b", nn.initializers.zeros, (RANK, WIDTH), jnp.float32)
        return nn.Dense(WIDTH, name="base")(x) + (x @ a) @ b


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = jnp.tanh(LoraDense(name=f"layer_{i}")(x))
        return x


def label(params):
    """'trained' for the adapters, 'frozen' for the base."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "trained" if str(path[-1].key).startswith("lora") else "frozen", params
    )


def nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def written(step_dir) -> int:
    """Bytes of the files a save wrote into its own step directory (data files, piece tables)."""
    return sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir) if f != "manifest.json")


def lora_loop(directory, steps: int):
    """Trains ``steps`` steps, saving each; returns each step's state on the host, the bytes
    each save wrote, and the adapter's plus the optimizer state's bytes."""
    model, x = Model(), jax.random.normal(jax.random.key(2), (8, WIDTH))
    params = model.init(jax.random.key(0), x)["params"]
    optimizer = optax.multi_transform({"trained": optax.adam(1e-2), "frozen": optax.set_to_zero()}, label(params))
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    states, sizes, kernel = {}, {}, params["layer_0"]["base"]["kernel"]
    with tc.CheckpointManager(directory, max_to_keep=2, incremental=True) as manager:
        for step in range(steps):
            params, opt_state = train_step(params, opt_state)
            assert params["layer_0"]["base"]["kernel"] is not kernel  # a new array, with the same bytes
            kernel = params["layer_0"]["base"]["kernel"]
            state = {"params": params, "opt": opt_state, "step": step}
            manager.save(step, state)
            states[step] = jax.tree.map(np.asarray, state)
            sizes[step] = written(os.path.join(directory, f"step_{step}"))
    adapter = nbytes(
        [leaf for leaf, kind in zip(jax.tree.leaves(params), jax.tree.leaves(label(params))) if kind == "trained"]
    )
    return states, sizes, adapter + nbytes(opt_state)


def test_optax_multi_transform_lora_loop_writes_only_the_trained_bytes(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tpu_ckpt"):
        states, sizes, trained = lora_loop(tmp_path, steps=4)
    frozen = nbytes(states[0]["params"]) + nbytes(states[0]["opt"]) - trained
    assert frozen > 20 * trained, (frozen, trained)  # the base dominates the state
    assert sizes[0] > frozen
    for step in (1, 2, 3):
        assert sizes[step] <= 1.05 * trained, (step, sizes[step], trained)
    logged = [r.getMessage() for r in caplog.records if "incremental save" in r.getMessage()]
    assert len(logged) == 4
    wrote, referenced = map(int, re.search(r"wrote (\d+) bytes .*referenced (\d+) bytes", logged[-1]).groups())
    assert wrote <= sizes[3] and referenced >= frozen, logged[-1]
    manager = tc.CheckpointManager(tmp_path, incremental=True)
    assert manager.all_steps() == [2, 3]
    for step in (2, 3):
        restored = manager.restore(step)
        flat_r, flat_e = jax.tree.leaves(restored), jax.tree.leaves(states[step])
        assert len(flat_r) == len(flat_e)
        for r, e in zip(flat_r, flat_e):
            np.testing.assert_array_equal(np.asarray(r), np.asarray(e), strict=True)


def test_a_new_host_array_with_the_same_bytes_is_referenced_and_a_changed_one_written(tmp_path):
    w = np.arange(4096, dtype=np.float32)
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        manager.save(0, {"w": jnp.asarray(w)})
        manager.save(1, {"w": jnp.asarray(w.copy())})  # another jax.Array, the same bytes
        changed = w.copy()
        changed[4095] = np.nextafter(changed[4095], np.float32(np.inf))  # one bit
        manager.save(2, {"w": jnp.asarray(changed)})
        assert written(tmp_path / "step_1") < 1024 and written(tmp_path / "step_2") > w.nbytes
        np.testing.assert_array_equal(manager.restore(1)["w"], w)
        np.testing.assert_array_equal(manager.restore(2)["w"], changed)


def test_a_piece_that_changed_is_written_until_its_fingerprint_is_known_again(tmp_path):
    """A changed host piece of 1 MiB is not hashed (its sample told); unchanged at the next
    save, it is hashed and written once more; from then on it is referenced."""
    values = [np.arange(1 << 18, dtype=np.float32) + step for step in (0, 1, 1, 1)]
    with tc.CheckpointManager(tmp_path, max_to_keep=None, incremental=True) as manager:
        for step, value in enumerate(values):
            manager.save(step, {"w": jnp.asarray(value)})
        sizes = [written(tmp_path / f"step_{step}") for step in range(4)]
        assert min(sizes[:3]) > values[0].nbytes > sizes[3], sizes
        for step, value in enumerate(values):
            np.testing.assert_array_equal(manager.restore(step)["w"], value)

