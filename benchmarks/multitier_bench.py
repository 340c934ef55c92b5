"""Multi-tier CheckpointManager against a persistent-only one, with real JAX processes.

    python benchmarks/multitier_bench.py [--processes 2] [--mib 512] [--dir /tmp/mt] [--s3]

Starts N processes on this machine (CPU backend, 4 devices each, gloo), each with its own
local directory (its "local SSD"), and saves the same sharded state three ways, async:
a persistent-only manager's save; a multi-tier save of a persistent step (local save,
replica to the next process over TCP, upload of the local files in the background); and a
local-only step. For each: the time ``save`` blocks, and the time until it is committed
(``wait_until_finished``). Then it restores the state from the local tier and from the
persistent tier. ``--s3`` puts the persistent tier on a moto S3 server it starts (else a
directory every process sees). Processes share this machine's cores and disk, so the times
show the mechanics, not a pod's throughput.

    python benchmarks/multitier_bench.py --slices [--processes 4] [--mib 64]

The cost of a local step with and without slice-aware replicas (issue 24): the processes
form 2 simulated slices (``TPU_CKPT_SLICES``, first half slice 0), the state is sharded
inside each slice and replicated across the two, as data parallelism across slices lays it
out. With the slices known, each slice's copy is the other's replica and nothing is sent;
without (one run with ``TPU_CKPT_SLICES`` unset), each process sends its part to a replica
holder over TCP. Per case: seconds per local step and bytes each process sends to other
hosts per local step (counted at the relay client's ``write``), over 4 local steps after a
persistent one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import workers  # benchmarks/workers.py


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB (the whole job's)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--s3", action="store_true", help="persistent tier on a moto S3 server")
    parser.add_argument("--slices", action="store_true", help="local steps with and without slice-aware replicas")
    parser.add_argument("--worker", nargs=3, metavar=("PORT", "INDEX", "PERSISTENT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = _slices_worker if args.slices else _worker
        return worker(args, int(args.worker[0]), int(args.worker[1]), args.worker[2])
    if args.slices:
        return _slices(args)
    directory = args.dir or tempfile.mkdtemp(prefix="tpu_ckpt_mt_")
    moto = None
    try:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
        persistent = os.path.join(directory, "persistent")
        if args.s3:
            moto, endpoint = start_moto(directory)
            env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                       AWS_REGION="us-east-1")
            persistent = "s3://bench/run"
        results = _launch(args, directory, persistent, env)
    finally:
        if moto is not None:
            moto.kill()
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    _report(results, args, persistent)
    return 0


def start_moto(directory: str) -> tuple[subprocess.Popen, str]:
    port = workers.free_port()
    server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    log = open(os.path.join(directory, "moto.log"), "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([server, "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"))
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto_server did not start; see moto.log")


def _launch(args: argparse.Namespace, directory: str, persistent: str, env: dict) -> list[dict]:
    command = [sys.executable, __file__, "--processes", str(args.processes), "--mib", str(args.mib), "--dir", directory]
    return workers.launch(command, args.processes, [persistent], env)


def _worker(args: argparse.Namespace, port: int, index: int, persistent: str) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes, process_id=index)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import tpu_ckpt as tc

    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    rows = args.mib * (1 << 20) // 4 // 4096
    value = np.random.default_rng(0).standard_normal((rows, 4096), dtype=np.float32)
    sharding = NamedSharding(mesh, P("data", "model"))
    state = {"w": jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])}
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=state["w"].sharding)}
    options = tc.CheckpointOptions(enable_async=True, coordination_timeout=600)
    local = os.path.join(args.dir, f"host{index}", "local")  # each process's own "local SSD"
    out = {}
    plain = tc.CheckpointManager(f"{persistent}/plain", options=options)
    out["persistent save"] = _timed_save(plain, 1, state)
    tiers = tc.CheckpointManager(f"{persistent}/tiers", save_interval_steps=2, local_directory=local,
                                 local_interval_steps=1, local_replicas=1, options=options)
    out["multi-tier save, persistent step"] = _timed_save(tiers, 1, state)
    out["multi-tier save, local step"] = _timed_save(tiers, 2, state)
    started = time.perf_counter()
    tiers.restore(2, target)
    out["restore from the local tier"] = {"s": time.perf_counter() - started}
    started = time.perf_counter()
    tc.restore(f"{persistent}/tiers/step_1", target)
    out["restore from the persistent tier"] = {"s": time.perf_counter() - started}
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()
    return 0


SLICE_CASES = {"slice copies (TPU_CKPT_SLICES set)": True, "TCP replicas (no slices known)": False}


def _slices(args: argparse.Namespace) -> int:
    """Both cases of ``--slices``, each in fresh processes."""
    if args.processes < 2 or args.processes % 2:
        raise SystemExit("--slices needs an even number of processes (2 simulated slices)")
    directory = args.dir or tempfile.mkdtemp(prefix="tpu_ckpt_mt_slices_")
    slices = ",".join(str(2 * p // args.processes) for p in range(args.processes))
    results = {}
    try:
        for case, known in SLICE_CASES.items():
            env = {k: v for k, v in os.environ.items() if k != "TPU_CKPT_SLICES"}
            env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
            if known:
                env["TPU_CKPT_SLICES"] = slices
            where = os.path.join(directory, "known" if known else "unknown")
            command = [sys.executable, __file__, "--slices", "--processes", str(args.processes),
                       "--mib", str(args.mib), "--dir", where]
            results[case] = workers.launch(command, args.processes, [os.path.join(where, "persistent")], env)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.processes} processes as 2 slices x 4 CPU devices, {args.mib} MiB state replicated across the slices;"
          " per local step, the slowest process / the most any process sent:")
    print(f"{'':36} {'s per step':>10} {'bytes sent per step':>20}")
    for case, rows in results.items():
        print(f"{case:36} {max(r['s_per_step'] for r in rows):10.3f} {max(r['sent_per_step'] for r in rows):20,.0f}")
    return 0


def _slices_worker(args: argparse.Namespace, port: int, index: int, persistent: str) -> int:
    """One process of ``--slices``: a persistent step, then 4 local steps, timed and counted."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes, process_id=index)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import tpu_ckpt as tc
    from tpu_ckpt import relay

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, -1), ("slice", "model"))  # row s: slice s's processes
    value = np.arange(args.mib * (1 << 20) // 4, dtype=np.float32).reshape(-1, 1024)
    state = {"w": jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("model")), lambda i: value[i])}
    sent, write = [0], relay.RelayStore.write

    def counted(self, name, chunks):
        sent[0] += sum(memoryview(c).nbytes for c in chunks)
        return write(self, name, chunks)

    relay.RelayStore.write = counted
    options = tc.CheckpointOptions(enable_async=False, coordination_timeout=600)
    local = os.path.join(args.dir, f"host{index}", "local")
    with tc.CheckpointManager(persistent, save_interval_steps=1000, local_directory=local, local_replicas=1,
                              options=options) as manager:
        manager.save(1, state)  # the persistent step
        manager.wait_until_finished()
        before, started = sent[0], time.perf_counter()
        for step in range(2, 6):
            manager.save(step, state)
        elapsed = time.perf_counter() - started
    print(json.dumps({"s_per_step": elapsed / 4, "sent_per_step": (sent[0] - before) / 4}), flush=True)
    jax.distributed.shutdown()
    return 0


def _timed_save(manager, step: int, state: dict) -> dict:
    started = time.perf_counter()
    manager.save(step, state)
    blocked = time.perf_counter() - started
    manager.wait_until_finished()
    return {"blocking_s": blocked, "s": time.perf_counter() - started}


def _report(results: list[dict], args: argparse.Namespace, persistent: str) -> None:
    tier = persistent.split("://")[0] if "://" in persistent else "a shared directory"
    print(f"{args.processes} processes x 4 CPU devices, {args.mib} MiB state, persistent tier: {tier}")
    print(f"{'':36} {'blocking s':>10} {'until committed s':>18}   (slowest process)")
    for case in results[0]:
        blocking = max(r[case].get("blocking_s", 0.0) for r in results)
        total = max(r[case]["s"] for r in results)
        print(f"{case:36} {blocking if 'blocking_s' in results[0][case] else float('nan'):10.3f} {total:18.3f}")


if __name__ == "__main__":
    sys.exit(main())
