"""The restores' control plane and traffic between hosts, per process, with real processes (#37 item 6).

    python benchmarks/control_plane.py [--processes 4 8 16] [--devices-per-process 2] [--leaves 64] [--fanout K]
                                       [--json OUT]

For each process count P, P real JAX processes (jax.distributed on CPU, gloo collectives:
``benchmarks/workers.py``) stand in for P hosts in 2 slices (``TPU_CKPT_SLICES``: the first
half slice 0), each with a private directory for its host's disk and one directory they
share for persistent storage. The state is ``--leaves`` small float32 leaves on a (slice,
model) mesh, sharded over the devices of a slice and replicated across the slices (as data
parallelism across slices lays it out), every eighth one replicated on every device, and a
Python step. It is saved once to the shared directory and as a manager's local step (each
slice writes its own copy), then restored six ways, all processes starting together:

- ``plain``: ``tc.restore`` (each process reads its own share);
- ``load_and_broadcast``: the same with ``CheckpointOptions(load_and_broadcast=True)``;
- ``load_and_broadcast_host``: the same onto numpy targets (every process wants every leaf
  whole, on the host): small ones, which the collective brings packed;
- ``load_and_broadcast_relay``: the same with a read batch of one byte, so every host leaf is
  bigger than a device's part of it: the relay's path, each piece read by one of at most
  ``cluster.fanout(P)``;
- ``tier_intact``: the manager's restore of the local step, every slice copy whole;
- ``tier_slice_wiped``: the same after slice 1's hosts lost their local directories.

``--fanout K`` fixes the control plane's fan-out in every process, whatever P. By default it is
``cluster.fanout(P)``: the smallest K with K² >= P, at least 4 and at most 64 (4 at P <= 16, 40
at 1,536 hosts). It sizes the tier restore's merge tree (``tiers/_merge_tree.py``) and
load_and_broadcast's relay tree and readers.

Per process and restore it reports tpu_ckpt's key-value calls (JAX's coordination client
wrapped and counted: gloo's own rendezvous is not tpu_ckpt's), relay connections opened and
accepted, and bytes sent and received on them (``traffic()``, relay/_wire.py); bytes a collective moves
are not counted there. Every restored shard is compared bit for bit. Then, per restore, the
largest value over the processes at each P, and the ratio of the largest P's to the one
before it (target: KV calls and connections <= 1.2x from P = 8 to 16).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

import workers  # benchmarks/workers.py

CASES = ("plain", "load_and_broadcast", "load_and_broadcast_host", "load_and_broadcast_relay", "tier_intact",
         "tier_slice_wiped")
METRICS = ("kv_calls", "opened", "accepted", "sent", "received")
SLICES = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--fanout", type=int, default=None,
                        help="a fixed fan-out in every process (default: cluster.fanout(P))")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run, all its processes, may take")
    parser.add_argument("--json", default=None, help="also write the results here, as JSON")
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, type=int, metavar=("PORT", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args, *args.worker)), flush=True)
        return 0
    results = {p: _run(args, p) for p in args.processes}
    rows = table(results)
    print(_report(args, results, rows))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"results": results, "rows": rows}, indent=1))
    return 0


def control_plane_rows(
    processes: tuple[int, ...] = (4, 8), leaves: int = 64, devices_per_process: int = 2
) -> list[dict]:
    """The benchmark's rows (for ``benchmarks/benchmark.py``): per restore and P, the largest
    value of each metric over the processes."""
    args = argparse.Namespace(processes=list(processes), leaves=leaves, devices_per_process=devices_per_process,
                              timeout=600.0, fanout=None)
    return table({p: _run(args, p) for p in processes})


def table(results: dict[int, list[dict]]) -> list[dict]:
    return [{"case": case, "processes": p, **{m: max(r[case][m] for r in per) for m in METRICS}}
            for case in CASES for p, per in results.items()]


def _run(args: argparse.Namespace, processes: int) -> list[dict]:
    if processes % SLICES:
        raise SystemExit(f"--processes {processes}: the processes make {SLICES} slices of equal size")
    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where a local tier belongs (docs/multi_tier.md)
    scratch = tempfile.mkdtemp(prefix="tpu_ckpt_control_plane_", dir=memory)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices_per_process}",
           "TPU_CKPT_SLICES": ",".join(str(i * SLICES // processes) for i in range(processes))}
    command = [sys.executable, __file__, "--processes", str(processes), "--leaves", str(args.leaves), "--dir", scratch]
    command += [] if args.fanout is None else ["--fanout", str(args.fanout)]
    try:
        results = workers.launch(command, processes, [], env, args.timeout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bad = [r for r in results if r["mismatches"]]
    if bad:
        raise SystemExit(f"P={processes}: restored shards differ from the saved ones: {bad[0]['mismatches'][:3]}")
    return results


def _worker(args: argparse.Namespace, port: int, index: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=args.processes[0], process_id=index)
    import tpu_ckpt as tc
    from tpu_ckpt.cluster import _relays

    if args.fanout is not None:
        _relays.SMALLEST_FANOUT = _relays.MAX_SERVERS = args.fanout
    host = os.path.join(args.dir, f"host{index}")
    os.makedirs(host)
    os.chdir(host)  # this process's private directory: its host's disk
    shared = os.path.join(args.dir, "persistent")
    state, expected, target = _state(args.leaves)
    tc.save(os.path.join(shared, "ckpt"), state)
    options = tc.CheckpointOptions(coordination_timeout=120)
    with _manager(shared, options) as manager:
        for step in (1, 2):  # step 2: local only
            manager.save(step, {**state, "step": step})
    out: dict = {"process": index, "mismatches": []}
    shared_reads = tc.CheckpointOptions(load_and_broadcast=True)
    restores = {
        "plain": lambda: tc.restore(os.path.join(shared, "ckpt"), target),
        "load_and_broadcast": lambda: tc.restore(os.path.join(shared, "ckpt"), target, options=shared_reads),
        "load_and_broadcast_host":
            lambda: tc.restore(os.path.join(shared, "ckpt"), dict(expected), options=shared_reads),
        "load_and_broadcast_relay": lambda: _relayed(
            lambda: tc.restore(os.path.join(shared, "ckpt"), dict(expected), options=shared_reads)),
        "tier_intact": lambda: _tier_restore(shared, options, target),
        "tier_slice_wiped": lambda: _tier_restore(shared, options, target, wipe=True),
    }
    for case, restore in restores.items():
        restored, out[case] = _counted(restore)
        want = {**expected, "step": 2} if case.startswith("tier") else expected
        out["mismatches"] += [f"{case} {m}" for m in _mismatches(restored, want)]
    jax.distributed.shutdown()
    return out


def _relayed(restore):
    """``restore`` with a read batch of one byte: every host leaf (all of more than a byte)
    is then bigger than a device's part of it, so the relay brings it, not the collective."""
    from tpu_ckpt import settings

    previous = settings.configure(settings.Settings(read_batch_bytes=1))
    try:
        return restore()
    finally:
        settings.configure(previous)


