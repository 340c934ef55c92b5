"""Benchmark tpu_ckpt against Orbax's StandardCheckpointer on the same pytrees.

Both libraries run in one process on the same arrays, repetitions interleaved (tpu_ckpt,
orbax, tpu_ckpt, orbax, ...), every save into a fresh directory, and the table reports
medians and tpu_ckpt/orbax ratios against the project's targets. Ratios measured in the
same run cancel out most of what a shared 2-core machine does to absolute numbers.

The lm workload also measures asynchronous saves the way a training loop uses them
(tpu_ckpt's enable_async against Orbax's StandardCheckpointer, an AsyncCheckpointer): how
long save() blocks, how long until the checkpoint is durable, the peak RSS meanwhile, and
how long a donated train step takes when started right after save() returned compared with
one with no save in flight (--no-async skips this). It also writes the same data files raw, each
with os.write from the arrays' buffers and fsync, as many at a time as tpu_ckpt's
writes_in_flight, and reports each library's sync save throughput as a share of that baseline's.

    python benchmarks/benchmark.py --scale 0.1 --reps 2
    python benchmarks/benchmark.py --workload many --reps 1 --json /tmp/bench.json
    python benchmarks/benchmark.py --workload cli
    python benchmarks/benchmark.py --workload lm --scale 0.5 --reps 4 --saves-only   # the write floor

Sync saves are also held to the write floor: a naive writer (Naive.save, issue 41) that
np.save's every shard's host copy into a file of its own on 8 threads, fsync'ing each; the
table gives each library's wall, user and system CPU seconds, and tpu_ckpt's per-rep ratios
to the naive writer's. Every timed save and restore starts from an empty page cache where the
process may drop it (/proc/sys/vm/drop_caches, root on Linux; the run says whether it could).

Restores are also held to the read floor: a naive reader (Naive.restore) that np.fromfile's
every piece of tpu_ckpt's checkpoint into fresh memory on 8 threads and builds the arrays
with jax.make_array_from_callback, with no check at all. Its table gives, per restore, the
median over reps of tpu_ckpt's time / the naive reader's in the same rep, wall and CPU
(getrusage, all threads: the steadier measure on a shared machine).

Every run ends with the CLI start-up row: the median of 10 `tpu-ckpt inspect` runs on a small
checkpoint, wall time and the CPU the child used (user + system, from getrusage).
"""

import os

# Eight simulated devices, so meshes (4, 2) and (2, 4) exist; must precede importing jax.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import psutil  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import tpu_ckpt as tc  # noqa: E402
from tpu_ckpt.catalog import open_checkpoint  # noqa: E402
from tpu_ckpt.format import dtype_from_name, extent, intersect, relative  # noqa: E402
from tpu_ckpt.runtime import Progress  # noqa: E402
from tpu_ckpt.saving import plan_save  # noqa: E402
from tpu_ckpt.settings import settings  # noqa: E402
from tpu_ckpt.sharding import index_to_slice  # noqa: E402

MB = 1e6
SAVE_MESH, RESTORE_MESH = (4, 2), (2, 4)
LM_LAYERS, LM_VOCAB, LM_SEQ = 8, 32768, 1024
LM_PARAMS_AT_SCALE_1 = 108e6  # x3 (params, mu, nu) x 4 bytes ~= 1.3 GB
MANY_LEAVES = 4000
MANY_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int32, jnp.float16, jnp.int8)
# (workload, metric) -> largest passing tpu_ckpt/orbax ratio.
RATIO_TARGETS = {
    ("lm", "save_s"): 0.25, ("lm", "restore_same_s"): 0.4, ("lm", "restore_resharded_s"): 0.4,
    ("many", "save_s"): 0.05, ("many", "restore_same_s"): 0.4, ("many", "restore_resharded_s"): 0.4,
    ("lm", "async_block_s"): 0.5, ("lm", "async_durable_s"): 0.4,
}
# (workload, metric) -> largest passing tpu_ckpt value, for metrics that are ratios already.
VALUE_TARGETS = {
    ("lm", "step_slowdown"): 1.1,  # donated step right after save() returned / with no save in flight
    ("lm", "async_rss_x"): 2.2,  # (live state + one host copy) + 10%, over the live state
}
# (workload, metric) -> smallest passing tpu_ckpt value, for shares of a baseline's throughput.
FLOOR_TARGETS = {
    ("lm", "raw_share"): 0.9,  # sync save MB/s / the same files written raw (os.write + fsync) MB/s
}
# metric -> largest passing tpu_ckpt/naive reader ratio (the read floor, measured in the same run).
FLOOR_RATIO_TARGETS = {"restore_same_s": 1.1, "restore_resharded_s": 1.3}
# metric -> largest passing tpu_ckpt/naive writer ratio, sync save (the write floor, issue 41).
SAVE_FLOOR_TARGETS = {"save_s": 1.1, "save_cpu_s": 1.2}
NO_RATIO = {"step_donated"}  # reported side by side, neither compared nor judged
BASELINE_STEPS = 3  # steps with no save in flight per rep, their median the baseline (one is noisy)
MIN_BANDWIDTH_SHARE = 0.8  # lm sync save throughput / fsync'd sequential write bandwidth
CLI_RUNS = 10
CLI_WALL_TARGET_S = 0.3  # `tpu-ckpt inspect` on a quiet machine: no JAX, ml_dtypes or tensorstore


