"""On an object store a manager lists the run once, then keeps the listing: its saves and
retention update it, nothing is written into the run for it, and reload() lists anew."""

import urllib.parse

import numpy as np
import pytest

import tpu_ckpt as tc

pytestmark = pytest.mark.emulator


def tree(step: int) -> dict:
    return {f"w{i}": np.full((64,), step * 10 + i, np.float32) for i in range(40)}


def many_files() -> tc.CheckpointOptions:
    return tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(256))  # a file per leaf: 40 objects a step


def listings(proxy) -> list[str]:
    """The key ranges listed through the proxy: S3's ListObjectsV2 ``prefix``, GCS's JSON API
    ``startOffset`` (tensorstore lists a range)."""
    prefixes = []
    for request in proxy.requests:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(request.path).query)
        start = query.get("prefix") or query.get("startOffset")
        if request.method == "GET" and start:
            prefixes.append(start[0])
    return prefixes


def test_the_run_is_listed_once_and_its_objects_are_only_the_steps(faulty):
    proxy, bucket = faulty
    run = bucket.url("run")
    with tc.CheckpointManager(run, max_to_keep=2, options=many_files()) as manager:
        manager.save(0, tree(0))
        proxy.requests.clear()
        for step in (1, 2):
            manager.save(step, tree(step))
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        run_prefix = urllib.parse.urlparse(bucket.url("run/")).path.lstrip("/")
        assert not [p for p in listings(proxy) if p.endswith(run_prefix)], listings(proxy)  # the run never listed again
    # retention; nothing of ours added
    assert {key.split("/")[1] for key in bucket.keys("run/")} == {"step_1", "step_2"}
    np.testing.assert_array_equal(tc.restore(bucket.url("run/step_2"))["w3"], tree(2)["w3"])


def test_steps_written_by_others_are_seen_after_reload(bucket):
    run = bucket.url("run")
    tc.save(bucket.url("run/step_3"), tree(3)).wait()  # written without a manager
    with tc.CheckpointManager(run, max_to_keep=None) as manager:
        assert manager.all_steps() == [3]  # the first listing lists every object
        tc.save(bucket.url("run/step_5"), tree(5)).wait()  # another job's
        assert manager.all_steps() == [3]  # the kept listing
        manager.reload()
        assert manager.all_steps() == [3, 5]
        np.testing.assert_array_equal(manager.restore(5)["w0"], tree(5)["w0"])