def _manager(shared: str, options):
    import tpu_ckpt as tc

    return tc.CheckpointManager(os.path.join(shared, "run"), save_interval_steps=10, local_directory="local",
                                local_replicas=1, options=options)


def _tier_restore(shared: str, options, target: dict, wipe: bool = False) -> dict:
    import jax

    if wipe and jax.process_index() >= jax.process_count() // SLICES:
        shutil.rmtree("local")  # slice 1 was recreated: its hosts' RAM disks are empty
    with _manager(shared, options) as manager:
        return manager.restore(None, target)


def _state(leaves: int) -> tuple[dict, dict, dict]:
    """The state, its values as numpy, and a restore target of the same shardings."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(SLICES, -1), ("slice", "model"))
    size = mesh.shape["model"] * 4
    state, expected, target = {}, {}, {}
    for i in range(leaves):
        sharding = NamedSharding(mesh, P() if i % 8 == 7 else P("model"))
        value = np.arange(size, dtype=np.float32) + 1000 * i
        name = f"leaf{i:04d}"
        state[name] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
        expected[name] = value
        target[name] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    return {**state, "step": 0}, {**expected, "step": 0}, {**target, "step": 0}


def _mismatches(restored: dict, expected: dict) -> list[str]:
    import numpy as np

    out = []
    for name, value in expected.items():
        got = restored[name]
        if isinstance(got, np.ndarray):  # on the host, whole
            out += [] if got.dtype == value.dtype and got.tobytes() == value.tobytes() else [f"{name} on the host"]
            continue
        if not isinstance(value, np.ndarray):
            out += [] if got == value else [f"{name}: {got!r} != {value!r}"]
            continue
        out += [f"{name} shard {s.index}" for s in got.addressable_shards
                if np.asarray(s.data).tobytes() != value[s.index].tobytes()]
    return out


class _CountingClient:
    """JAX's coordination client, each call tpu_ckpt makes through it counted."""

    def __init__(self, client) -> None:
        self.client, self.calls = client, 0

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        def counted(*call_args, **call_kwargs):
            self.calls += 1
            return method(*call_args, **call_kwargs)

        return counted


def _counted(restore) -> tuple[dict, dict]:
    """``restore()``'s result, and its KV calls and relay traffic on this process, all
    processes starting together."""
    from jax._src.distributed import global_state
    from jax.experimental import multihost_utils

    from tpu_ckpt.relay._wire import traffic

    multihost_utils.sync_global_devices("control_plane case")
    client = _CountingClient(global_state.client)
    before = traffic()
    global_state.client = client
    try:
        restored = restore()
    finally:
        global_state.client = client.client
    after = traffic()
    return restored, {"kv_calls": client.calls, **{field: after[field] - before[field] for field in after}}


def _report(args: argparse.Namespace, results: dict[int, list[dict]], rows: list[dict]) -> str:
    fanout = "cluster.fanout(P) (the default)" if args.fanout is None else args.fanout
    lines = [f"{len(CASES)} restores of {args.leaves} leaves + a step, {args.devices_per_process} devices a process,"
             f" {SLICES} slices, fan-out {fanout}; per process, the largest over the processes (mean in brackets)"]
    lines.append(f"{'restore':<26}{'P':>4}" + "".join(f"{m:>20}" for m in METRICS))
    for case in CASES:
        for p, per in results.items():
            cells = "".join(f"{max(r[case][m] for r in per):>10,} ({sum(r[case][m] for r in per) / len(per):>7,.1f})"
                            for m in METRICS)
            lines.append(f"{case:<26}{p:>4}{cells}")
    if len(results) > 1:
        small, large = sorted(results)[-2:]
        lines.append(f"\nP={large} against P={small} "
                     "(largest over the processes; target <= 1.2x for KV calls and connections):")
        by = {(r["case"], r["processes"]): r for r in rows}
        for case in CASES:
            ratios = [f"{m} {_ratio(by[case, large][m], by[case, small][m])}" for m in METRICS]
            lines.append(f"  {case:<26}" + ", ".join(ratios))
    return "\n".join(lines)


def _ratio(large: int, small: int) -> str:
    if not small:
        return "0 -> 0" if not large else f"0 -> {large:,}"
    return f"{large / small:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
