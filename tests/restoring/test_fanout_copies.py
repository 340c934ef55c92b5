"""Which replica axes the collective may sum over when each slice reads its own copy
(restoring/_fanout.py ``_inside_copies``), in 4 real processes: only axes whose every group
of devices lies in one copy and holds, per copy, every device of each shard."""

import pytest

from tests.support import process_group


@pytest.mark.multiprocess
def test_the_collective_sums_only_inside_a_copy(tmp_path):
    results = process_group.run("restoring.fanout_scenarios.axes_inside_copies", 4, str(tmp_path),
                                devices_per_process=2)
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        assert r.result == {
            "replicated_by_slice": ["model"],  # each slice's row completes itself
            "replicated_across": [],  # a sum over "slice" would fill only the readers' columns: the relay then
            "sharded_by_slice": [],  # replicated across the slices only: nothing to sum inside one
            "two_in_one_copy": ["slice", "model"],  # one copy of everything: the whole job's collective
        }, r.result
