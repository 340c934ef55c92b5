"""Host memory stays bounded: measured in a fresh process (peak RSS via VmHWM)."""

import json
import os
import subprocess
import sys

import pytest

from tpu_ckpt.format import MAX_READ_BYTES
from tpu_ckpt.settings import Settings

pytestmark = [pytest.mark.slow]

SLACK = 96 << 20  # interpreter, allocator and page-table noise


def test_save_and_restore_peak_memory(tmp_path):
    megabytes = 768  # 8 data files of 96 MB
    probe = os.path.join(os.path.dirname(__file__), "memory_probe.py")
    out = subprocess.run(
        [sys.executable, probe, str(tmp_path), str(megabytes)], capture_output=True, text=True, check=True
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    state = peaks["state_bytes"]
    # Beyond the live arrays, a save holds at most the files in flight (none at all on CPU,
    # where pieces are written straight from the arrays' buffers).
    assert peaks["save_peak"] <= Settings().writes_in_flight * (state // 8) + SLACK, peaks
    # A restore holds the restored arrays plus two read batches (one being read, one placed).
    assert peaks["restore_peak"] <= state + 2 * Settings().read_batch_bytes + MAX_READ_BYTES + SLACK, peaks


def test_host_memory_limit_bounds_saves_and_restores(tmp_path):
    """Issue 13: with host_memory_limit=128 MiB and a 576 MiB state, a sync save, an async
    save (whose snapshot cannot fit: the call writes the first files itself) and a restore
    each hold at most the limit + 64 MiB beyond the live arrays and the restored result."""
    limit, megabytes = 128 << 20, 576
    probe = os.path.join(os.path.dirname(__file__), "memory_limit_probe.py")
    out = subprocess.run(
        [sys.executable, probe, str(tmp_path), str(megabytes), str(limit)], capture_output=True, text=True, check=True
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    state = peaks["state_bytes"]
    assert peaks["sync_save"] <= limit + (64 << 20), peaks
    assert peaks["async_save"] <= limit + (64 << 20), peaks
    assert peaks["restore"] <= state + limit + (64 << 20), peaks
    assert peaks["restored_exactly"], peaks
    assert peaks["files"] >= state // (limit // Settings().writes_in_flight), peaks  # files cut to a share of it


SAVE_BYTES_PER_PIECE = 1792  # docs/memory.md: bookkeeping outside host_memory_limit (measured ~1.4 KB, #39)
RESTORE_BYTES_PER_PIECE = 2560  # measured ~2 KB


def test_host_memory_limit_holds_with_many_small_leaves(tmp_path):
    """Issue 28: 65,536 leaves of 16 KiB (1 GiB) under a 16 MiB limit. Each piece's bookkeeping
    (its plan, manifest and table entries) is outside the bound, at most the per-piece cost the
    README states; beyond it, a save or restore holds the limit + 5% (+ slack)."""
    limit, leaves = 16 << 20, 65536
    probe = os.path.join(os.path.dirname(__file__), "small_leaves_probe.py")
    out = subprocess.run(
        [sys.executable, probe, str(tmp_path), str(leaves), str(limit)], capture_output=True, text=True, check=True
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    bound = limit * 1.05 + (32 << 20)  # interpreter and allocator noise
    assert peaks["sync_save"] <= bound + leaves * SAVE_BYTES_PER_PIECE, peaks
    assert peaks["async_save"] <= bound + leaves * SAVE_BYTES_PER_PIECE, peaks
    assert peaks["restore"] - peaks["restore_held"] <= bound + leaves * RESTORE_BYTES_PER_PIECE, peaks
    assert peaks["restore_held"] <= peaks["state_bytes"] * 1.5, peaks  # the result: data and jax's arrays
    assert peaks["restored_exactly"], peaks
