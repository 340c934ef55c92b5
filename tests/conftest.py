"""Test set-up: 8 simulated CPU devices, configured before anything imports jax."""

import dataclasses
import inspect
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

pytest_plugins = ("tests.support.object_stores",)  # the gcs_server, s3_server and bucket fixtures

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


def pytest_ignore_collect(collection_path, config):
    """A run that leaves ``heavy`` out (``make test-fast``, ``make test-compat``) does not even
    import the heavy modules: collecting them imports Orbax, Flax and optax (seconds), and the
    compatibility virtualenv does not install those."""
    expression = config.getoption("markexpr", "") or ""
    if "not heavy" in expression and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return _is_heavy(collection_path) or None
    return None


# Tests that must not run beside one of their kind (pytest-xdist, `make test`): each group runs
# on one worker, one test at a time, while the other workers take the rest. Multi-process tests
# start several JAX processes each (two at once on 2 cores starve each other's coordination);
# emulator tests then start their emulators (session fixtures) on that one worker only.
_EMULATOR_FIXTURES = {"gcs_server", "s3_server", "bucket"}
_STARTS_PROCESSES = ("process_group.run", "run_script(")


def _group(item) -> str | None:
    starts_processes = item.path.parent.name == "multiprocess" or item.get_closest_marker("multiprocess")
    if starts_processes or any(call in _source(item) for call in _STARTS_PROCESSES):
        return "processes"
    if item.get_closest_marker("emulator") or _uses_an_emulator(item):
        return "emulators"
    return None


def _uses_an_emulator(item) -> bool:
    """Whether the test takes an emulator fixture, directly, through another fixture, or by
    name (``request.getfixturevalue("s3_server")``): it is an ``emulator`` test, marked or not."""
    source = _source(item)
    return bool(_EMULATOR_FIXTURES & set(getattr(item, "fixturenames", ()))) or any(
        f'"{name}"' in source for name in _EMULATOR_FIXTURES
    )


def _source(item) -> str:
    try:
        return inspect.getsource(item.function)
    except (AttributeError, OSError, TypeError):
        return ""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    heavy: dict = {}
    for item in items:
        if heavy.setdefault(item.path, _is_heavy(item.path)):
            item.add_marker(pytest.mark.heavy)
        if _uses_an_emulator(item):
            item.add_marker(pytest.mark.emulator)  # so the fast tier, which has no emulators, leaves it out
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
