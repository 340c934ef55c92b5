"""A save into an object store names its objects with its token, after a short hash: two saves
of one checkpoint never write the same name, the loser of the race to commit removes only its
own objects, and checkpoints whose files have the older names (``dPPPPP-NNNNN.safetensors``)
still restore. The manifest is the commit point, created only if absent, and asked for as
such by the commit: a plain write of that name is a plain write."""

from __future__ import annotations

import os
import threading

import pytest

import tpu_ckpt as tc
from tests.support.helpers import assert_bit_exact, mixed_state
from tests.support.object_stores import Bucket
from tpu_ckpt import storage
from tpu_ckpt.format import STAGING_MARKER, data_file_name, marker_name, staged_index_file, token_of, written_by

SEVERAL_FILES = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(4096))


def listed(url: str) -> list[str]:
    with storage.Store(storage.location(url)) as store:
        return store.list()


def test_names_carry_the_token_after_a_hash_and_old_names_still_parse():
    name = data_file_name(3, 12, "0123456789ab")
    assert name.endswith("-0123456789ab-d00003-00012.safetensors") and len(name.split("-")[0]) == 4
    assert written_by(name) == 3 and token_of(name) == "0123456789ab"
    assert written_by(staged_index_file(7, "0123456789ab")) == 7  # what the io_device relay accepts
    assert token_of(staged_index_file(7, "0123456789ab")) == "0123456789ab"
    # Older checkpoints' names, and those of a local save (its staging directory is its own).
    assert data_file_name(3, 12) == "d00003-00012.safetensors" and written_by("d00003-00012.safetensors") == 3
    assert written_by("index-00002.json") == 2 and written_by("index-00002.bin") == 2
    assert token_of("d00003-00012.safetensors") is None and token_of("manifest.json") is None
    assert written_by("manifest.json") is None and written_by("0000-abc-pieces-00000.bin") is None
    # The hash spreads one save's names over the key range: no run of neighbouring keys.
    firsts = {data_file_name(0, n, "0123456789ab")[:2] for n in range(64)}
    assert len(firsts) > 16


def test_an_object_store_save_names_every_object_with_its_token_and_a_local_one_does_not(tmp_path):
    url = "memory://token_names/c"
    tc.save(url, mixed_state(), options=SEVERAL_FILES)
    names = listed(url)
    assert "manifest.json" in names and STAGING_MARKER not in names
    others = [n for n in names if n != "manifest.json"]
    tokens = {token_of(n) for n in others}
    assert len(tokens) == 1 and None not in tokens and len(others) > 8
    assert {n.split("-", 2)[2] for n in others} >= {"d00000-00000.safetensors", "pieces-00000.bin"}
    assert len({n[:4] for n in others}) > 4
    assert_bit_exact(tc.restore(url), mixed_state())
    tc.save(tmp_path / "local", mixed_state(), options=SEVERAL_FILES)
    assert "d00000-00000.safetensors" in os.listdir(tmp_path / "local")


def copy_to(source: str, url: str) -> None:
    """Writes every file of a local checkpoint, under its own name, into ``url``."""
    with storage.Store(storage.location(url)) as store:
        for name in os.listdir(source):
            with open(os.path.join(source, name), "rb") as f:
                store.write(name, [f.read()]).result()


@pytest.mark.emulator
def test_a_checkpoint_with_the_old_names_restores_from_an_object_store(tmp_path, bucket: Bucket):
    """What saves wrote into object stores before names carried a token: dPPPPP-NNNNN.safetensors,
    pieces-NNNNN.bin (a local save still writes those)."""
    tc.save(tmp_path / "old", mixed_state(), options=SEVERAL_FILES)
    copy_to(str(tmp_path / "old"), bucket.url("old"))
    assert "old/d00000-00000.safetensors" in bucket.keys() and "old/pieces-00000.bin" in bucket.keys()
    assert_bit_exact(tc.restore(bucket.url("old")), mixed_state())


