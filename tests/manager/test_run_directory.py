"""On an object store a manager lists one record per step, not every object of every step;
records survive two managers on one run and a crash between a commit and its record."""

import urllib.parse

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage
from tpu_ckpt.manager._run_directory import INDEX_PREFIX, RunDirectory

pytestmark = pytest.mark.emulator


def tree(step: int) -> dict:
    return {f"w{i}": np.full((64,), step * 10 + i, np.float32) for i in range(40)}


def many_files() -> tc.CheckpointOptions:
    return tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(256))  # a file per leaf: 40 objects a step


def listed_prefixes(proxy) -> list[str]:
    """The key ranges listed through the proxy: S3's ListObjectsV2 ``prefix``, GCS's JSON API
    ``startOffset`` (tensorstore lists a range)."""
    prefixes = []
    for request in proxy.requests:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(request.path).query)
        start = query.get("prefix") or query.get("startOffset")
        if request.method == "GET" and start:
            prefixes.append(start[0])
    return prefixes


def test_a_listing_reads_the_records_of_the_steps_not_their_objects(faulty):
    proxy, bucket = faulty
    run = bucket.url("run")
    with tc.CheckpointManager(run, max_to_keep=2, options=many_files()) as manager:
        for step in range(3):
            manager.save(step, tree(step))
        proxy.requests.clear()
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        prefixes = listed_prefixes(proxy)
        assert prefixes and all(f"/{INDEX_PREFIX}/" in p for p in prefixes), prefixes  # never the run's objects
        assert len(proxy.requests) <= 4, [(r.method, r.path) for r in proxy.requests]  # two listings of the records
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_2"))["w3"], tree(2)["w3"])
    assert not [k for k in bucket.keys("run/") if k.startswith("run/step_0/")]  # retention removed step 0


def test_a_commit_whose_record_was_lost_is_found_and_a_run_without_records_is_listed_once(bucket):
    run = bucket.url("run")
    tc.save(bucket.url("run/step_3"), tree(3)).wait()  # written without a manager: no record
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        assert manager.all_steps() == [3]  # the first listing lists every object and records them
        RunDirectory(storage.location(run), leader=0).started("step_5")
        tc.save(bucket.url("run/step_5"), tree(5)).wait()  # committed, its record never updated (a crash)
        assert manager.all_steps() == [3, 5]
        bucket.delete(f"run/{INDEX_PREFIX}/step_3.committed")  # a record lost by hand
        assert manager.all_steps() == [5]
        manager.reload()
        assert manager.all_steps() == [3, 5]
        np.testing.assert_array_equal(manager.restore(5)["w0"], tree(5)["w0"])
