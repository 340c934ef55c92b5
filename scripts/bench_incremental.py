"""The LoRA loop of issue #25 for scripts/benchmark.py: bytes written and time per save of a
CheckpointManager with and without ``incremental=True`` (local disk).

A frozen base of ``base_mb`` MB (the same jax.Arrays every step) and an adapter of about 1%
of it with its Adam state (new arrays every step); ``saves`` saves, the first (which writes
everything either way) left out of the medians. Run alone: ``python scripts/bench_incremental.py``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

import tpu_ckpt as tc

MB = 1 << 20


def lora_state(base_mb: int, layers: int = 8):
    width = int((base_mb * MB / 4 / layers) ** 0.5) // 64 * 64
    rank = max(1, width // 200)
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    base = {f"layer_{i}": jax.random.normal(keys[i], (width, width)) for i in range(layers)}
    adapter = {f"layer_{i}": {"a": jax.random.normal(keys[layers + i], (width, rank)) * 0.01, "b": jnp.zeros((rank, width))}
               for i in range(layers)}
    return base, adapter


def loop(directory: str, incremental: bool, base_mb: int, saves: int) -> tuple[list[int], list[float], int]:
    base, adapter = lora_state(base_mb)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(adapter)

    @jax.jit
    def step(adapter, opt_state):
        grads = jax.tree.map(lambda a: jnp.ones_like(a) * 1e-3, adapter)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(adapter, updates), opt_state

    written, seconds = [], []
    with tc.CheckpointManager(directory, max_to_keep=2, incremental=incremental) as manager:
        for i in range(saves):
            adapter, opt_state = step(adapter, opt_state)
            jax.block_until_ready((adapter, opt_state))
            started = time.perf_counter()
            manager.save(i, {"base": base, "adapter": adapter, "opt": opt_state})
            seconds.append(time.perf_counter() - started)
            d = os.path.join(directory, f"step_{i}")
            written.append(sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)))
    trained = sum(x.nbytes for x in jax.tree.leaves((adapter, opt_state)) if hasattr(x, "nbytes"))
    return written, seconds, trained


def incremental_rows(workdir: str, base_mb: int = 256, saves: int = 6) -> list[dict]:
    """The rows: per mode, median bytes written and seconds per save (saves 2..n)."""
    rows = []
    for incremental in (False, True):
        directory = os.path.join(workdir, f"lora_{'inc' if incremental else 'full'}")
        written, seconds, trained = loop(directory, incremental, base_mb, saves)
        shutil.rmtree(directory, ignore_errors=True)
        rows.append({"metric": f"LoRA save, incremental={incremental}", "bytes_per_save": int(statistics.median(written[1:])),
                     "seconds_per_save": round(statistics.median(seconds[1:]), 4), "trained_bytes": trained})
    for row in rows:
        print(f"{row['metric']:<32} {row['bytes_per_save'] / MB:10.2f} MB/save  {row['seconds_per_save']:8.4f} s/save  "
              f"(adapter+Adam {row['trained_bytes'] / MB:.2f} MB)", flush=True)
    return rows


if __name__ == "__main__":
    scratch = tempfile.mkdtemp(prefix="tpu_ckpt_bench_inc_")
    try:
        incremental_rows(scratch, int(sys.argv[1]) if len(sys.argv) > 1 else 256)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
