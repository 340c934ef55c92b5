"""Issue 41's reproducer: what makes writing a save's bytes cost seconds of kernel time.

Builds 40 leaves of 2048x2048 float32 (671 MB) sharded over 8 CPU devices, then writes the
same bytes several ways, each into a NEW file (as a save does) unless said otherwise, with
os.writev in 64-buffer calls and an fsync, and prints per step: wall, user and sys CPU of
this process (os.times), /proc/vmstat deltas (machine-wide: other processes count too) and
this process's AnonHugePages. Compare CPU within one run, not wall times across runs.

    .venv/bin/python benchmarks/kernel_reads_probe.py            # all steps
    .venv/bin/python benchmarks/kernel_reads_probe.py --leaves 20 --steps jax,copy,reuse

Steps: jax (np.asarray(shard.data) views, what a CPU save wrote from), copy (numpy copies of
them), reuse (jax views into a file whose just-unlinked predecessor's page-cache pages the
kernel hands straight back), anon (fill fresh anonymous memory: no file at all), direct
(tpu_ckpt's path: a reused bounce buffer and O_DIRECT, storage/_direct_writes.py), save
(tc.save(...).wait()), buffered-save (the same with Settings.direct_writes=False: the
page-cache path saves took before). Found (docs/memory.md "Fresh pages on a VM"): the cost is not the
source buffers but the first touch of the fresh pages the page cache takes from free memory,
which this VM's host has taken back (page_reporting in /proc/cmdline, virtio_balloon).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import tpu_ckpt as tc  # noqa: E402
from tpu_ckpt.settings import configure, settings  # noqa: E402
from tpu_ckpt.storage import _direct_writes as direct_writes  # noqa: E402

VMSTAT = ("pgalloc_normal", "pgfree", "pgfault", "thp_fault_alloc", "thp_split_pmd", "compact_stall", "nr_dirty")


def vmstat():
    with open("/proc/vmstat") as f:
        return {k: int(v) for k, v in (line.split() for line in f)}


def anon_huge_kb():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def timed(label, fn, *args):
    before, cpu, start = vmstat(), os.times(), time.perf_counter()
    fn(*args)
    wall, cpu_after, after = time.perf_counter() - start, os.times(), vmstat()
    deltas = " ".join(f"{k}={after.get(k, 0) - before.get(k, 0)}" for k in VMSTAT)
    print(f"{label:34s} wall {wall:5.2f}s user {cpu_after.user - cpu.user:5.2f}s "
          f"sys {cpu_after.system - cpu.system:5.2f}s"
          f"  AnonHuge {anon_huge_kb() // 1024} MB  {deltas}", flush=True)


def writev_file(path, buffers):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        views = [memoryview(b).cast("B") for b in buffers]
        for i in range(0, len(views), 64):
            os.writev(fd, views[i : i + 64])
        os.fsync(fd)
    finally:
        os.close(fd)


def direct_file(path, buffers):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        direct_writes.write_file(fd, [memoryview(b).cast("B") for b in buffers])
        os.fsync(fd)
    finally:
        os.close(fd)


def step_copy(path, views, tree):
    copies = [np.array(v) for v in views]
    timed("writev numpy copies, new file", writev_file, path, copies)


def step_reuse(path, views, tree):
    writev_file(path + "-old", views)
    os.unlink(path + "-old")
    timed("writev jax views, freed pages", writev_file, path, views)


def buffered_save(path, tree):
    previous = configure(dataclasses.replace(settings(), direct_writes=False))
    try:
        tc.save(path, tree).wait()
    finally:
        configure(previous)


STEPS = {
    "jax": lambda path, views, tree: timed("writev jax views, new file", writev_file, path, views),
    "copy": step_copy,
    "reuse": step_reuse,
    "anon": lambda path, views, tree: timed("fill fresh anonymous memory", np.full, sum(v.nbytes for v in views), 1,
                                            np.uint8),
    "direct": lambda path, views, tree: timed("bounce buffer + O_DIRECT", direct_file, path, views),
    "save": lambda path, views, tree: timed("tc.save(...).wait()", lambda: tc.save(path, tree).wait()),
    "buffered-save": lambda path, views, tree: timed("tc.save, direct_writes=False", buffered_save, path, tree),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leaves", type=int, default=40)
    parser.add_argument("--steps",
                        default="jax,jax,copy,reuse,anon,direct,direct,save,buffered-save,save,buffered-save")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b")), PartitionSpec("a", "b"))
    make = jax.jit(lambda k: jax.random.normal(k, (2048, 2048)), out_shardings=sharding)
    tree = jax.block_until_ready([make(k) for k in jax.random.split(jax.random.key(0), args.leaves)])
    views = [np.asarray(s.data) for leaf in tree for s in leaf.addressable_shards]
    print(f"{sum(v.nbytes for v in views) / 1e6:.0f} MB in {len(views)} buffers; AnonHuge {anon_huge_kb() // 1024} MB")
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        for i, step in enumerate(args.steps.split(",")):
            STEPS[step](os.path.join(work, f"{i}-{step}"), views, tree)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
