"""A sharding callback that can arrange a save's pieces without ``ShardableTensor``s says so
through ``arrangement``: the save asks the callback, not a list of types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import tpu_ckpt as tc


def _tree() -> dict[str, Any]:
    sharding = NamedSharding(jax.make_mesh((8,), ("x",)), PartitionSpec("x"))
    return {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), sharding), "step": 3}


def _data_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors"))


class _Halves(tc.ShardingCallback):
    """Two data files, told from the bare pieces: never called with ShardableTensors."""

    @property
    def description(self) -> str:
        return "halves"

    def __call__(self, shardable_tensors: Sequence[tc.ShardableTensor]) -> list:
        raise AssertionError("a callback with an arrangement is not called")

    def arrangement(self, pieces: Sequence[Any], devices: Sequence[Any]) -> list[list[Any]]:
        half = (len(pieces) + 1) // 2
        return [list(pieces[:half]), list(pieces[half:])]


def test_a_callback_with_an_arrangement_is_asked_for_it_not_called(tmp_path):
    tc.save(tmp_path / "c", _tree(), options=tc.CheckpointOptions(sharding_callback=_Halves()))
    assert len(_data_files(tmp_path / "c")) == 2
    restored = tc.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(64, dtype=np.float32).reshape(8, 8))
    assert restored["step"] == 3


class _OneFile(tc.ShardByDevicePolicy):
    """A built-in policy's subclass that cuts differently: its ``__call__`` decides."""

    def __call__(self, shardable_tensors: Sequence[tc.ShardableTensor]) -> list:
        return tc.ShardByTaskPolicy()(shardable_tensors)


def test_a_subclass_of_a_built_in_policy_is_called_and_its_shards_used(tmp_path):
    tc.save(tmp_path / "by_device", _tree())
    tc.save(tmp_path / "one", _tree(), options=tc.CheckpointOptions(sharding_callback=_OneFile()))
    assert len(_data_files(tmp_path / "by_device")) == 8  # one per device: the built-in's arrangement
    assert len(_data_files(tmp_path / "one")) == 1
    np.testing.assert_array_equal(
        np.asarray(tc.restore(tmp_path / "one")["w"]), np.arange(64, dtype=np.float32).reshape(8, 8)
    )
