"""Slice copies in the local tier's choice (a pure function), and TPU_CKPT_SLICES."""

import json

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt.settings import Settings
from tpu_ckpt.tiers._choice import Choice, decide
from tpu_ckpt.tiers._slice_copies import copy_group


def _report(*steps) -> str:
    return json.dumps([list(s) for s in steps])


def test_a_step_saved_as_slice_copies_is_whole_when_one_slice_survives():
    # Processes 0-1 are slice 0, 2-3 slice 1; each slice wrote a whole copy, nothing replicated.
    reports = {0: _report((5, "t", 4, [0], [0, 1])), 1: _report((5, "t", 4, [1], [0, 1])), 2: "[]", 3: "[]"}
    assert decide(reports, set(), None) == Choice(5, True, {0: 0, 1: 1})
    reports = {0: "[]", 1: "[]", 2: _report((5, "t", 4, [2], [2, 3])), 3: _report((5, "t", 4, [3], [2, 3]))}
    assert decide(reports, set(), None) == Choice(5, True, {2: 2, 3: 3})


def test_a_slice_copy_missing_a_part_is_not_whole():
    reports = {0: _report((5, "t", 4, [0], [0, 1])), 1: "[]", 2: _report((5, "t", 4, [2], [2, 3])), 3: "[]"}
    assert decide(reports, {3}, None) == Choice(3)


def test_reports_without_copies_keep_the_rule_for_every_part():
    reports = {0: _report((5, "t", 2, [0, 1])), 1: "[]"}
    assert decide(reports, set(), None) == Choice(5, True, {0: 0, 1: 0})


@pytest.mark.parametrize(("text", "slices"), [("0,0,1,1", (0, 0, 1, 1)), ("3", (3,))])
def test_the_slices_come_from_the_environment(text, slices):
    assert Settings.from_environment({"TPU_CKPT_SLICES": text}).slices == slices


@pytest.mark.parametrize("text", ["a,b", "0,-1", ","])
def test_unreadable_slices_are_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="TPU_CKPT_SLICES"):
        Settings.from_environment({"TPU_CKPT_SLICES": text})


def test_each_whole_slice_reads_its_own_copy_and_a_lost_slice_a_whole_one():
    # Slices 0-1 / 2-3 / 4-5 each wrote a copy; slice 1 (processes 2, 3) lost theirs.
    mine = [(5, "t", 6, [p], [2 * (p // 2), 2 * (p // 2) + 1]) for p in range(6)]
    reports = {p: ("[]" if p in (2, 3) else _report(mine[p])) for p in range(6)}
    choice = decide(reports, set(), None)
    assert choice.copies == ((0, 1), (4, 5)) and choice.holders == {0: 0, 1: 1, 4: 4, 5: 5}
    assert Choice.from_json(choice.to_json()).copies == choice.copies
    assert choice.reads(0, 6) == ([0, 1], [0, 1, 2]) and choice.reads(5, 6) == ([4, 5], [3, 4, 5])
    assert choice.reads(2, 6) == ([0, 1], [0, 1, 2]) and choice.reads(3, 6) == ([4, 5], [3, 4, 5])
    plain = decide({0: _report((5, "t", 2, [0, 1])), 1: "[]"}, set(), None)
    assert plain.reads(1, 2) == ([0, 1], [0, 1])


def test_the_range_servers_are_capped_whatever_the_job():
    from tpu_ckpt import cluster
    from tpu_ckpt.tiers._range_merge import leaf_ranges

    assert len(leaf_ranges(100_000, min(1536, cluster.fanout(1536)))) == cluster.fanout(1536) == 64


def test_a_tree_with_per_process_values_is_never_saved_as_slice_copies():
    """Another slice holds no process's own tc.PerProcess value: such a step's parts are replicated."""
    tree = {"w": np.zeros(4, np.float32), "step": 3}
    assert copy_group(tree, 0, (0, 0, 1, 1)) == frozenset({0, 1})
    assert copy_group({**tree, "it": tc.PerProcess({"next_index": 8})}, 0, (0, 0, 1, 1)) is None
