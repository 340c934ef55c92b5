"""SIGKILL during a ~512 MB save never costs the previous checkpoint nor exposes a partial one.

A worker process (crash_worker.py) commits step 1, then saves step 2 and is killed at one
moment of that save: right as it starts, mid-write, between the manifest write and the
commit rename, or right after an asynchronous ``save`` returned. The test process, fresh
relative to the killed one, then checks:

- step 1 restores bit-exactly;
- step 2 is either absent (restore raises Uncommitted/NotFound) or complete and bit-exact:
  on a local disk its final name appears only through the commit rename, so it never
  exists without its manifest;
- nothing but ``step_2.tmp-*`` staging directories is left, and a staging directory is never
  taken for the checkpoint (even one holding a manifest restores bit-exactly or not at all);
- the next save, with those leftovers still present, succeeds, restores bit-exactly and
  leaves nothing of its own behind; once the leftovers are deleted only committed
  checkpoints remain.

Exact timing cannot be forced, so every kill is held to the same invariant and the state it
actually hit is printed (``pytest -rA`` shows it).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import crash_worker
import numpy as np
import pytest

import tpu_ckpt as tc

pytestmark = [pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")
MARKER_TIMEOUT = 120.0  # seconds: worker start-up plus two 512 MB saves on a slow shared disk

# id -> (worker mode, when to kill). ("after", word, fraction): `fraction` of the measured
# step-1 (synchronous) save time after the worker printed `word`; ("commit",): as soon as the staging
# directory holds a manifest (the commit is: manifest written, then the rename).
SCENARIOS = {
    "early-sync": ("sync", ("after", "SAVING", 0.0)),
    "mid_write_30pct-sync": ("sync", ("after", "SAVING", 0.3)),
    # Async: timed from the return of save(), when the background write begins.
    "mid_write_70pct-async": ("async", ("after", "RETURNED", 0.7)),
    "during_commit-async": ("async", ("commit",)),
    "after_return-async": ("async", ("after", "RETURNED", 0.0)),
    "after_durable-async": ("async", ("after", "DONE", 0.0)),  # wait() returned: must be complete
}


class Worker:
    """The worker process, with its stdout lines timestamped by a reader thread."""

    def __init__(self, directory: str, mode: str, log: str):
        self._log = open(log, "w")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, directory, mode], stdout=subprocess.PIPE, stderr=self._log, text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(None)

    def wait_for(self, word: str) -> list[str]:
        deadline = time.monotonic() + MARKER_TIMEOUT
        while True:
            try:
                words = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"worker did not print {word} within {MARKER_TIMEOUT}s") from None
            if words is None:
                self.proc.wait()
                with open(self._log.name) as f:
                    raise AssertionError(f"worker exited ({self.proc.returncode}) before {word}:\n{f.read()[-3000:]}")
            self.seen.append(words[0])
            if words[0] == word:
                return words

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        while (words := self.lines.get()) is not None:  # markers printed before it died
            self.seen.append(words[0])


def staging_dirs(directory: str, name: str) -> list[str]:
    """Staging directories of ``name``: ``<name>.tmp-<token>``, or ``.<name>.tmp-<token>`` when the
    kill came while the directory was being made (storage makes it hidden, marks it, then renames it)."""
    return sorted(n for n in os.listdir(directory) if n.lstrip(".").startswith(name + ".tmp-"))


def wait_for_commit(worker: Worker, directory: str) -> None:
    """Polls until step 2's staging directory holds a manifest (or step 2 is already there)."""
    deadline = time.monotonic() + MARKER_TIMEOUT
    while worker.alive() and time.monotonic() < deadline:
        if os.path.exists(os.path.join(directory, "step_2")):
            return  # the rename already happened: too late for the window, still a valid kill
        for name in staging_dirs(directory, "step_2"):
            if os.path.exists(os.path.join(directory, name, "manifest.json")):
                return
        time.sleep(0.0002)


def describe(directory: str) -> str:
    """What the kill left of step 2, in words."""
    final = os.path.join(directory, "step_2")
    if os.path.isdir(final):
        return "committed" if os.path.exists(os.path.join(final, "manifest.json")) else "FINAL WITHOUT MANIFEST"
    parts = []
    for name in staging_dirs(directory, "step_2"):
        files = os.listdir(os.path.join(directory, name))
        size = sum(os.path.getsize(os.path.join(directory, name, f)) for f in files)
        manifest = "manifest.json" in files
        parts.append(f"staging {'with' if manifest else 'without'} manifest, {len(files)} files, {size / 1e6:.0f} MB")
    return "; ".join(parts) or "nothing written"


