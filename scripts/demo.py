#!/usr/bin/env python3
"""The main job: train a small Flax model on 8 simulated devices, checkpointing as it goes.

Saves a sharded TrainState every few steps, restores the latest one onto a different mesh
(and as plain numpy for a serving-style read of the params), checks every byte came back,
and prints what was written and how long it took. Runs on CPU in well under a minute.

    python scripts/demo.py [--dir /tmp/tpu_ckpt_demo] [--steps 30]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import shutil
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc


class MLP(nn.Module):
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)


def shard_like_params(tree, mesh):
    """Shards 2-D kernels over both mesh axes and replicates everything else."""

    def place(x):
        x = jnp.asarray(x)
        spec = P("data", "model") if x.ndim == 2 and x.shape[0] % 4 == 0 and x.shape[1] % 2 == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(place, tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a fresh temp dir)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="save every N steps")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tpu_ckpt_demo_")
    os.makedirs(root, exist_ok=True)

    auto = (jax.sharding.AxisType.Auto,) * 2  # let jit propagate shardings through the model
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = shard_like_params(state, mesh)

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(p):
            return jnp.mean((state.apply_fn(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    y = (x[:, :1] * 2.0 + 1.0).astype(np.float32)
    print(f"tpu_ckpt {tc.__version__} demo: {len(jax.devices())} devices, checkpoints in {root}")
    latest = None
    for step in range(1, args.steps + 1):
        state, loss = train_step(state, x, y)
        if step % args.every == 0:
            path = os.path.join(root, f"step_{step}")
            t0 = time.perf_counter()
            tc.save(path, state).wait()
            took = time.perf_counter() - t0
            files = sorted(os.listdir(path))
            size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
            print(f"step {step:4d}  loss {float(loss):.4f}  saved {size / 1e6:6.2f} MB in {len(files)} files, {took * 1e3:6.1f} ms")
            latest = path

    other_mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other_mesh, x.sharding.spec)), state
    )
    t0 = time.perf_counter()
    restored = tc.restore(latest, abstract)
    jax.block_until_ready(restored)
    took = time.perf_counter() - t0
    same = jax.tree_util.tree_all(
        jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), state, restored)
    )
    print(f"restored {latest} onto mesh (2, 4) in {took * 1e3:.1f} ms; identical to the live state: {same}")
    params_only = tc.restore(latest, subtree="params")
    n = sum(v.size for v in jax.tree_util.tree_leaves(params_only))
    print(f"params alone as numpy (serving-style): {n} values")
    for key, meta in sorted(_flat_metadata(tc.metadata(latest)).items())[:6]:
        print(f"  {key:45s} {str(meta.shape):12s} {meta.dtype}  {meta.nbytes} B")
    if not args.dir:
        shutil.rmtree(root)
    if not same:
        raise SystemExit("restored state differs from the saved one")


def _flat_metadata(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat_metadata(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(tree, list):
        return _flat_metadata(dict(enumerate(tree)), prefix)
    return {prefix: tree} if isinstance(tree, tc.ArrayMetadata) else {}


if __name__ == "__main__":
    main()
