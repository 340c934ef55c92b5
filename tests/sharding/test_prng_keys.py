"""A typed PRNG key cannot be saved as it is; the error says how to save one, and that works."""

import jax
import numpy as np
import pytest

import tpu_ckpt as tc


def test_a_typed_prng_key_is_refused_with_the_fix_that_works():
    key = jax.random.key(42)
    with pytest.raises(TypeError, match=r"'rng' is a typed PRNG key .*jax\.random\.key_data\(key\).*jax\.random\.wrap_key_data"):
        tc.save("memory://tests/typed-key", {"rng": key})
    tc.save("memory://tests/key-data", {"rng": jax.random.key_data(key)}).wait()
    back = jax.random.wrap_key_data(tc.restore("memory://tests/key-data")["rng"])
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))
