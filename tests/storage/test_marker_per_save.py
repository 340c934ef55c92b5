"""On an object store each save's staging marker is its own, named with its token
(``<hash>-<token>-staging.json``, FORMAT.md "Commit protocol"), as every other object of the
save: a save that fails removes its own marker with its objects and never another save's;
``tpu-ckpt gc`` holds a save's strays exactly for its own marker's grace period, then removes
them with that marker; a committed checkpoint with another save's marker beside it stays
committed; a leftover is held by the latest of its markers; and the plain ``staging.json`` of
older saves still marks a staging area. Against gcp-storage-emulator and moto (issue #23)."""

from __future__ import annotations

import json
import time

import pytest

import tpu_ckpt as tc
from tests.saving.test_save_integrity import Sabotage
from tests.support.helpers import assert_bit_exact, mixed_state
from tests.support.object_stores import Bucket
from tpu_ckpt import catalog, storage
from tpu_ckpt.cli import main
from tpu_ckpt.format import STAGING_MARKER, spread, token_of
from tpu_ckpt.storage._stores import STAGING_GRACE_S, mark_staging

pytestmark = pytest.mark.emulator

STALLED, RUNNING = "5c0e9b21d4aa", "77aa0199"  # the tokens of a save long gone, and of one writing


def objects(bucket: Bucket, path: str) -> set[str]:
    return {key[len(path) + 1 :] for key in bucket.keys(path + "/")}


def marker_of(token: str) -> str:
    return spread(token, STAGING_MARKER)


def mark(bucket: Bucket, path: str, token: str, started: float | None = None) -> None:
    """The staging marker of the save with ``token`` in ``path``: as a save writes it, or, to
    date it back, by hand."""
    where = storage.Location(bucket.url(path))
    if started is None:
        with storage.Store(where, threads=1) as store:
            mark_staging(store, where, token)
        return
    marker = {"final": where.name, "token": token, "started": started, "grace_s": STAGING_GRACE_S}
    bucket.put(f"{path}/{marker_of(token)}", json.dumps(marker).encode())


def plant(bucket: Bucket, path: str, token: str) -> set[str]:
    """Objects a save with ``token`` wrote into ``path`` and never committed."""
    names = {spread(token, "d00000-00000.safetensors"), spread(token, "index-00001.bin")}
    for name in names:
        bucket.put(f"{path}/{name}", b"what a save that never committed wrote")
    return names


def new_data_file(bucket: Bucket, path: str):
    """Whether a data file that was not in ``path`` at first is there now: this save's."""
    before = objects(bucket, path)
    return lambda: any(n.endswith(".safetensors") for n in objects(bucket, path) - before)


def test_a_save_in_flight_has_a_marker_named_with_its_token_and_none_is_left_once_committed(bucket):
    seen: set[str] = set()
    during = Sabotage(new_data_file(bucket, "c"), lambda: seen.update(objects(bucket, "c")))
    tc.save(bucket.url("c"), mixed_state(), options=tc.CheckpointOptions(sharding_callback=during))
    assert during.acted
    (token,) = {token_of(name) for name in seen}
    assert storage.markers(seen) == [marker_of(token)] and marker_of(token).endswith(f"-{token}-staging.json")
    left = objects(bucket, "c")
    assert "manifest.json" in left and storage.markers(left) == []
    assert_bit_exact(tc.restore(bucket.url("c")), mixed_state())

    mark(bucket, "d", RUNNING)  # as every save marks its staging area
    assert objects(bucket, "d") == {marker_of(RUNNING)}
    marker = storage.read_marker(storage.Location(bucket.url("d")), marker_of(RUNNING))
    assert marker is not None and marker.token == RUNNING and marker.final == "d"


def test_a_failed_save_removes_its_own_marker_and_leaves_another_saves(bucket):
    mark(bucket, "c", RUNNING)  # another save still writing into the same prefix
    others = plant(bucket, "c", RUNNING) | {marker_of(RUNNING)}

    def fail() -> None:
        raise RuntimeError("the save broke between its data and its commit")

    broken = Sabotage(new_data_file(bucket, "c"), fail)
    with pytest.raises(RuntimeError, match="broke between"):
        tc.save(bucket.url("c"), mixed_state(), options=tc.CheckpointOptions(sharding_callback=broken))
    assert broken.acted
    assert objects(bucket, "c") == others  # its own objects and marker gone, none of the other save's


def test_gc_removes_a_stale_saves_strays_with_its_marker_and_keeps_a_running_saves(bucket, capsys):
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, mixed_state())
    committed = objects(bucket, "run/step_1")
    mark(bucket, "run/step_1", STALLED, started=time.time() - 2 * STAGING_GRACE_S)
    stalled = plant(bucket, "run/step_1", STALLED) | {marker_of(STALLED)}
    mark(bucket, "run/step_1", RUNNING)
    running = plant(bucket, "run/step_1", RUNNING) | {marker_of(RUNNING)}

    found = {s.tokens[0]: s for s in catalog.strays(bucket.url("run"))}
    assert sorted(found) == sorted([STALLED, RUNNING])
    assert set(found[STALLED].files) == stalled and found[STALLED].held_until < time.time()
    assert set(found[RUNNING].files) == running and found[RUNNING].held_until > time.time() + STAGING_GRACE_S - 60
    assert main(["gc", bucket.url("run")]) == 0
    removed, kept = capsys.readouterr().out.splitlines()
    assert removed == (
        f"removed {len(stalled)} stray objects in step_1 (written by a save {STALLED} that never committed it)"
    )
    assert kept.startswith(
        f"kept {len(running)} stray objects in step_1 (a save that may still be running; removable in "
    )
    assert objects(bucket, "run/step_1") == committed | running

    # Beside the running save's marker, step_1 is as committed as ever.
    assert catalog.checkpoints_in(bucket.url("run")) == {"step_1": 1}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        assert manager.all_steps() == [1]
        assert_bit_exact(manager.restore(1), mixed_state())
    assert_bit_exact(tc.restore(bucket.url("run/step_1")), mixed_state())


def test_a_leftover_is_held_by_the_latest_of_its_markers_plain_or_tokened(bucket):
    long_ago, now = time.time() - 2 * STAGING_GRACE_S, time.time()
    plain = {"final": "step_4", "token": STALLED, "started": long_ago, "grace_s": STAGING_GRACE_S}
    bucket.put(f"run/step_4/{STAGING_MARKER}", json.dumps(plain).encode())  # an older save, long gone
    plant(bucket, "run/step_4", STALLED)
    bucket.put(f"run/step_5/{STAGING_MARKER}", json.dumps({**plain, "final": "step_5"}).encode())
    mark(bucket, "run/step_5", RUNNING, started=now)  # a save of step_5 started a moment ago, beside an older one's
    plant(bucket, "run/step_5", RUNNING)
    bucket.put(f"run/step_6/{STAGING_MARKER}", json.dumps({**plain, "final": "step_6", "started": now}).encode())
    plant(bucket, "run/step_6", STALLED)  # a save of an earlier version, still running

    entries = {e.name: e for e in catalog.scan(bucket.url("run"))}
    assert not catalog.busy(entries["step_4"]) and catalog.busy(entries["step_5"]) and catalog.busy(entries["step_6"])
    assert entries["step_5"].held_until == now + STAGING_GRACE_S  # the tokened marker's, the later
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, mixed_state())
        assert manager.all_steps() == [1]
    assert {e.name for e in catalog.scan(bucket.url("run"))} == {"step_1", "step_5", "step_6"}
    assert storage.markers(objects(bucket, "run/step_5")) == sorted([STAGING_MARKER, marker_of(RUNNING)])
