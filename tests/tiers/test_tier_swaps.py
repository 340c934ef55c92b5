"""A local step's parts, indexes and plan are tied to their save, and what a manager lists is
what it restores (issue #38): 2 real JAX processes, files of local step 5 swapped into local
step 6, and a stray persistent step (tests/tiers/tier_swap_scenarios.py)."""

import pytest

from tests.support import process_group

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# case -> (latest_step() before the restore, the step restored): another holder's part, else
# another local step; data files are only found out by their crc32c as the restore reads
# them (the persistent step 5 then), after which latest_step() no longer names step 6. A
# damaged index is found as a swapped one is: by its crc32c against tier.json.
EXPECTED = {"part": (5, 5), "index": (5, 5), "data": (6, 5), "plan": (6, 6), "flipped": (5, 5)}


def test_a_part_index_data_or_plan_of_another_save_is_never_restored_with_this_one(tmp_path):
    results = process_group.run("tiers.tier_swap_scenarios.swapped", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
    for process, r in enumerate(results):
        for case, (latest, step) in EXPECTED.items():
            res = r.result[case]
            assert (res["latest_before"], res["step"]) == (latest, step), (process, case, res)
            assert res["mismatches"] == [] and res["again"] == [], (process, case, res)
            assert res["latest_after"] == step, (process, case, res)


def test_a_stray_persistent_step_is_named_by_restore_and_skipped_with_fallback_on_every_process(tmp_path):
    results = process_group.run("tiers.tier_swap_scenarios.stray_persistent_step", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        res = r.result
        assert res["latest"] == 3 and res["all"] == [1], res
        assert res["error"][0] == "CorruptCheckpointError" and ", 9, cannot be restored" in res["error"][1], res
        assert res["step"] == 3 and res["mismatches"] == [], res
