"""Pausing the cyclic collector during a checkpoint operation, and what the pause leaves."""

import gc
import weakref

from tpu_ckpt.runtime import gc_paused


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_what_a_pause_allocated_goes_to_the_oldest_generation_unexamined_and_nothing_is_lost():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(200_000)]
        garbage = Node()
        gone = weakref.ref(garbage)
        del garbage
    assert gc.isenabled()
    oldest = {id(x) for x in gc.get_objects(generation=2)}
    assert all(id(x) in oldest for x in kept[::1000])  # promoted unexamined, so no young collection walks them
    assert gone() is not None  # the cycle is still there, in the oldest generation...
    gc.collect()
    assert gone() is None  # ...which a full collection frees


def test_objects_the_program_froze_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            extra = [[i] for i in range(1000)]
        # not unfrozen (0), nor the pause's objects frozen (+1,000); a thread an earlier test left
        # running (pytest-xdist orders tests freely) may free a few frozen objects meanwhile
        assert 0 < gc.get_freeze_count() <= frozen and len(extra) == 1000
    finally:
        gc.unfreeze()


def test_a_pause_inside_a_pause_keeps_the_collector_off_until_the_outer_one_ends():
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
