"""CheckpointOptions: TF spellings, the async alias, validation, immutability."""

import copy
import inspect
import pickle
import warnings

import jax
import numpy as np
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
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
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
    calls = []
    tc.save(
        tmp_path / "c", {"a": np.ones(1)}, options=tc.CheckpointOptions(write_callbacks=[lambda **k: calls.append(k)])
    )
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
    for bad in (0, -5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="coordination_timeout"):
            tc.CheckpointOptions(coordination_timeout=bad)
    for bad in ("10", True, None):
        with pytest.raises(TypeError, match="coordination_timeout"):
            tc.CheckpointOptions(coordination_timeout=bad)
    assert tc.CheckpointOptions(coordination_timeout=np.float32(2.5)).coordination_timeout == 2.5


def test_positional_order_follows_the_design():
    policy = tc.ShardByTaskPolicy()
    o = tc.CheckpointOptions(2, True, [_zero], True, policy, 5.0)
    assert (
        o.io_device, o.enable_async, o.write_callbacks, o.skip_slot_variables, o.sharding_callback,
        o.coordination_timeout,
    ) == (2, True, (_zero,), True, policy, 5.0)


_FLAGS = [
    "enable_async", "skip_slot_variables", "load_and_broadcast",
    "experimental_skip_slot_variables", "experimental_enable_async_checkpoint",
]


@pytest.mark.parametrize("flag", _FLAGS)
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, [True]])
def test_flags_must_be_bools(flag, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=f"CheckpointOptions {flag} must be True or False"):
            tc.CheckpointOptions(**{flag: value})


@pytest.mark.parametrize("flag", ["enable_async", "skip_slot_variables", "load_and_broadcast"])
def test_numpy_bools_are_flags(flag):
    o = tc.CheckpointOptions(**{flag: np.bool_(True)})
    assert getattr(o, flag) is True


def test_explicit_default_and_tf_spelling_still_conflict():
    with pytest.raises(ValueError, match="both io_device=None and experimental_io_device=2"):
        tc.CheckpointOptions(io_device=None, experimental_io_device=2)
    with pytest.raises(ValueError, match="both skip_slot_variables=False and experimental_skip_slot_variables=True"):
        tc.CheckpointOptions(skip_slot_variables=False, experimental_skip_slot_variables=True)


def test_signature_shows_readable_defaults():
    shown = str(inspect.signature(tc.CheckpointOptions))
    assert "object at 0x" not in shown
    for default in ("io_device: 'int | jax.Device | str | None' = None", "enable_async: 'bool' = False",
                    "skip_slot_variables: 'bool' = False", "experimental_enable_async_checkpoint: 'bool' = False"):
        assert default in shown


def test_load_and_broadcast_with_io_device_is_refused():
    with pytest.raises(ValueError, match="load_and_broadcast=True with io_device=1.*already reads every piece once"):
        tc.CheckpointOptions(io_device="/job:worker/task:1", load_and_broadcast=True)
    with pytest.raises(ValueError, match="load_and_broadcast"):
        tc.CheckpointOptions(io_device=0).replace(load_and_broadcast=True)
    assert tc.CheckpointOptions(io_device=0, load_and_broadcast=False).io_device == 0


def _built():
    return tc.CheckpointOptions(
        io_device=1, enable_async=True, write_callbacks=[_zero, _one], skip_slot_variables=True,
        sharding_callback=tc.MaxShardSizePolicy(1 << 20), coordination_timeout=12.5,
    )


def test_equality_compares_every_field():
    assert tc.CheckpointOptions() == tc.CheckpointOptions()
    assert _built() == _built() and hash(_built()) == hash(_built())
    assert _built() != _built().replace(coordination_timeout=13)
    assert _built() != _built().replace(sharding_callback=tc.MaxShardSizePolicy(1 << 21))
    assert _built() != _built().replace(sharding_callback=tc.ShardByDevicePolicy())
    assert _built() != _built().replace(write_callbacks=[_zero])
    assert tc.CheckpointOptions(load_and_broadcast=True) != tc.CheckpointOptions()
    assert tc.CheckpointOptions() != "CheckpointOptions()"
    assert len({tc.CheckpointOptions(), tc.CheckpointOptions(), _built()}) == 2


def test_unhashable_callbacks_make_unhashable_options():
    class Recorder(list):
        def __call__(self):
            self.append(1)

    o = tc.CheckpointOptions(write_callbacks=[Recorder()])
    assert o == o
    with pytest.raises(TypeError, match="unhashable"):
        hash(o)


@pytest.mark.parametrize(
    "duplicate", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["copy", "deepcopy", "pickle"]
)
def test_copies_and_pickles_round_trip(duplicate):
    for original in (tc.CheckpointOptions(), _built()):
        again = duplicate(original)
        assert again == original and again.write_callbacks == original.write_callbacks
        with pytest.raises(AttributeError, match="immutable"):
            again.enable_async = False
