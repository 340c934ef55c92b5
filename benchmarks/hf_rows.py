"""Issue #36's rows for benchmarks/benchmark.py: the lm workload's params exported to the
Hugging Face layout and loaded back onto a mesh, against the baselines the targets name.

Per rep, each from an empty page cache: a ``tc.save`` of ``{"params": params}`` and
``tc.export_for_serving(layout="huggingface")`` of it (the export's time / the save's, <= 1.2x; and, with no target, /
the save's plus a plain cold read of the saved files: an export reads the checkpoint from the disk and writes as much, a
save only writes; and from a source the page cache holds, / the save's: what the export's own work costs beside its
reads); then ``tc.load_safetensors`` of the export onto the save's mesh and onto another one, each interleaved with a
naive reader (``safetensors.safe_open`` + ``get_tensor`` + ``jax.device_put`` per tensor, no check, no bound: <= 1.1x
same mesh, <= 1.3x resharded), and the bytes the load read (``rchar`` of ``/proc/self/io``) over the bytes this
process's devices hold (<= 1.05x). Ratios are the medians of the per-rep ratios. Run alone (8 CPU devices): ``python
benchmarks/hf_rows.py [--scale 0.1] [--reps 3]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import tpu_ckpt as tc

MB = 1e6
TARGETS = {"export_s": 1.2, "export_read_s": None, "export_warm_s": None, "load_same_s": 1.1, "load_resharded_s": 1.3,
           "read_share": 1.05}
LABELS = {"export_s": ("HF export (s)", "tc.save"), "export_read_s": ("HF export (s)", "save + raw read"),
          "export_warm_s": ("HF export, source cached (s)", "tc.save"),
          "load_same_s": ("HF load, same mesh (s)", "naive"),
          "load_resharded_s": ("HF load, resharded (s)", "naive"), "read_share": ("HF load bytes read / held", "")}


def read_bytes() -> int:
    """Bytes this process has read with read system calls (all threads), ``rchar``."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def held_bytes(tree: Any) -> int:
    """The distinct bytes of ``tree``'s arrays this process's devices hold (a replica counted once)."""
    return sum(_held(leaf) for leaf in jax.tree.leaves(tree))


def _held(leaf: jax.Array) -> int:
    slices = {tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape)) for shard in leaf.addressable_shards}
    return sum(int(np.prod([b - a for a, b in s])) for s in slices) * leaf.dtype.itemsize


def naive_load(hf: str, target: Any) -> Any:
    """What a reader that trusts its files does: every tensor whole, then device_put."""
    from safetensors import safe_open

    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    names = {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in paths}
    out = {}
    for file in sorted(os.listdir(hf)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(hf, file), "numpy") as f:
                for name in f.keys():
                    if name in names:
                        out[name] = jax.device_put(f.get_tensor(name), names[name].sharding)
    return jax.block_until_ready(treedef.unflatten([out[name] for name in names]))


def raw_read(directory: str) -> int:
    """Reads every file of ``directory`` once, in order, 16 MiB at a time: what reading the
    checkpoint costs with nothing else (an export reads it all, then writes as much)."""
    total, buffer = 0, bytearray(16 << 20)
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _free(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf.delete()


def one_rep(params: Any, targets: dict[str, Any], workdir: str, drop: Callable[[], Any]) -> dict[str, float]:
    """One rep's times and ratios (see the module docstring); its directories removed after."""
    train, hf = os.path.join(workdir, "hf-train"), os.path.join(workdir, "hf-export")
    out: dict[str, float] = {}
    try:
        drop()
        _, out["save_s"] = _timed(lambda: tc.save(train, {"params": params}).wait())
        drop()
        _, out["read_s"] = _timed(lambda: raw_read(train))  # leaves the checkpoint in the page cache
        _, out["export_warm_s"] = _timed(lambda: tc.export_for_serving(train, hf, layout="huggingface"))
        shutil.rmtree(hf)
        drop()
        _, out["export_s"] = _timed(lambda: tc.export_for_serving(train, hf, layout="huggingface"))
        out["save_read_s"] = out["save_s"] + out["read_s"]
        for label, target in targets.items():
            drop()
            before = read_bytes()
            loaded, out[f"load_{label}_s"] = _timed(lambda t=target: jax.block_until_ready(tc.load_safetensors(hf, t)))
            share = (read_bytes() - before) / held_bytes(loaded)
            out["read_share"] = max(out.get("read_share", 0.0), share)
            _free(loaded)
            drop()
            loaded, out[f"naive_{label}_s"] = _timed(lambda t=target: naive_load(hf, t))
            _free(loaded)
    finally:
        shutil.rmtree(train, ignore_errors=True)
        shutil.rmtree(hf, ignore_errors=True)
    return out


def hf_rows(params: Any, targets: dict[str, Any], workdir: str, reps: int, drop: Callable[[], Any]) -> list[dict]:
    """A warm-up rep, then ``reps`` measured ones; prints the table and returns its rows.
    ``targets``: ``{"same": tree, "resharded": tree}`` of ShapeDtypeStructs shaped like ``params``."""
    one_rep(params, targets, workdir, drop)
    samples = [one_rep(params, targets, workdir, drop) for _ in range(reps)]
    for s in samples:
        s["export_read_s"] = s["export_s"]
    baselines = {"export_s": "save_s", "export_read_s": "save_read_s", "export_warm_s": "save_s",
                 "load_same_s": "naive_same_s", "load_resharded_s": "naive_resharded_s"}
    rows = []
    for key, limit in TARGETS.items():
        label, versus = LABELS[key]
        base = baselines.get(key)
        ratio = statistics.median(s[key] / s[base] if base else s[key] for s in samples)
        rows.append({"metric": label, "tpu_ckpt": f"{statistics.median(s[key] for s in samples):.3f}",
                     "baseline": f"{versus} {statistics.median(s[base] for s in samples):.3f}" if base else "",
                     "ratio": f"{ratio:.3f}x", "target": f"<= {limit}x" if limit else "",
                     "result": ("PASS" if ratio <= limit else "FAIL") if limit else ""})
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(params)) / MB
    print(f"\n== workload lm: params ({size:.0f} MB) to the Hugging Face layout and back "
          "(medians of per-rep ratios) ==")
    for row in rows:
        print("  ".join(f"{row[c]:>24}" if i else f"{row[c]:28}" for i, c in enumerate(row)))
    return rows


def main() -> None:
    import argparse
    import tempfile

    import benchmark  # benchmarks/: asks for 8 CPU devices before JAX starts them

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.1, help="lm size; 1.0 ~= 1.3 GB with Adam's state")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    params = benchmark.lm_state(args.scale).params
    targets = {name: benchmark.abstract(params, benchmark.mesh(shape))
               for name, shape in (("same", benchmark.SAVE_MESH), ("resharded", benchmark.RESTORE_MESH))}
    workdir = tempfile.mkdtemp(prefix="tpu_ckpt_hf_")
    try:
        hf_rows(params, targets, workdir, args.reps, benchmark.drop_caches)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
