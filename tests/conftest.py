"""Test set-up: 8 simulated CPU devices, configured before anything imports jax."""

import dataclasses
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

pytest_plugins = ("tests.object_stores",)  # the gcs_server, s3_server and bucket fixtures

# 64-bit dtypes must survive a round trip through real jax.Arrays too.
jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="session")
def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"))


@pytest.fixture(scope="session")
def mesh24():
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture
def knobs():
    """``knobs(**fields)`` changes this process's settings for one test; they come back after."""
    from tpu_ckpt.settings import configure, settings

    previous = configure(None)
    yield lambda **fields: configure(dataclasses.replace(settings(), **fields))
    configure(previous)


_HEAVY_IMPORTS = ("subprocess", "orbax", "flax", "optax")
_HEAVY_DIRECTORIES = ("docs", "interop")


def _is_heavy(path) -> bool:
    """Whether a test module starts processes or imports Orbax, Flax or optax (seconds each):
    the ``heavy`` marker, which ``make test-fast`` leaves out."""
    if path.parent.name in _HEAVY_DIRECTORIES:
        return True
    text = path.read_text()
    return any(f"import {name}" in text or f"from {name}" in text for name in _HEAVY_IMPORTS)


def pytest_collection_modifyitems(items):
    heavy: dict = {}
    for item in items:
        if heavy.setdefault(item.path, _is_heavy(item.path)):
            item.add_marker(pytest.mark.heavy)