def test_a_plain_write_of_the_manifest_name_replaces_it_and_only_create_refuses():
    with storage.Store(storage.location("memory://token_names/plain")) as store:
        store.write("manifest.json", [b"first"]).result()
        store.write("manifest.json", [b"second"]).result()  # a plain write: no commit here
        assert store.read_file("manifest.json") == b"second"
        with pytest.raises(tc.CheckpointExistsError, match="another save committed"):
            store.create("manifest.json", b"third")
        assert store.read_file("manifest.json") == b"second"


class SaveBeforeCommit(tc.MaxShardSizePolicy):
    """Runs ``other`` (another whole save of the same checkpoint) at the first read of
    ``description`` once this save's data files are in ``url``: after its writes, before its
    commit (see tests/saving/test_save_integrity.py)."""

    def __init__(self, url: str, other):
        super().__init__(4096)
        self._url, self._other, self.acted = url, other, False

    @property
    def description(self) -> str:
        if not self.acted and any(n.endswith(".safetensors") for n in listed(self._url)):
            self.acted = True
            thread = threading.Thread(target=self._other)  # a save of its own: not inside this one
            thread.start()
            thread.join()
        return super().description


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_the_loser_of_two_saves_removes_only_its_own_objects(where, request):
    url = (
        "memory://token_names/race" if where == "memory"
        else Bucket(request.getfixturevalue("s3_server"), "race-" + os.urandom(4).hex()).url("c")
    )
    winner: set[str] = set()

    def other() -> None:
        before = set(listed(url))  # the loser's data files, and its staging marker
        tc.save(url, mixed_state(7), options=SEVERAL_FILES)
        winner.update(set(listed(url)) - before)

    with pytest.raises(tc.CheckpointExistsError, match="another save committed") as lost:
        tc.save(url, mixed_state(), options=tc.CheckpointOptions(sharding_callback=SaveBeforeCommit(url, other)))
    assert lost.value.file == f"{url}/manifest.json"
    left = listed(url)
    assert left == sorted(winner)  # the winner's objects, every one; none of the loser's
    assert len({token_of(n) for n in left if n != "manifest.json"}) == 1
    assert_bit_exact(tc.restore(url), mixed_state(7))


@pytest.mark.emulator
def test_two_saves_started_together_on_s3_commit_once_and_the_loser_deletes_nothing_of_the_winner(faulty):
    proxy, bucket = faulty
    if bucket.scheme == "gs":
        pytest.skip("gcp-storage-emulator ignores ifGenerationMatch (tests/storage/test_object_retries.py)")
    proxy.delay_s = 0.02  # both saves find the path free before either commits
    start, outcomes = threading.Barrier(2), {}

    def save(seed: int) -> None:
        start.wait()
        try:
            tc.save(bucket.url("c"), mixed_state(seed), options=SEVERAL_FILES)
            outcomes[seed] = "committed"
        except tc.CheckpointError as error:
            outcomes[seed] = error

    threads = [threading.Thread(target=save, args=(seed,)) for seed in (23, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    proxy.delay_s = 0.0
    (won,) = [seed for seed, outcome in outcomes.items() if outcome == "committed"]
    (lost,) = [outcome for outcome in outcomes.values() if outcome != "committed"]
    assert isinstance(lost, tc.CheckpointExistsError) and "another save committed" in str(lost), lost
    assert_bit_exact(tc.restore(bucket.url("c")), mixed_state(won))
    left = [n for n in bucket.keys("c/") if n != "c/manifest.json"]
    (token,) = {token_of(n.split("/")[-1]) for n in left}
    deleted = [r.path for r in proxy.requests if r.method == "DELETE"]
    # Of the winner's objects only its own staging marker is deleted: by its commit.
    own_marker = marker_name(token, local=False)
    assert token is not None and deleted and {p.rsplit("/", 1)[-1] for p in deleted if token in p} == {own_marker}
