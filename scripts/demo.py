#!/usr/bin/env python3
"""The main job: a small Flax training loop on 8 simulated devices, checkpointed with tpu_ckpt.

It trains an MLP with AdamW, saving asynchronously through a CheckpointManager (printing how
long each save blocked training), simulates an interruption, resumes from the latest
committed step on a *different* mesh, exports the params for serving (bfloat16), loads
them the way a serving job would (no optimizer bytes read), and prints a summary.

    python scripts/demo.py [--dir DIR] [--steps 300] [--every 50]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import shlex
import statistics
import sys
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

AUTO = (jax.sharding.AxisType.Auto,) * 2  # let jit propagate shardings through the model


class MLP(nn.Module):
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)


def sharding_for(mesh, x):
    """2-D kernels over both mesh axes where they divide evenly; everything else replicated."""
    x = jnp.asarray(x)
    ok = x.ndim == 2 and x.shape[0] % mesh.shape["data"] == 0 and x.shape[1] % mesh.shape["model"] == 0
    return NamedSharding(mesh, P("data", "model") if ok else P())


def new_state(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    return jax.tree_util.tree_map(lambda x: jax.device_put(jnp.asarray(x), sharding_for(mesh, x)), state)


@jax.jit
def train_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((state.apply_fn(p, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def train(manager, state, first, last, x, y, blocked):
    loss = None
    for step in range(first, last + 1):
        state, loss = train_step(state, x, y)
        jax.block_until_ready(state)  # so that the time below is the save's alone, not the step's
        started = time.perf_counter()
        if manager.save(step, state):
            blocked.append(time.perf_counter() - started)
            print(f"step {step:4d}  loss {float(loss):.5f}  save blocked training for {blocked[-1] * 1e3:6.1f} ms")
    return state, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="working directory (default: a fresh temp dir, kept to look at)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50, help="save the steps that are multiples of N")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="tpu_ckpt_demo_")
    ckpts = os.path.join(root, "ckpts")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype(np.float32)
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype(np.float32)
    options = tc.CheckpointOptions(enable_async=True)
    blocked: list[float] = []
    print(f"tpu_ckpt {tc.__version__} demo: {len(jax.devices())} devices, checkpoints in {ckpts}")

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
    interrupted_at = args.steps * 2 // 3
    # Multiples of --every (Orbax's cadence): an interruption at a multiple loses no step, where
    # TF's rule (steps 1, 1 + every, ...) would resume up to every - 1 steps back.
    cadence = {"save_interval_steps": args.every, "save_on_multiples": True}
    with tc.CheckpointManager(ckpts, max_to_keep=3, **cadence, options=options) as manager:
        train(manager, new_state(mesh), 1, interrupted_at, x, y, blocked)
    print(f"-- interrupted at step {interrupted_at}; committed steps on disk: "
          f"{tc.CheckpointManager(ckpts).all_steps()}")

    other = jax.make_mesh((2, 4), ("data", "model"), axis_types=AUTO)
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_for(other, a)), new_state(other)
    )
    with tc.CheckpointManager(ckpts, max_to_keep=3, **cadence, options=options) as manager:
        started = time.perf_counter()
        state = manager.restore(abstract).replace(apply_fn=MLP().apply, tx=optax.adamw(1e-3))
        restore_s = time.perf_counter() - started
        resumed_from = int(state.step)
        print(f"-- resumed from step {resumed_from} onto mesh (2, 4) in {restore_s * 1e3:.1f} ms")
        state, loss = train(manager, state, resumed_from + 1, args.steps, x, y, blocked)
        manager.wait_until_finished()  # latest_step() counts committed steps only
        if manager.latest_step() != args.steps:
            manager.save(args.steps, state, force=True)  # the final state, whatever the interval
            manager.wait_until_finished()
        kept = manager.all_steps()

    latest = os.path.join(ckpts, f"step_{kept[-1]}")
    serving_dir = tc.export_for_serving(latest, os.path.join(root, "serving"), dtype="bfloat16")
    params = tc.restore(latest, subtree="params", options=tc.CheckpointOptions(skip_slot_variables=True))
    served = np.asarray(MLP().apply(params, x[:8]))
    live = np.asarray(state.apply_fn(state.params, x[:8]))
    same = bool(np.allclose(served, live, rtol=1e-5, atol=1e-6))  # sharded vs. host math may differ in the last bit
    files = sorted(os.listdir(latest))
    size = sum(os.path.getsize(os.path.join(latest, f)) for f in files)
    serving_size = sum(os.path.getsize(os.path.join(serving_dir, f)) for f in os.listdir(serving_dir))

    print("-- summary")
    print(f"   final loss {float(loss):.5f} at step {int(state.step)}; kept steps {kept}")
    print(f"   {len(blocked)} async saves: median blocking {statistics.median(blocked) * 1e3:.1f} ms, "
          f"max {max(blocked) * 1e3:.1f} ms")
    print(f"   each checkpoint: {size / 1e6:.2f} MB in {len(files)} files; "
          f"serving export (bf16, params only): {serving_size / 1e6:.2f} MB")
    print(f"   serving restore (skip_slot_variables) predicts like the live model: {same}")
    cli = _cli()
    print(f"-- kept in {root}: look with `{cli} ls {ckpts}` or `{cli} inspect {latest}`; remove it when done")
    if not same:
        raise SystemExit("the serving restore differs from the live model")


def _cli() -> str:
    """The tpu-ckpt command as this interpreter has it, so the hint works without activating
    its virtualenv (`make demo` never does): `.venv/bin/tpu-ckpt` where the console script is
    installed beside it, else `<python> -m tpu_ckpt`."""
    script = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")
    command = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "tpu_ckpt"]
    relative = [os.path.relpath(part) if part.startswith(os.getcwd() + os.sep) else part for part in command]
    return shlex.join(relative)


if __name__ == "__main__":
    main()
