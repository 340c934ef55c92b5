"""Writes the golden checkpoints beside this file, each with the tpu_ckpt commit that wrote it.

    .venv/bin/python tests/format/golden/make_golden.py            # every golden checkpoint
    .venv/bin/python tests/format/golden/make_golden.py format-1.2 # one

For each entry of GOLDEN the commit is checked out with ``git worktree add`` under /tmp and this
file is run again there as the writer (``--write NAME OUT``), with that commit's tpu_ckpt first
on ``sys.path``; only the public API every release has kept is called (tc.save,
tc.CheckpointManager, tc.export_for_serving). The values are ``state(step)``: deterministic,
so tests/format/test_golden.py rebuilds them and compares every restored leaf bit for bit.
A golden checkpoint is never rewritten by a later commit: add a new entry for a new format.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

# name -> (commit that wrote it, writer, what it holds). The commits: the last one writing each
# format version (git log -S'"1.2"' and friends), and aff52be for everything format 2 wrote.
GOLDEN = {
    "format-1.0": ("972d776", "plain", "format 1.0: tensors back to back, no seal"),
    "format-1.1": ("ec4c05b", "plain", "format 1.1: every tensor 64-byte aligned, no seal"),
    "format-1.2": ("6bbc525", "plain", "format 1.2: sealed manifest, every piece inline"),
    "format-2.0": ("aff52be", "plain", "format 2.0: piece tables"),
    "incremental": ("aff52be", "incremental", "format 2.0 run: step_1 references step_0, retired (referenced.json)"),
    "local-tier": ("aff52be", "local_tier", "a local tier step_1 (plan.json, tier.json, index-0.bin) and its run"),
    "serving": ("aff52be", "serving", "step_0, its bfloat16 serving export and a linked export (source field)"),
}


def state(step: int) -> dict:
    """The saved tree of ``step``: float32 sharded on a 4x2 mesh, bfloat16, int32, bool, a
    Python value. Only ``params/b`` and ``step`` change from step 0 to 1 (so an incremental
    step references ``w``)."""
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7
    b = (np.arange(8, dtype=np.float32) - 3.5 + step).astype(ml_dtypes.bfloat16)
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("data", "model"))),
            "b": jax.device_put(b, NamedSharding(mesh, PartitionSpec())),
        },
        "opt": {
            "count": np.array([step, 2 * step + 1, -5], dtype=np.int32),
            "mask": np.array([True, False, True, True]),
        },
        "step": step,
    }


def _plain(out: Path) -> None:
    import tpu_ckpt as tc

    tc.save(str(out), state(0)).wait()


def _incremental(out: Path) -> None:
    import tpu_ckpt as tc

    with tc.CheckpointManager(str(out), max_to_keep=1, incremental=True) as manager:
        for step in (0, 1):
            manager.save(step, state(step), force=True)
            manager.wait_until_finished()


def _local_tier(out: Path) -> None:
    import tpu_ckpt as tc

    manager = tc.CheckpointManager(
        str(out / "run"), save_interval_steps=10, local_directory=str(out / "local"), local_interval_steps=1
    )
    with manager:
        for step in (0, 1):
            manager.save(step, state(step))
            manager.wait_until_finished()


def _serving(out: Path) -> None:
    import tpu_ckpt as tc

    tc.save(str(out / "step_0"), state(0)).wait()
    tc.export_for_serving(str(out / "step_0"), str(out / "serving"), dtype="bfloat16")
    tc.export_for_serving(str(out / "step_0"), str(out / "linked"), link=True)


WRITERS = {"plain": _plain, "incremental": _incremental, "local_tier": _local_tier, "serving": _serving}


def _make(name: str) -> None:
    """Checks out the entry's commit, runs its writer there and copies what it wrote here."""
    commit, _, _ = GOLDEN[name]
    tree = Path(tempfile.gettempdir()) / f"tpu_ckpt-golden-{commit}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    dest = HERE / name
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / name
        env = dict(
            os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=8",
        )
        script = [sys.executable, str(Path(__file__).resolve()), "--write", name, str(out), "--tree", str(tree)]
        subprocess.run(script, check=True, cwd=scratch, env=env)
        shutil.copytree(out, dest)
    print(f"{name}: written by {commit}")


def _write(name: str, out: Path, tree: Path) -> None:
    """The writer, run in the old commit's worktree: refuses to write with any other tpu_ckpt."""
    import tpu_ckpt

    if Path(tpu_ckpt.__file__).resolve().parents[1] != tree.resolve():
        raise SystemExit(f"tpu_ckpt imported from {tpu_ckpt.__file__}, not from {tree}")
    import jax

    jax.config.update("jax_enable_x64", True)
    out.mkdir(parents=True)
    WRITERS[GOLDEN[name][1]](out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="golden checkpoints to write (default: all)")
    parser.add_argument("--write", nargs=2, metavar=("NAME", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        _write(args.write[0], Path(args.write[1]), Path(args.tree))
        return
    for name in args.names or GOLDEN:
        _make(name)


if __name__ == "__main__":
    main()
