"""A host's save planning follows its own share (#21): it decides only the blocks it holds,
never walking the pod's, and the processes still agree on who writes each block."""

import collections
import os

import pytest

from tests.support import process_group


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_process_plans_only_its_own_blocks_and_every_block_is_written_once():
    worker = os.path.join(os.path.dirname(__file__), "plan_share_worker.py")
    runs = process_group.run_script(worker, 4, devices_per_process=2)
    assert all(r.returncode == 0 and r.result for r in runs), [r.output for r in runs]
    results = {r.result["process"]: r.result for r in runs}
    # Planning decides the blocks this process holds with another, and nothing else: no
    # decision for the 5 leaves x 8 blocks held by one process each, one per paired leaf
    # (its one block of the two this process holds), none for the other pair's blocks.
    for process, result in results.items():
        pair = [0, 1] if process < 2 else [2, 3]
        assert result["decisions"] == [pair] * 6, (process, result["decisions"])
    writers = collections.defaultdict(list)
    written = collections.Counter()
    for process, result in results.items():
        for key, spec, nbytes in result["blocks"]:
            writers[key, str(spec)].append(process)
            written[process] += nbytes
    assert all(len(w) == 1 for w in writers.values()), writers  # every block once in the job
    assert len([k for k in writers if k[0].startswith("sharded")]) == 5 * 8
    assert len([k for k in writers if k[0].startswith("paired")]) == 6 * 2
    for key, spec in writers:
        if key.startswith("paired"):
            (writer,) = writers[key, spec]
            assert writer in ([0, 1] if spec.startswith("[[0,") else [2, 3]), (key, spec, writer)
    paired = collections.Counter()
    for process, result in results.items():
        paired[process] = sum(n for key, _, n in result["blocks"] if key.startswith("paired"))
    for a, b in ((0, 1), (2, 3)):  # each pair shares its blocks' bytes: neither writes them all
        assert paired[a] and paired[b] and max(paired[a], paired[b]) <= 2 * min(paired[a], paired[b]), paired
