"""CheckpointOptions: TF spellings, the async alias, validation, immutability."""

import warnings

import jax
import pytest

import tpu_ckpt as tc


def test_defaults():
    o = tc.CheckpointOptions()
    assert o.io_device is None and o.enable_async is False and o.write_callbacks == ()
    assert o.skip_slot_variables is False and o.coordination_timeout == 300.0
    assert isinstance(o.sharding_callback, tc.ShardByDevicePolicy)


def test_tf_spellings_are_keywords_and_attributes():
    policy = tc.MaxShardSizePolicy(100)
    cb = lambda: None  # noqa: E731
    o = tc.CheckpointOptions(
        experimental_io_device="/job:worker/task:3", experimental_write_callbacks=[cb],
        experimental_skip_slot_variables=True, experimental_sharding_callback=policy,
    )
    assert o.io_device == o.experimental_io_device == 3
    assert o.write_callbacks == o.experimental_write_callbacks == (cb,)
    assert o.skip_slot_variables is o.experimental_skip_slot_variables is True
    assert o.sharding_callback is o.experimental_sharding_callback is policy


def test_conflicting_spellings_are_an_error_not_a_precedence_rule():
    with pytest.raises(ValueError, match="both io_device=1 and experimental_io_device=2"):
        tc.CheckpointOptions(io_device=1, experimental_io_device=2)
    assert tc.CheckpointOptions(io_device=1, experimental_io_device=1).io_device == 1


@pytest.mark.parametrize(
    ("deprecated", "new", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True), (None, 0, False)],
)
def test_deprecated_async_alias_warns_and_ors(deprecated, new, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = tc.CheckpointOptions(enable_async=new, experimental_enable_async_checkpoint=deprecated)
    assert o.enable_async is expected and o.experimental_enable_async_checkpoint is expected
    assert any(issubclass(w.category, DeprecationWarning) and "enable_async" in str(w.message) for w in caught)


def test_no_warning_without_the_deprecated_flag():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc.CheckpointOptions(enable_async=True).enable_async is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None), (0, 0), (5, 5), ("/job:localhost", 0), ("/job:localhost/replica:0/task:0/device:CPU:0", 0),
        ("/job:worker/task:3", 3), ("/job:worker/task:3/device:CPU:0", 3), ("/job:worker/replica:0/task:12", 12),
    ],
)
def test_io_device_forms(value, expected):
    assert tc.CheckpointOptions(io_device=value).io_device == expected


def test_io_device_from_a_jax_device():
    assert tc.CheckpointOptions(io_device=jax.devices()[3]).io_device == jax.devices()[3].process_index


@pytest.mark.parametrize("value", ["/cpu:0", "gpu", "/job:ps/task:1", -1, True, 1.5, object()])
def test_bad_io_device_is_a_value_error(value):
    with pytest.raises(ValueError, match="io_device"):
        tc.CheckpointOptions(io_device=value)


def test_sharding_callback_must_be_an_instance():
    with pytest.raises(ValueError, match="instance of tpu_ckpt.ShardingCallback.*function"):
        tc.CheckpointOptions(sharding_callback=lambda pieces: pieces)
    with pytest.raises(ValueError, match="ABCMeta"):
        tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy)


def test_max_shard_size_must_be_positive():
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_shard_size"):
            tc.MaxShardSizePolicy(bad)


def _zero():
    pass


def _one(path):
    pass


def _var(*args):
    pass


def _kw(**kwargs):
    pass


def _two(a, b):
    pass


def _one_with_default(a, b=1):
    pass


class _Holder:
    def method(self, path):
        pass


def test_write_callback_arity():
    ok = [_zero, _one, _var, _kw, _one_with_default, _Holder().method, lambda: 1, lambda p: p, print]
    assert tc.CheckpointOptions(write_callbacks=ok).write_callbacks == tuple(ok)
    with pytest.raises(ValueError, match="'_two' requires 2 positional arguments"):
        tc.CheckpointOptions(write_callbacks=[_two])
    with pytest.raises(TypeError, match="not callable"):
        tc.CheckpointOptions(write_callbacks=["nope"])
    with pytest.raises(TypeError, match="sequence of callables"):
        tc.CheckpointOptions(write_callbacks=_one)


def test_kwargs_only_callback_is_called_without_the_path(tmp_path):
    import numpy as np

    calls = []
    tc.save(tmp_path / "c", {"a": np.ones(1)}, options=tc.CheckpointOptions(write_callbacks=[lambda **k: calls.append(k)]))
    assert calls == [{}]  # TF would pass the path positionally and crash


def test_callbacks_are_copied_not_aliased():
    callbacks = [_zero]
    o = tc.CheckpointOptions(write_callbacks=callbacks)
    callbacks.append(_one)
    assert o.write_callbacks == (_zero,)


def test_options_are_immutable():
    o = tc.CheckpointOptions()
    with pytest.raises(AttributeError, match="immutable"):
        o.enable_async = True
    with pytest.raises(AttributeError, match="no attribute 'bogus'"):
        o.bogus  # noqa: B018


def test_bad_coordination_timeout():
    for bad in (0, -5, "10", True):
        with pytest.raises(ValueError, match="coordination_timeout"):
            tc.CheckpointOptions(coordination_timeout=bad)


def test_positional_order_follows_the_design():
    policy = tc.ShardByTaskPolicy()
    o = tc.CheckpointOptions(2, True, [_zero], True, policy, 5.0)
    assert (o.io_device, o.enable_async, o.write_callbacks, o.skip_slot_variables, o.sharding_callback, o.coordination_timeout) == (
        2, True, (_zero,), True, policy, 5.0
    )
