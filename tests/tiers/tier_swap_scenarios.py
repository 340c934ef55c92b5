"""Local-tier files of one save swapped into another's step, run by every process (see
tests/support/process_group.py): a restore never mixes two saves (issue #38).

2 processes, each part kept by both hosts (``local_replicas=1``); local steps 5 and 6 on every
host, steps 1 and 5 also persistent. Then, as ``case`` says, files of local step 5 are copied
into local step 6, each consistent with the others of its save:

- ``part``: process 0's part (its index and its data files) in host 1's copy of it, host 0's
  disk wiped (a replaced host): only host 1 holds process 0's part, of the wrong save;
- ``index``: the same, the index alone;
- ``data``: the same, the data files alone (the same names and sizes);
- ``flipped``: no swap, host 1's copy of process 0's index damaged (one byte flipped);
- ``plan``: host 0's ``plan.json`` (whose ``step`` is 5; process 0 merges the leaf ``step``),
  host 1 intact.

Each restore must return one save's tree bit-exactly, and ``latest_step()`` the step it returns.
"""

from __future__ import annotations

import os
import shutil

import jax

import tpu_ckpt as tc
from tests.support.mp_scenarios import GLOBAL, _job_mesh, _mismatches, _reversed_mesh, _targets
from tests.tiers.tier_scenarios import _enter_host, _manager, _state

CASES = ("part", "index", "data", "plan", "flipped")


def _swap(case: str, me: int) -> None:
    """Copies files of local step 5 into local step 6 on one host, as ``case`` says."""
    old, new = os.path.join("local", "step_5"), os.path.join("local", "step_6")
    if case == "plan" and me == 0:
        shutil.copyfile(os.path.join(old, "plan.json"), os.path.join(new, "plan.json"))
    if case == "plan":
        return
    if me == 0:
        shutil.rmtree("local")
        return
    if case == "flipped":
        with open(os.path.join(new, "index-00000.bin"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        return
    names = {
        "part": [n for n in os.listdir(old) if n.startswith(("d00000-", "index-00000"))],
        "index": ["index-00000.bin"],
        "data": [n for n in os.listdir(old) if n.startswith("d00000-")],
    }[case]
    for name in names:
        shutil.copyfile(os.path.join(old, name), os.path.join(new, name))


def swapped(directory: str) -> dict:
    me = jax.process_index()
    out = {}
    for case in CASES:
        host = os.path.join(directory, case, f"host{me}")
        os.makedirs(host)
        os.chdir(host)
        persistent = os.path.join(directory, case, "persistent")
        with _manager(persistent, enable_async=False, every=4) as manager:
            for step in range(1, 7):
                manager.save(step, _state(step))
        _swap(case, me)
        with _manager(persistent, enable_async=False, every=4) as manager:
            latest = manager.latest_step()
            restored = manager.restore(None, _targets(_state(0), _reversed_mesh()))
            step = int(restored["step"])
            out[case] = {
                "latest_before": latest, "step": step, "latest_after": manager.latest_step(),
                "mismatches": _mismatches(restored, {"w": GLOBAL + step, "step": step}),
                "again": _mismatches(
                    manager.restore(None, _targets(_state(0), _job_mesh())), {"w": GLOBAL + step, "step": step}
                ),
            }
    return out


def stray_persistent_step(directory: str) -> dict:
    """Local steps 1-3 (step 1 also persistent), then a stray persistent ``step_9`` (a
    manifest that is no checkpoint of ours, put there by process 0, which lists for all):
    ``latest_step()`` names local step 3, ``restore()`` raises naming step 9 on every
    process, ``restore(fallback=True)`` restores local step 3."""
    me = jax.process_index()
    persistent = _enter_host(directory)
    with _manager(persistent, enable_async=False, every=100) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    if me == 0:
        os.makedirs(os.path.join(persistent, "step_9"))
        with open(os.path.join(persistent, "step_9", "manifest.json"), "w") as f:
            f.write('{"format": "not ours"}')
    with _manager(persistent, enable_async=False, every=100) as manager:
        out: dict = {"latest": manager.latest_step(), "all": manager.all_steps()}
        try:
            manager.restore(None, _targets(_state(0), _job_mesh()))
        except tc.CheckpointError as e:
            out["error"] = [type(e).__name__, str(e)]
        restored = manager.restore(None, _targets(_state(0), _reversed_mesh()), fallback=True)
        out["step"] = int(restored["step"])
        out["mismatches"] = _mismatches(restored, {"w": GLOBAL + 3, "step": 3})
    return out
