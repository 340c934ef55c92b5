"""The LoRA loop of issue #25 for benchmarks/benchmark.py: bytes written and time per save of a
CheckpointManager with and without ``incremental=True``, on a local disk or (``--url s3``)
on a moto S3 server this script starts.

A frozen base of ``base_mb`` MB (the same jax.Arrays every step) and an adapter of about 1%
of it with its Adam state (new arrays every step); ``saves`` saves, the first (which writes
everything either way) left out of the medians. Run alone:
``python benchmarks/bench_incremental.py [--base-mb 256] [--url s3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import tpu_ckpt as tc
from tpu_ckpt.settings import configure

MB = 1 << 20


def lora_state(base_mb: int, layers: int = 8):
    width = int((base_mb * MB / 4 / layers) ** 0.5) // 64 * 64
    rank = max(1, width // 200)
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    base = {f"layer_{i}": jax.random.normal(keys[i], (width, width)) for i in range(layers)}
    adapter = {f"layer_{i}": {"a": jax.random.normal(keys[layers + i], (width, rank)) * 0.01,
                              "b": jnp.zeros((rank, width))}
               for i in range(layers)}
    return base, adapter


def local_bytes(step: str) -> int:
    return sum(os.path.getsize(os.path.join(step, f)) for f in os.listdir(step))


def loop(
    run: str, incremental: bool, base_mb: int, saves: int, stored: Callable[[str], int]
) -> tuple[list[int], list[float], int]:
    base, adapter = lora_state(base_mb)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(adapter)

    @jax.jit
    def step(adapter, opt_state):
        grads = jax.tree.map(lambda a: jnp.ones_like(a) * 1e-3, adapter)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(adapter, updates), opt_state

    written, seconds = [], []
    with tc.CheckpointManager(run, max_to_keep=2, incremental=incremental) as manager:
        for i in range(saves):
            adapter, opt_state = step(adapter, opt_state)
            jax.block_until_ready((adapter, opt_state))
            started = time.perf_counter()
            manager.save(i, {"base": base, "adapter": adapter, "opt": opt_state})
            seconds.append(time.perf_counter() - started)
            written.append(stored(f"{run}/step_{i}"))
    trained = sum(x.nbytes for x in jax.tree.leaves((adapter, opt_state)) if hasattr(x, "nbytes"))
    return written, seconds, trained


def incremental_rows(workdir: str, base_mb: int = 256, saves: int = 6, url: str = "") -> list[dict]:
    """The rows: per mode, median bytes written and seconds per save (saves 2..n). ``url``: a
    bucket prefix to run in (``s3://...``, reached through boto3 for the sizes), else ``workdir``."""
    rows = []
    for incremental in (False, True):
        mode = f"lora_{'inc' if incremental else 'full'}"
        run = f"{url}/{mode}" if url else os.path.join(workdir, mode)
        written, seconds, trained = loop(run, incremental, base_mb, saves, _s3_bytes if url else local_bytes)
        if not url:
            shutil.rmtree(run, ignore_errors=True)
        rows.append({"metric": f"LoRA save{' on ' + url.split(':')[0] if url else ''}, incremental={incremental}",
                     "bytes_per_save": int(statistics.median(written[1:])),
                     "seconds_per_save": round(statistics.median(seconds[1:]), 4), "trained_bytes": trained})
    for row in rows:
        print(f"{row['metric']:<40} {row['bytes_per_save'] / MB:10.2f} MB/save  {row['seconds_per_save']:8.4f} s/save  "
              f"(adapter+Adam {row['trained_bytes'] / MB:.2f} MB)", flush=True)
    print(f"incremental / full save time: {rows[1]['seconds_per_save'] / rows[0]['seconds_per_save']:.3f}", flush=True)
    return rows


def _s3_bytes(step: str) -> int:
    """Bytes of the objects under an s3:// step prefix, as the server lists them."""
    import boto3  # installed with moto

    bucket, _, prefix = step.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(item["Size"] for page in pages for item in page.get("Contents", []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-mb", type=int, default=256)
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--url", choices=["local", "s3"], default="local")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="tpu_ckpt_bench_inc_")
    moto = None
    try:
        url = ""
        if args.url == "s3":
            from multitier_bench import start_moto  # benchmarks/: starts moto_server with the bucket "bench"

            moto, endpoint = start_moto(scratch)
            os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                              AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
            configure(None)  # settings read AWS_ENDPOINT_URL once: read it again
            url = "s3://bench/lora"
        incremental_rows(scratch, args.base_mb, args.saves, url)
    finally:
        if moto is not None:
            moto.kill()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