def mesh(shape):
    """A ('data', 'model') mesh over the same 8 devices, so restores can change its shape. On
    an accelerator with another device count (one GPU), all of them as (n, 1) for the save's
    mesh and (1, n) for the other."""
    devices = np.array(jax.devices())
    if devices.size != np.prod(shape):
        shape = (devices.size, 1) if shape == SAVE_MESH else (1, devices.size)
    return Mesh(devices.reshape(shape), ("data", "model"))


def sharding_for(m, shape):
    """Shards 2-D leaves over both mesh axes where they divide evenly, replicates the rest,
    the way a simple data x model parallel setup lays out a GPT."""
    if len(shape) == 2 and shape[0] % m.shape["data"] == 0 and shape[1] % m.shape["model"] == 0:
        return NamedSharding(m, PartitionSpec("data", "model"))
    return NamedSharding(m, PartitionSpec())


def abstract(tree, m):
    """Restore target: ShapeDtypeStructs laid out on mesh `m`, which both libraries accept."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(m, x.shape)), tree)


def lm_state(scale):
    """A GPT-shaped Flax TrainState with Adam, every float leaf random (so neither library
    gains from zero pages or compression), built by one jit with the optimizer state sharded
    like the params. The width is picked so params+mu+nu is ~1.3 GB * scale."""
    rows = LM_VOCAB + LM_SEQ
    # Solve 12*L*d^2 + rows*d = params for d, rounded to a multiple of 64 (divides both meshes).
    a, target = 12 * LM_LAYERS, LM_PARAMS_AT_SCALE_1 * scale
    d = max(64, int(round((-rows + (rows * rows + 4 * a * target) ** 0.5) / (2 * a) / 64)) * 64)
    shapes = {"embed": {"tokens": (LM_VOCAB, d), "positions": (LM_SEQ, d)},
              "ln_f": {"scale": (d,), "bias": (d,)}}
    for i in range(LM_LAYERS):
        shapes[f"layer_{i}"] = {
            "ln_1": {"scale": (d,), "bias": (d,)},
            "attn": {"qkv": {"kernel": (d, 3 * d), "bias": (3 * d,)},
                     "out": {"kernel": (d, d), "bias": (d,)}},
            "ln_2": {"scale": (d,), "bias": (d,)},
            "mlp": {"fc": {"kernel": (d, 4 * d), "bias": (4 * d,)},
                    "proj": {"kernel": (4 * d, d), "bias": (d,)}},
        }
    tx = optax.adam(1e-3)  # one instance: the jit output's treedef must match out_shardings

    def init(key):
        params = jax.tree.map(jnp.zeros, shapes, is_leaf=lambda s: isinstance(s, tuple))
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        leaves, treedef = jax.tree.flatten(state)
        leaves = [jnp.asarray(x) for x in leaves]  # the step count is a Python int here
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten([
            jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves)])

    m = mesh(SAVE_MESH)
    out_shardings = jax.tree.map(lambda x: sharding_for(m, x.shape), jax.eval_shape(init, jax.random.key(0)))
    return jax.block_until_ready(jax.jit(init, out_shardings=out_shardings)(jax.random.key(0)))


def many_state():
    """4000 small leaves of mixed dtypes and shapes (~15 MB), half 2-D and sharded, half 1-D
    and replicated: the case where per-leaf overhead, not bandwidth, decides the cost."""
    rng = np.random.default_rng(0)
    m = mesh(SAVE_MESH)
    tree = {}
    for i in range(MANY_LEAVES):
        if i % 2:
            shape = tuple(int(n) for n in rng.choice([8, 16, 32, 64, 128], size=2))
        else:
            shape = (int(rng.integers(1, 1025)),)
        dtype = np.dtype(MANY_DTYPES[i % len(MANY_DTYPES)])
        if np.issubdtype(dtype, np.integer):
            value = rng.integers(-100, 100, shape).astype(dtype)
        else:
            value = rng.standard_normal(shape).astype(dtype)
        tree.setdefault(f"group_{i // 100}", {})[f"leaf_{i % 100}"] = jax.device_put(value, sharding_for(m, shape))
    return jax.block_until_ready(tree)


class TpuCkpt:
    """tpu_ckpt with its defaults; save(...).wait() is the full synchronous cost. Both
    adapters block on restored arrays, so a restore's time includes all its device copies.
    save_async returns once the data is on the host; wait(handle) once it is committed."""
    name = "tpu_ckpt"
    ASYNC = tc.CheckpointOptions(enable_async=True)

    def save(self, path, tree):
        tc.save(path, tree).wait()

    def save_async(self, path, tree):
        return tc.save(path, tree, options=self.ASYNC)

    def wait(self, handle):
        handle.wait()

    def restore(self, path, target):
        return jax.block_until_ready(tc.restore(path, target))


class Orbax:
    """Orbax StandardCheckpointer with its defaults. Its save is asynchronous, so the sync
    cost is save() plus wait_until_finished(). One instance serves the whole run, as in a
    training loop."""
    name = "orbax"

    def __init__(self):
        self.ckptr = ocp.StandardCheckpointer()

    def save(self, path, tree):
        self.ckptr.save(path, tree)
        self.ckptr.wait_until_finished()

    def save_async(self, path, tree):
        # StandardCheckpointer is an AsyncCheckpointer(StandardCheckpointHandler()); this is
        # its save(path, args=StandardSave(tree)), which returns once the data is on the host.
        self.ckptr.save(path, tree)

    def wait(self, handle):
        self.ckptr.wait_until_finished()

    def restore(self, path, target):
        return jax.block_until_ready(self.ckptr.restore(path, target))


class Naive:
    """The floors a save and a restore are held to. Save (issue 41's naive writer): every
    shard's host copy (np.asarray(shard.data), one per replica group) np.save'd to a file of
    its own on 8 threads, each file fsync'd; no header, checksum, index or commit. Restore:
    every piece of tpu_ckpt's checkpoint (the manifest says where) read with np.fromfile into
    fresh memory on 8 threads, then each leaf built with jax.make_array_from_callback, a
    device's part being a piece as it is when it is exactly that part, else copied out of
    the pieces overlapping it. No checksum, bounds or tiling check, no batching: what a
    reader that trusts its files does."""
    name = "naive"
    reads = "tpu_ckpt"  # restores the checkpoint this library saved
    THREADS = 8

    def save(self, path, tree):
        os.mkdir(path)
        shards = [s for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.replica_id == 0]
        with concurrent.futures.ThreadPoolExecutor(self.THREADS) as pool:
            list(pool.map(self._save_shard, [os.path.join(path, f"{i}.npy") for i in range(len(shards))], shards))

    @staticmethod
    def _save_shard(name, shard):
        with open(name, "wb") as f:
            np.save(f, np.asarray(shard.data))
            f.flush()
            os.fsync(f.fileno())

    def restore(self, path, target):
        with open_checkpoint(path) as checkpoint:
            checkpoint.load_all()
            leaves = [leaf for leaf in checkpoint.manifest.leaves if leaf.kind == "array"]
        targets, treedef = jax.tree.flatten(target)
        assert [t.shape for t in targets] == [leaf.shape for leaf in leaves], "target is not the saved tree"
        with concurrent.futures.ThreadPoolExecutor(self.THREADS) as pool:
            reads = [{p.slice: pool.submit(self._piece, path, leaf.dtype, p) for p in leaf.pieces} for leaf in leaves]
            pieces = [{s: f.result() for s, f in r.items()} for r in reads]
        arrays = [jax.make_array_from_callback(t.shape, t.sharding, functools.partial(self._part, held, t.shape))
                  for t, held in zip(targets, pieces)]
        return jax.block_until_ready(treedef.unflatten(arrays))

    @staticmethod
    def _piece(path, dtype, piece):
        data = np.fromfile(os.path.join(path, piece.file), np.uint8, piece.length, offset=piece.offset)
        return data.view(dtype_from_name(dtype)).reshape(extent(piece.slice))

    @staticmethod
    def _part(pieces, shape, index):
        region = index_to_slice(index, shape)
        if region in pieces:
            return pieces[region]
        out = np.empty(extent(region), next(iter(pieces.values())).dtype)
        for spec, data in pieces.items():
            overlap = intersect(spec, region)
            if overlap is not None:
                out[relative(overlap, region)] = data[relative(overlap, spec)]
        return out


class PeakRss:
    """Samples this process's RSS every 5 ms on a thread: a checkpoint's memory cost is its
    transient high-water mark (host copies, read buffers), which before/after RSS hides.
    Memory freed by an earlier operation and kept by the allocator is reused without raising
    RSS, so this counts the pages an operation needed beyond what the process already held."""

    def __enter__(self):
        self._proc = psutil.Process()
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def release_free_memory():
    """Hands the allocator's free pages back to the OS (glibc malloc_trim), so that a host
    copy made of many small pieces shows up in RSS instead of reusing pages an earlier rep
    freed; a no-op where the C library has no malloc_trim."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def cpu_seconds():
    """(user, system) CPU seconds of this process, all threads (getrusage)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def measure(fn, *args):
    """Runs fn(*args), returning (its result, wall seconds, RSS peak minus RSS at start in MB,
    (user, system) CPU seconds): on a shared machine the CPU time is the steadier measure."""
    with PeakRss() as rss:
        cpu, start = cpu_seconds(), time.perf_counter()
        result = fn(*args)
        seconds, after = time.perf_counter() - start, cpu_seconds()
    return result, seconds, (rss.peak - rss.start) / MB, (after[0] - cpu[0], after[1] - cpu[1])


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches():
    """Writes back dirty pages (os.sync), then drops the clean page cache where this process
    may (root on Linux), so every timed operation starts from the same cache state rather
    than one that drifts with what ran before (issue 41). Returns whether it dropped."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def disk_usage(path):
    """(bytes, files) under a checkpoint directory: what the library actually wrote."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            size += os.path.getsize(os.path.join(root, name))
            files += 1
    return size, files


def free(tree):
    """Deletes restored device buffers so the next rep starts from the same memory state."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def disk_bandwidth(workdir, scale):
    """fsync'd sequential write bandwidth in MB/s: one Python stream of ~1 GB * scale (at
    least 256 MB) of random bytes, timed through the final fsync. The yardstick for save
    throughput, since it is what this disk can do with no library in the way."""
    chunk = np.random.default_rng(0).bytes(16 * 2**20)
    writes = max(256 * MB, 1e9 * scale) // len(chunk) + 1
    path = os.path.join(workdir, "bandwidth.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(int(writes)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return writes * len(chunk) / MB / seconds


def write_raw(directory, file):
    """One data file of a save plan, its pieces' bytes written with os.write straight from
    the arrays' buffers (numpy views of them on CPU), then fsync'd."""
    fd = os.open(os.path.join(directory, file.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for piece in file.pieces:
            view = memoryview(np.ascontiguousarray(piece.data).reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_save(path, files):
    """The baseline a sync save is held to: the data files tpu_ckpt writes for this state,
    the same bytes less headers, as many in flight as its writes_in_flight setting, and
    nothing else (no checksum, index, manifest or commit)."""
    os.mkdir(path)
    with concurrent.futures.ThreadPoolExecutor(settings().writes_in_flight) as pool:
        list(pool.map(functools.partial(write_raw, path), files))


def raw_throughput(raw_files, workdir, label):
    """MB/s of writing `raw_files` raw (see raw_save), starting with no dirty pages to drain."""
    path = os.path.join(workdir, f"raw-{label}")
    drop_caches()
    _, seconds, _, _ = measure(raw_save, path, raw_files)
    size = disk_usage(path)[0]
    shutil.rmtree(path)
    return size / MB / seconds


def one_rep(name, tree, targets, libs, workdir, rep, reps, log, raw_files=None):
    """One interleaved rep: (given `raw_files`, the raw baseline, right before tpu_ckpt's
    save), save, restore same sharding, restore onto mesh (2, 4), each operation run for
    every library before the next starts, into fresh directories that are removed afterwards.
    Every write and restore starts with no dirty pages left to drain and, where permitted, an
    empty page cache (drop_caches), so none pays for the writeback of the one before and the
    ratios do not drift with the cache's state. Rep 0 is the warm-up. Reports each library's times with
    `log`. Returns {lib: {metric: value}}."""
    label = f"rep {rep}/{reps}" if rep else "warm-up"
    paths = {lib.name: os.path.join(workdir, f"{name}-{lib.name}-rep{rep}") for lib in libs}
    out = {lib.name: {} for lib in libs}
    raw_mbps = raw_throughput(raw_files, workdir, rep) if raw_files is not None else None
    savers = [lib for lib in libs if hasattr(lib, "save")]
    for lib in savers:
        drop_caches()
        _, seconds, rss, (user, system) = measure(lib.save, paths[lib.name], tree)
        size, files = disk_usage(paths[lib.name])
        out[lib.name].update(save_s=seconds, save_rss_mb=rss, bytes_mb=size / MB, files=files,
                             save_mbps=size / MB / seconds, save_user_s=user, save_sys_s=system,
                             save_cpu_s=user + system)
        if raw_mbps:  # a share of the raw baseline measured in the same rep
            out[lib.name]["raw_share"] = size / MB / seconds / raw_mbps
    raw = f" (raw write+fsync {raw_mbps:.0f} MB/s)" if raw_mbps else ""
    for op, target in targets.items():
        for lib in libs:
            release_free_memory()  # every reader reads into fresh memory, as a new process does
            drop_caches()  # and from the disk: a save written around the page cache left nothing there
            restored, seconds, rss, cpu = measure(lib.restore, paths[getattr(lib, "reads", lib.name)], target)
            free(restored)
            del restored
            out[lib.name].update({f"{op}_s": seconds, f"{op}_rss_mb": rss, f"{op}_cpu_s": sum(cpu)})
    for lib in savers:
        shutil.rmtree(paths[lib.name])
    for lib in libs:
        r = out[lib.name]
        saved = (f"save {r['save_s']:.3f}s (user {r['save_user_s']:.2f}s sys {r['save_sys_s']:.2f}s) "
                 if "save_s" in r else "")
        restored = (f"restore {r['restore_same_s']:.3f}s ({r['restore_same_cpu_s']:.2f}s CPU) restore{RESTORE_MESH} "
                    f"{r['restore_resharded_s']:.3f}s ({r['restore_resharded_cpu_s']:.2f}s CPU)" if targets else "")
        log(f"[{name} {label}] {lib.name:8s} {saved}{restored}{raw}")
    return out


def run_workload(name, tree, libs, workdir, reps, restores=True):
    """An untimed warm-up rep, then `reps` measured ones. The warm-up keeps one-time costs
    out of the medians (Orbax compiles per leaf shape/dtype/sharding on its first save, which
    for `many` is minutes; both libraries start thread pools): a training loop saves the
    same tree over and over, so the steady state is what matters. `restores`: False times the
    saves alone. Returns {lib: {metric: [samples]}}."""
    targets = {"restore_same": abstract(tree, mesh(SAVE_MESH)),
               "restore_resharded": abstract(tree, mesh(RESTORE_MESH))} if restores else {}
    raw_files = plan_save(tree).files if name == "lm" else None  # numpy views of the arrays' buffers
    samples = {lib.name: {} for lib in libs}
    with Progress(f"{name} reps", reps + 1, unit="reps") as bar:
        one_rep(name, tree, targets, libs, workdir, 0, reps, bar.log, raw_files)
        bar.advance()
        for rep in range(1, reps + 1):
            for lib, values in one_rep(name, tree, targets, libs, workdir, rep, reps, bar.log, raw_files).items():
                for metric, value in values.items():
                    samples[lib].setdefault(metric, []).append(value)
            bar.advance()
    return samples


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state):
    """A stand-in for a train step: one cheap elementwise update of every leaf of the whole
    state, its input donated, as a real step donates the TrainState it replaces."""
    return jax.tree.map(lambda x: x * 0.999 if jnp.issubdtype(x.dtype, jnp.floating) else x + 1, state)


def timed_step(state):
    """Runs train_step on `state` (which it donates); returns (new state, seconds)."""
    start = time.perf_counter()
    state = jax.block_until_ready(train_step(state))
    return state, time.perf_counter() - start


def largest_leaf(state):
    leaves = jax.tree.leaves(state)
    return max(range(len(leaves)), key=lambda i: leaves[i].nbytes)


def async_rep(name, state, libs, workdir, rep, reps, log):
    """One interleaved rep of asynchronous saves, two passes per library. First: save_async,
    then wait, nothing else running, timing both and sampling RSS throughout (after
    returning free heap pages to the OS, so the host copy cannot hide in them). Second: donated
    steps with no save in flight (their median is the baseline), save_async, and a donated step
    started right after it returned, before waiting; with it, the share of the leaves that
    step could really donate (JAX silently copies a buffer that something else still
    references instead of donating it). The warm-up also checks that the checkpoint holds
    the state as it was at save(), so no library wrote buffers the step had overwritten.
    Reports each library's times with `log`. Returns (the state after the steps, {lib: {metric: value}})."""
    label = f"rep {rep}/{reps}" if rep else "warm-up"
    live_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / MB
    out = {lib.name: {} for lib in libs}
    for lib in libs:
        path = os.path.join(workdir, f"{name}-{lib.name}-async-rep{rep}")
        release_free_memory()
        drop_caches()
        with PeakRss() as rss:
            start = time.perf_counter()
            handle = lib.save_async(path, state)
            returned = time.perf_counter()
            lib.wait(handle)
            durable = time.perf_counter()
        grown = (rss.peak - rss.start) / MB
        out[lib.name].update(async_block_s=returned - start, async_durable_s=durable - start,
                             async_rss_mb=grown, async_rss_x=(live_mb + grown) / live_mb)
        shutil.rmtree(path)
    for lib in libs:
        path = os.path.join(workdir, f"{name}-{lib.name}-step-rep{rep}")
        alone = []
        for _ in range(BASELINE_STEPS):
            state, seconds = timed_step(state)
            alone.append(seconds)
        alone = statistics.median(alone)
        inputs = jax.tree.leaves(state)
        if not rep:
            expected = np.array(inputs[largest_leaf(state)])
        handle = lib.save_async(path, state)
        state, after = timed_step(state)
        lib.wait(handle)
        donated = sum(x.is_deleted() for x in inputs) / len(inputs)
        del inputs
        if not rep:
            restored = lib.restore(path, abstract(state, mesh(SAVE_MESH)))
            if not np.array_equal(np.asarray(jax.tree.leaves(restored)[largest_leaf(state)]), expected):
                raise RuntimeError(f"{lib.name}: the checkpoint does not hold the state as it was at save(); "
                                   "the donated step overwrote it before it was written")
            free(restored)
            del restored, expected
        shutil.rmtree(path)
        out[lib.name].update(step_s=alone, step_after_save_s=after, step_slowdown=after / alone,
                             step_donated=donated)
    for lib in libs:
        r = out[lib.name]
        log(f"[{name} async {label}] {lib.name:8s} blocking {r['async_block_s']:.3f}s durable "
            f"{r['async_durable_s']:.3f}s step {r['step_s']:.3f}s after save {r['step_after_save_s']:.3f}s "
            f"({r['step_donated']:.0%} donated) RSS +{r['async_rss_mb']:.0f} MB")
    return state, out


def run_async(name, state, libs, workdir, reps, samples):
    """An untimed warm-up rep (it also compiles the step), then `reps` measured ones, their
    samples added to `samples`. The state is donated along the way: returns the last one."""
    with Progress(f"{name} async reps", reps + 1, unit="reps") as bar:
        state, _ = async_rep(name, state, libs, workdir, 0, reps, bar.log)
        bar.advance()
        for rep in range(1, reps + 1):
            state, values = async_rep(name, state, libs, workdir, rep, reps, bar.log)
            for lib, metrics in values.items():
                for metric, value in metrics.items():
                    samples[lib].setdefault(metric, []).append(value)
            bar.advance()
    return state


METRICS = (  # (key, label, format)
    ("save_s", "sync save (s)", "{:.3f}"),
    ("restore_same_s", f"restore mesh {SAVE_MESH} (s)", "{:.3f}"),
    ("restore_resharded_s", f"restore mesh {RESTORE_MESH} (s)", "{:.3f}"),
    ("restore_same_cpu_s", f"restore mesh {SAVE_MESH} (CPU s)", "{:.3f}"),
    ("restore_resharded_cpu_s", f"restore mesh {RESTORE_MESH} (CPU s)", "{:.3f}"),
    ("save_user_s", "sync save user CPU (s)", "{:.3f}"),
    ("save_sys_s", "sync save system CPU (s)", "{:.3f}"),
    ("save_cpu_s", "sync save CPU (s)", "{:.3f}"),
    ("save_mbps", "save throughput (MB/s)", "{:.0f}"),
    ("raw_share", "sync save vs raw write+fsync", "{:.2f}"),
    ("bytes_mb", "bytes written (MB)", "{:.1f}"),
    ("files", "files written", "{:.0f}"),
    ("save_rss_mb", "peak RSS save (MB)", "{:.1f}"),
    ("restore_same_rss_mb", f"peak RSS restore {SAVE_MESH} (MB)", "{:.1f}"),
    ("restore_resharded_rss_mb", f"peak RSS restore {RESTORE_MESH} (MB)", "{:.1f}"),
    ("async_block_s", "async save blocking (s)", "{:.3f}"),
    ("async_durable_s", "async save until durable (s)", "{:.3f}"),
    ("step_s", "donated step, no save (s)", "{:.3f}"),
    ("step_after_save_s", "donated step after save (s)", "{:.3f}"),
    ("step_slowdown", "step after save / no save", "{:.2f}x"),
    ("step_donated", "leaves that step donated", "{:.0%}"),
    ("async_rss_mb", "peak RSS async save (MB)", "{:.1f}"),
    ("async_rss_x", "async peak RSS / live state", "{:.2f}x"),
)


def report(name, samples, bandwidth, transfer_floor_s=None):
    """Prints the table of medians, ratios and verdicts; returns its rows for --json."""
    med = {lib: {k: statistics.median(v) for k, v in s.items()} for lib, s in samples.items()}
    rows = []
    for key, label, fmt in METRICS:
        if key not in med["tpu_ckpt"]:
            continue  # a metric group this workload does not measure
        ours, theirs = med["tpu_ckpt"][key], med["orbax"][key]
        if key in NO_RATIO:
            rows.append({"metric": label, "tpu_ckpt": fmt.format(ours), "orbax": fmt.format(theirs), "ratio": "",
                         "target": "", "result": ""})
            continue
        if (name, key) in FLOOR_TARGETS:  # a share of a baseline's throughput: higher is better
            floor = FLOOR_TARGETS[(name, key)]
            rows.append({"metric": label, "tpu_ckpt": fmt.format(ours), "orbax": fmt.format(theirs), "ratio": "",
                         "target": f">= {floor}", "result": "PASS" if ours >= floor else "FAIL"})
            continue
        if (name, key) in VALUE_TARGETS:  # already a ratio (to a baseline, or to the state)
            limit = VALUE_TARGETS[(name, key)]
            rows.append({"metric": label, "tpu_ckpt": fmt.format(ours), "orbax": fmt.format(theirs), "ratio": "",
                         "target": f"<= {limit}x", "result": "PASS" if ours <= limit else "FAIL"})
            continue
        # Sub-MB RSS growth is allocator noise (freed pages get reused); its ratio means nothing.
        noise = key.endswith("rss_mb") and theirs < 1
        ratio = float("nan") if noise or not theirs else ours / theirs
        limit = RATIO_TARGETS.get((name, key))
        rows.append({"metric": label, "tpu_ckpt": fmt.format(ours), "orbax": fmt.format(theirs),
                     "ratio": "-" if ratio != ratio else f"{ratio:.3f}x", "target": f"<= {limit}x" if limit else "",
                     "result": ("PASS" if ratio <= limit else "FAIL") if limit else ""})
    share = {lib: med[lib]["save_mbps"] / bandwidth for lib in ("tpu_ckpt", "orbax")}
    wanted = MIN_BANDWIDTH_SHARE if name == "lm" else None
    rows.append({"metric": "save throughput / disk bw", "tpu_ckpt": f"{share['tpu_ckpt']:.0%}",
                 "orbax": f"{share['orbax']:.0%}", "ratio": "",
                 "target": f">= {wanted:.0%}" if wanted else "",
                 "result": ("PASS" if share["tpu_ckpt"] >= wanted else "FAIL") if wanted else ""})
    print_table(f"workload {name} (medians)", ("metric", "tpu_ckpt", "orbax", "ratio", "target", "result"), rows)
    writes = save_floor_rows(samples)
    print_table(f"workload {name}: sync saves vs the naive writer (medians; ratios: medians of per-rep ratios)",
                ("metric", "tpu_ckpt", "naive", "orbax", "ratio", "target", "result"), writes)
    if "restore_same_s" not in samples["tpu_ckpt"]:
        return rows + writes  # --saves-only
    floor = floor_rows(samples, transfer_floor_s)
    print_table(f"workload {name}: restores vs the naive reader (medians of per-rep ratios)",
                ("metric", "tpu_ckpt", "naive", "orbax", "ratio", "ratio cpu", "target", "result"), floor)
    return rows + writes + floor


def save_floor_rows(samples):
    """Each library's sync save, wall and CPU (user, system, both), beside the naive writer's
    (Naive.save) in the same reps; tpu_ckpt's wall and CPU as the median of its per-rep ratios
    to the naive writer's, against SAVE_FLOOR_TARGETS."""
    rows = []
    for key in ("save_s", "save_user_s", "save_sys_s", "save_cpu_s"):
        label = next(label for k, label, _ in METRICS if k == key)
        ours, naive, theirs = (samples[lib][key] for lib in ("tpu_ckpt", "naive", "orbax"))
        limit = SAVE_FLOOR_TARGETS.get(key)
        ratio = statistics.median(a / b if b else float("inf") for a, b in zip(ours, naive))
        rows.append({"metric": label, "tpu_ckpt": f"{statistics.median(ours):.3f}",
                     "naive": f"{statistics.median(naive):.3f}", "orbax": f"{statistics.median(theirs):.3f}",
                     "ratio": f"{ratio:.3f}x", "target": f"<= {limit}x" if limit else "",
                     "result": ("PASS" if ratio <= limit else "FAIL") if limit else ""})
    return rows


def floor_rows(samples, transfer_floor_s=None):
    """Each restore against the naive reader's in the same rep (wall and CPU time): the median
    of the per-rep ratios, which a shared machine disturbs less than a ratio of medians. On an
    accelerator, also against max(naive reader, the state's bytes at the measured host-to-device
    bandwidth): a restore can beat neither its reads nor its transfers."""
    rows = []
    for key, limit in FLOOR_RATIO_TARGETS.items():
        label = next(label for k, label, _ in METRICS if k == key)
        ours, naive, theirs = (samples[lib][key] for lib in ("tpu_ckpt", "naive", "orbax"))
        cpu = (samples[lib][key.removesuffix("_s") + "_cpu_s"] for lib in ("tpu_ckpt", "naive"))
        ratio = statistics.median(a / b for a, b in zip(ours, naive))
        ratio_cpu = statistics.median(a / b for a, b in zip(*cpu))
        rows.append({"metric": label, "tpu_ckpt": f"{statistics.median(ours):.3f}",
                     "naive": f"{statistics.median(naive):.3f}", "orbax": f"{statistics.median(theirs):.3f}",
                     "ratio": f"{ratio:.3f}x", "ratio cpu": f"{ratio_cpu:.3f}x", "target": f"<= {limit}x",
                     "result": "PASS" if ratio <= limit else "FAIL"})
        if transfer_floor_s is not None:
            floor = statistics.median(max(b, transfer_floor_s) for b in naive)
            rows.append({"metric": f"{label} / max(read, transfer)", "tpu_ckpt": f"{statistics.median(ours):.3f}",
                         "naive": f"{floor:.3f}", "orbax": f"{statistics.median(theirs):.3f}",
                         "ratio": f"{statistics.median(ours) / floor:.3f}x", "ratio cpu": "", "target": "",
                         "result": ""})
    return rows


def print_table(title, columns, rows):
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in columns]
    print(f"\n== {title} ==")
    for row in [dict(zip(columns, columns)), *rows]:
        print("  ".join(row[c].ljust(w) if i == 0 else row[c].rjust(w)
                        for i, (c, w) in enumerate(zip(columns, widths))))


def transfer_floor_seconds(state_bytes):
    """The time the state's bytes take to reach the devices at the measured host-to-device
    bandwidth; None on CPU, where there is no transfer to speak of."""
    if jax.default_backend() == "cpu":
        return None
    from transfer_floor import bandwidths  # benchmarks/

    measured = bandwidths(256, 3)
    print(f"{measured['platform']}: host->device {measured['host_to_device_gb_s']:.1f} GB/s", file=sys.stderr)
    return state_bytes / (measured["host_to_device_gb_s"] * 1e9)


def cli_startup(workdir):
    """Median wall and CPU seconds of `tpu-ckpt inspect` on a small checkpoint, each run a
    fresh interpreter as a user's shell starts it; prints its row and returns it for --json."""
    path = os.path.join(workdir, "cli_step_1")
    tc.save(path, {"w": np.ones((64, 64), np.float32), "b": np.zeros(64, jnp.bfloat16), "step": np.int64(1)})
    script = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "tpu_ckpt"]
    walls, cpus = [], []
    for _ in range(CLI_RUNS):
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run([*command, "inspect", path], check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    row = {"metric": "CLI start-up (tpu-ckpt inspect)", "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
           "target": f"<= {CLI_WALL_TARGET_S} s wall", "result": "PASS" if wall <= CLI_WALL_TARGET_S else "FAIL"}
    print(f"\n== CLI start-up (median of {CLI_RUNS}) ==\n{row['metric']}: {wall:.3f} s wall, {cpu:.3f} s CPU  "
          f"target {row['target']}  {row['result']}")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("lm", "many", "cli", "all"), default="all",
                        help="cli: only the CLI start-up row, which every run ends with")
    parser.add_argument("--scale", type=float, default=1.0, help="lm size; 1.0 ~= 1.3 GB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", help="existing directory (on the disk to test) to hold the scratch directory; "
                        "default: the system temp dir")
    parser.add_argument("--json", help="also write all samples and rows to this file")
    parser.add_argument("--saves-only", action="store_true",
                        help="time the sync saves alone (issue 41's write floor): no restores, async saves, "
                        "CLI or incremental rows")
    parser.add_argument("--no-async", dest="run_async", action="store_false",
                        help="skip the lm workload's asynchronous-save metrics")
    args = parser.parse_args()

    if args.dir and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir} is not an existing directory")
    workdir = os.path.abspath(tempfile.mkdtemp(prefix="tpu_ckpt_bench_", dir=args.dir))
    libs = [TpuCkpt(), Orbax(), Naive()]
    try:
        workloads = {"all": ("lm", "many"), "cli": ()}.get(args.workload, (args.workload,))
        bandwidth = disk_bandwidth(workdir, args.scale) if workloads else None  # cli writes no data to speak of
        if workloads:
            print(f"disk: fsync'd sequential write {bandwidth:.0f} MB/s ({workdir})")
            dropped = drop_caches()
            print(f"page cache: {'dropped' if dropped else 'NOT dropped (' + DROP_CACHES + ' is not writable here)'}"
                  " before every timed save and restore")
        results = {"disk_write_mbps": bandwidth, "scale": args.scale, "reps": args.reps, "workloads": {}}
        for name in workloads:
            tree = lm_state(args.scale) if name == "lm" else many_state()
            leaves = jax.tree.leaves(tree)
            state_bytes = sum(x.nbytes for x in leaves)
            print(f"\n{name}: {len(leaves)} leaves, {state_bytes / MB:.1f} MB",
                  file=sys.stderr, flush=True)
            samples = run_workload(name, tree, libs, workdir, args.reps, restores=not args.saves_only)
            if name == "lm" and not args.saves_only:  # issue #36: the params to the Hugging Face layout and back
                from hf_rows import hf_rows  # benchmarks/

                targets = {k: abstract(tree.params, mesh(m))
                           for k, m in (("same", SAVE_MESH), ("resharded", RESTORE_MESH))}
                results["huggingface"] = hf_rows(tree.params, targets, workdir, args.reps, drop_caches)
                from per_process_rows import per_process_rows  # benchmarks/: issue #35, keys and tc.PerProcess

                results["per_process"] = per_process_rows(tree, workdir, args.reps, drop_caches)
            if name == "lm" and args.run_async and not args.saves_only:
                tree = run_async(name, tree, libs[:2], workdir, args.reps, samples)  # donates `tree`
            free(tree)
            rows = report(name, samples, bandwidth, transfer_floor_seconds(state_bytes))
            results["workloads"][name] = {"samples": samples, "rows": rows}
        if not args.saves_only:
            results["cli_startup"] = cli_startup(workdir)
        if workloads and not args.saves_only:
            from bench_incremental import incremental_rows  # benchmarks/: issue #25's LoRA loop

            results["incremental"] = incremental_rows(workdir)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        libs[1].ckptr.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