def bits64(x) -> np.ndarray:
    """The raw bytes of an array as uint64 words (every leaf here is a multiple of 8 bytes)."""
    return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint64)


def assert_step(restored: dict, step: int) -> None:
    """``restored`` (tc.restore with no target) is exactly what crash_worker saved as ``step``."""
    assert restored["step"] == step
    expected = dict(crash_worker.arrays(step))
    assert sorted(restored["params"]) == sorted(expected)
    for name, want in expected.items():
        got = restored["params"][name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert np.array_equal(bits64(got), bits64(want)), f"step {step} leaf {name} differs"


def assert_absent(path: str) -> type:
    with pytest.raises((tc.UncommittedCheckpointError, tc.CheckpointNotFoundError)) as info:
        tc.restore(path)
    with pytest.raises((tc.UncommittedCheckpointError, tc.CheckpointNotFoundError)):
        tc.metadata(path)
    return info.type


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sigkill_during_save_keeps_previous_step_and_never_exposes_a_partial_one(tmp_path, scenario):
    directory = str(tmp_path / "ckpt")
    os.makedirs(directory)
    mode, when = SCENARIOS[scenario]
    worker = Worker(directory, mode, str(tmp_path / "worker.log"))
    try:
        step1_seconds = float(worker.wait_for("SAVED1")[1])
        if when[0] == "after":
            _, word, fraction = when
            worker.wait_for(word)
            time.sleep(fraction * step1_seconds)
        else:
            worker.wait_for("SAVING")
            wait_for_commit(worker, directory)
    finally:
        worker.kill()
    observed = describe(directory)
    if when == ("after", "DONE", 0.0):
        assert observed == "committed", observed
    print(f"{scenario}: killed after {worker.seen} (step 1 save took {step1_seconds:.2f}s); left: {observed}")

    # The previous step is intact.
    assert_step(tc.restore(os.path.join(directory, "step_1")), 1)

    # The killed step is complete or absent, never partial.
    final = os.path.join(directory, "step_2")
    leftovers = staging_dirs(directory, "step_2")
    assert sorted(os.listdir(directory)) == sorted(
        ["step_1", *leftovers, *(["step_2"] if os.path.exists(final) else [])]
    )
    if os.path.exists(final):
        # On a local disk the final name is created only by the commit rename.
        assert os.path.exists(os.path.join(final, "manifest.json")), f"{final} exists without a manifest"
        assert not leftovers, f"committed, yet staging directories remain: {leftovers}"
        assert_step(tc.restore(final), 2)
        committed = True
    else:
        error = assert_absent(final)
        print(f"{scenario}: restore of the killed step raised {error.__name__}")
        committed = False
    for name in leftovers:
        # A staging directory is not a checkpoint; even opened by its own name, one whose
        # manifest made it to disk holds the complete step (the manifest is written last).
        staging = os.path.join(directory, name)
        try:
            restored = tc.restore(staging)
        except tc.CheckpointError as e:
            print(f"{scenario}: restore of leftover {name} raised {type(e).__name__}")
            continue
        assert_step(restored, 2)
        print(f"{scenario}: leftover {name}, restored by its own name, holds the complete step 2")
        del restored

    # The next save succeeds with the leftovers still present and adds none of its own.
    step = 3 if committed else 2
    target = os.path.join(directory, f"step_{step}")
    tc.save(target, crash_worker.tree(step)).wait()
    assert_step(tc.restore(target), step)
    assert staging_dirs(directory, f"step_{step}") == (leftovers if step == 2 else [])

    # Once the leftovers are deleted, only committed checkpoints remain, all restorable.
    for name in leftovers:
        shutil.rmtree(os.path.join(directory, name))
    names = sorted(os.listdir(directory))
    assert names == sorted({"step_1", "step_2", f"step_{step}"})
    for name in names:
        assert os.path.exists(os.path.join(directory, name, "manifest.json")), name
    assert tc.metadata(final)["params"]["layer_0"].shape == (crash_worker.ROWS, crash_worker.COLS)
