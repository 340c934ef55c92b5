"""Host memory stays bounded: measured in a fresh process (peak RSS via VmHWM)."""

import json
import os
import subprocess
import sys

import pytest

from tpu_ckpt.read_plan import MAX_READ_BYTES
from tpu_ckpt.settings import Settings

pytestmark = [pytest.mark.slow]

SLACK = 96 << 20  # interpreter, allocator and page-table noise


def test_save_and_restore_peak_memory(tmp_path):
    megabytes = 768  # 8 data files of 96 MB
    probe = os.path.join(os.path.dirname(__file__), "memory_probe.py")
    out = subprocess.run([sys.executable, probe, str(tmp_path), str(megabytes)], capture_output=True, text=True, check=True)
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    state = peaks["state_bytes"]
    # Beyond the live arrays, a save holds at most the files in flight (none at all on CPU,
    # where pieces are written straight from the arrays' buffers).
    assert peaks["save_peak"] <= Settings().writes_in_flight * (state // 8) + SLACK, peaks
    # A restore holds the restored arrays plus two read batches (one being read, one placed).
    assert peaks["restore_peak"] <= state + 2 * Settings().read_batch_bytes + MAX_READ_BYTES + SLACK, peaks
