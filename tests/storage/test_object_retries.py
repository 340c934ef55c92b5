"""Throttling survived: gs:// and s3:// saves and restores through a FaultyProxy that answers
429 and 503 for a period, for a fraction of requests, or drops connections, retried for as
long as the ``object_retry_seconds`` budget lasts and no longer; and the manifest, the
commit, created only if absent. Every test runs on the GCS emulator and on moto."""

import threading
import time
import urllib.parse

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.object_stores import DROP, FaultyProxy
from tpu_ckpt import storage
from tpu_ckpt.settings import Settings

pytestmark = [pytest.mark.emulator]

SEVERAL_FILES = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(4096))


def state() -> dict:
    rng = np.random.default_rng(23)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "ids": np.arange(3000, dtype=np.int64), "step": 5}


def assert_bit_exact(restored: dict, expected: dict) -> None:
    assert restored["step"] == expected["step"]
    for key in ("w", "ids"):
        assert restored[key].dtype == expected[key].dtype
        assert restored[key].tobytes() == expected[key].tobytes()


def is_upload(method: str, path: str) -> bool:
    return (method == "POST" and path.startswith("/upload/")) or method == "PUT"


def is_manifest_upload(method: str, path: str) -> bool:
    return is_upload(method, path) and "manifest.json" in urllib.parse.unquote(path)  # GCS: in the query


def is_read(method: str, path: str) -> bool:
    return method == "GET"


def refused(proxy: FaultyProxy, match) -> list[int]:
    return [r.status for r in proxy.requests if match(r.method, r.path) and r.status != 200]


def test_the_budget_comes_from_the_environment():
    assert Settings().object_retry_seconds >= 900
    assert Settings.from_environment({"TPU_CKPT_OBJECT_RETRY_SECONDS": "42.5"}).object_retry_seconds == 42.5
    with pytest.raises(ValueError, match="TPU_CKPT_OBJECT_RETRY_SECONDS"):
        Settings.from_environment({"TPU_CKPT_OBJECT_RETRY_SECONDS": "soon"})
    with pytest.raises(ValueError, match="object_retry_seconds must be positive"):
        Settings(object_retry_seconds=0)


def test_a_storm_of_429_and_503_during_a_save_is_waited_out(faulty):
    proxy, bucket = faulty
    proxy.storm(503, 1.5, is_upload)  # then 429 until 4 s from now: longer than tensorstore's own retries
    proxy.storm(429, 4.0, is_upload)
    tc.save(bucket.url("c"), state(), options=SEVERAL_FILES).wait()
    statuses = refused(proxy, is_upload)
    assert 503 in statuses and 429 in statuses
    assert_bit_exact(tc.restore(bucket.url("c")), state())


def test_a_storm_during_a_restore_is_waited_out(faulty):
    proxy, bucket = faulty
    tc.save(bucket.url("c"), state(), options=SEVERAL_FILES).wait()
    proxy.storm(429, 1.5, is_read)
    proxy.storm(503, 4.0, is_read)
    assert_bit_exact(tc.restore(bucket.url("c")), state())
    assert {429, 503} <= set(refused(proxy, is_read))


def test_a_fifth_of_requests_refused_and_dropped_connections_still_save_and_restore(faulty):
    proxy, bucket = faulty
    proxy.flaky(0.2, 503)
    proxy.fail(is_upload, [DROP, DROP, DROP])
    tc.save(bucket.url("c"), state(), options=SEVERAL_FILES).wait()
    assert_bit_exact(tc.restore(bucket.url("c")), state())
    assert DROP in refused(proxy, is_upload) and 503 in refused(proxy, lambda m, p: True)


def test_a_commit_refused_past_the_budget_fails_in_time_and_commits_nothing(faulty, small_budget):
    proxy, bucket = faulty
    proxy.storm(503, 600, is_manifest_upload)
    with pytest.raises(tc.CheckpointError, match="503") as raised:
        tc.save(bucket.url("c"), state(), options=SEVERAL_FILES).wait()
    assert raised.value.file == bucket.url("c/manifest.json")
    assert "TPU_CKPT_OBJECT_RETRY_SECONDS" in str(raised.value)
    attempts = [r.at for r in proxy.requests if is_manifest_upload(r.method, r.path)]
    failed = next(r.at for r in proxy.requests if r.method == "DELETE")  # the cleanup, once the commit gave up
    # Within the budget, give or take: a retry starts only with room for an attempt twice the
    # longest so far, so a loaded machine (slow attempts) gives up earlier than the budget's end.
    assert small_budget * 0.5 <= failed - attempts[0] <= small_budget * 1.5 and len(attempts) > 3
    proxy.calm()
    assert bucket.keys("c/") == []  # no manifest, and the save's own objects removed
    with pytest.raises(tc.CheckpointError):
        tc.restore(bucket.url("c"))


def test_a_restore_refused_past_the_budget_fails_in_time_naming_the_object(faulty, small_budget):
    proxy, bucket = faulty
    tc.save(bucket.url("c"), state()).wait()
    proxy.storm(429, 600, is_read)
    started = time.monotonic()
    with pytest.raises(tc.CheckpointError, match="429") as raised:
        tc.restore(bucket.url("c"))
    # It gives up once no attempt twice as long as the longest so far fits in the budget: on a
    # loaded machine an attempt takes up to a second, so it may stop well before the end.
    assert small_budget * 0.5 <= time.monotonic() - started <= small_budget * 1.1
    assert raised.value.file is not None and raised.value.file.startswith(bucket.url("c/"))


def test_the_manifest_is_created_only_if_absent(faulty):
    proxy, bucket = faulty
    with storage.Store(storage.Location(bucket.url("c"))) as store:
        store.create("manifest.json", b"first")  # what a save's commit asks for (saving/_commit.py)
        if bucket.scheme == "gs":
            # gcp-storage-emulator ignores ifGenerationMatch; Cloud Storage refuses the second
            # write with 412. What is verified here: the precondition is asked for.
            assert all("ifGenerationMatch=0" in r.path for r in proxy.requests if is_manifest_upload(r.method, r.path))
            return
        with pytest.raises(tc.CheckpointExistsError, match="another save committed"):
            store.create("manifest.json", b"second")
    assert bucket.get("c/manifest.json") == b"first"
    # tensorstore checks with a HEAD before the PUT on a non-AWS endpoint (on AWS it sends
    # If-None-Match): the second write never reached the server.
    assert len([r for r in proxy.requests if is_manifest_upload(r.method, r.path)]) == 1


def test_two_saves_of_one_checkpoint_at_once_commit_once(faulty):
    proxy, bucket = faulty
    if bucket.scheme == "gs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch (see test_the_manifest_is_created_only_if_absent)")
    proxy.delay_s = 0.02  # both saves find the path empty before either commits
    start, outcomes = threading.Barrier(2), []

    def save() -> None:
        start.wait()
        try:
            tc.save(bucket.url("c"), state(), options=SEVERAL_FILES).wait()
            outcomes.append("committed")
        except tc.CheckpointError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=save) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("committed") == 1
    (lost,) = [o for o in outcomes if o != "committed"]
    assert isinstance(lost, tc.CheckpointExistsError)
    proxy.delay_s = 0.0
    assert_bit_exact(tc.restore(bucket.url("c")), state())
