"""Per-process bytes and times of multi-process saves and restores, with real JAX processes.

    python benchmarks/multihost_bench.py [--processes 4] [--mib 256] [--dir /tmp/mh]

Starts N processes on this machine (CPU backend, 4 devices each, gloo), as a pod's hosts
would run, and saves and restores a state four ways: sharded (every process writes its own
pieces), replicated-heavy (most bytes replicated on every device: balanced writes decide who
writes what), the same restored with ``load_and_broadcast`` (each shared piece read once and
sent to the others over TCP), and with ``io_device=0`` (process 0 does all storage IO, the
others send and receive over TCP). For each it prints what every process wrote and read
(``/proc/self/io`` write_bytes and rchar: storage, not sockets) and the save and restore
times. Processes share this machine's cores and disk, so the times show the mechanics, not a
pod's throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import workers  # benchmarks/workers.py


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--worker", nargs=2, metavar=("PORT", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args, int(args.worker[0]), int(args.worker[1]))
    directory = args.dir or tempfile.mkdtemp(prefix="tpu_ckpt_mh_")
    try:
        results = _launch(args, directory)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    _report(results, args)
    return 0


def _launch(args: argparse.Namespace, directory: str) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, __file__, "--processes", str(args.processes), "--mib", str(args.mib), "--dir", directory]
    return workers.launch(command, args.processes, [], env)


def _worker(args: argparse.Namespace, port: int, index: int) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes, process_id=index)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import tpu_ckpt as tc

    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    rows = args.mib * (1 << 20) // 4 // 4096

    def array(shape: tuple[int, ...], spec: P, seed: int) -> jax.Array:
        value = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: value[i])

    trees = {
        "sharded": {"w": array((rows, 4096), P("data", "model"), 0)},
        # 64 leaves of 1/64 of the state, replicated on every device, + a few big replicated ones.
        "replicated": {
            **{f"small{i}": array((rows // 128, 4096), P(), i) for i in range(64)},
            **{f"big{i}": array((rows // 4, 4096), P(), 100 + i) for i in range(2)},
        },
    }
    out = {}
    plain = tc.CheckpointOptions()
    for name, tree, save_options, restore_options in [
        ("sharded", trees["sharded"], plain, plain),
        ("replicated-heavy", trees["replicated"], plain, plain),
        ("+ load_and_broadcast", trees["replicated"], plain, tc.CheckpointOptions(load_and_broadcast=True)),
        ("io_device=0", trees["sharded"], tc.CheckpointOptions(io_device=0), tc.CheckpointOptions(io_device=0)),
    ]:
        path = os.path.join(args.dir, name)
        before = _io("write_bytes")
        started = time.perf_counter()
        tc.save(path, tree, options=save_options)
        saved = time.perf_counter() - started
        written = _io("write_bytes") - before
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
        before = _io("rchar")
        started = time.perf_counter()
        tc.restore(path, target, options=restore_options)
        out[name] = {"written": written, "save_s": saved, "read": _io("rchar") - before,
                     "restore_s": time.perf_counter() - started, "state_bytes": sum(a.nbytes for a in tree.values())}
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()
    return 0


def _io(field: str) -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1])


def _report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"{args.processes} processes x 4 CPU devices, state ~{args.mib} MiB per case")
    print(f"{'case':22} {'process':>7} {'MB written':>11} {'share':>6} {'save s':>7} {'MB read':>8} {'restore s':>9}")
    for case in results[0]:
        total = results[0][case]["state_bytes"]
        for index, result in enumerate(results):
            r = result[case]
            print(f"{case:22} {index:7d} {r['written'] / 1e6:11.1f} {r['written'] / total:6.0%} "
                  f"{r['save_s']:7.2f} {r['read'] / 1e6:8.1f} {r['restore_s']:9.2f}")


if __name__ == "__main__":
    sys.exit(main())
