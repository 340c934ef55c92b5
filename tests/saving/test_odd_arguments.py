"""What a new user gets wrong first, from an adversarial pass: each a typed error naming what to
fix, before anything is written, or the call working as asked."""

from __future__ import annotations

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage


def test_options_that_are_not_checkpoint_options_are_a_type_error(tmp_path):
    tc.save(tmp_path / "c", {"x": np.ones(2)}).wait()
    with pytest.raises(TypeError, match=r"save\(options=...\) takes a tpu_ckpt.CheckpointOptions or None, not a dict"):
        tc.save(tmp_path / "d", {"x": np.ones(2)}, options={"enable_async": True})
    with pytest.raises(TypeError, match=r"restore\(options=...\) takes .* not a str"):
        tc.restore(tmp_path / "c", options="async")
    assert not (tmp_path / "d").exists()


class _Returns(tc.ShardingCallback):
    def __init__(self, result):
        self.result = result

    @property
    def description(self) -> str:
        return f"returns {type(self.result).__name__}"

    def __call__(self, shardable_tensors):
        return self.result


@pytest.mark.parametrize(("result", "found"), [(None, "NoneType"), ({"x": {}}, "dict")])
def test_a_sharding_callback_that_returns_no_list_is_an_invalid_shards_error(tmp_path, result, found):
    options = tc.CheckpointOptions(sharding_callback=_Returns(result))
    with pytest.raises(tc.InvalidShardsError, match=f"expected a list of shards, got {found}"):
        tc.save(tmp_path / "c", {"x": np.ones(2)}, options=options)
    assert not (tmp_path / "c").exists()


def test_saving_onto_a_file_is_refused_before_writing(tmp_path):
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(tc.CheckpointExistsError, match="already exists"):
        tc.save(tmp_path / "taken", {"x": np.ones(2)})
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging directory left


def test_a_write_callback_may_save_again(tmp_path):
    """A callback copying the committed checkpoint elsewhere: it runs on the save's own thread,
    which a second save must not wait for."""
    copy = tmp_path / "copy"
    options = tc.CheckpointOptions(enable_async=True, write_callbacks=[lambda path: tc.save(copy, tc.restore(path))])
    tc.save(tmp_path / "c", {"x": np.arange(3)}, options=options).wait()
    assert np.array_equal(tc.restore(copy)["x"], np.arange(3))


def test_a_directory_of_other_files_is_no_checkpoint_not_an_interrupted_save(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(tc.CheckpointNotFoundError, match=r"No checkpoint at .*notes.txt.*none a save's") as error:
        tc.restore(tmp_path)
    assert not isinstance(error.value, tc.UncommittedCheckpointError)
    (tmp_path / "d00000-00000.safetensors").write_bytes(b"half")  # what an interrupted save leaves
    with pytest.raises(tc.UncommittedCheckpointError):
        tc.restore(tmp_path)


@pytest.mark.parametrize("url", ["s3://b/a/../c", "s3://b/x//y", "gs://b/c/./d", "s3://", "gs:///x"])
def test_an_object_store_url_with_odd_segments_or_no_bucket_is_refused(url):
    """``a/../c`` would write under another prefix than the one given, which the save then
    cannot find or remove; no bucket would retry for the whole retry budget."""
    with pytest.raises(ValueError, match="names no bucket|has a path segment"):
        storage.location(url)
    assert storage.location("s3://b/ok/path/").url == "s3://b/ok/path/"
