"""The supported version range is the tested one.

``constraints-oldest.txt`` pins the oldest versions; ``make test-compat`` (which ``make test``
runs) installs exactly those into a second virtualenv and runs the fast tier there. So
``pyproject.toml``'s minimums must be those pins, and the README must state the same range,
or a minimum would claim support nobody tested.
"""

import os
import pathlib
import re
import subprocess
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FAST_TIER = "not slow and not multiprocess and not emulator and not notebook and not heavy"


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints-oldest.txt").read_text().splitlines()
    pairs = (line.split("==") for line in lines if line.strip() and not line.startswith("#"))
    return {name.strip().lower().replace("-", "_"): version.strip() for name, version in pairs}


def _minimums() -> dict[str, str]:
    """Each third-party requirement's ``>=`` minimum: the core, the extras, and optax (tests)."""
    extras = PROJECT["optional-dependencies"]
    requirements = [*PROJECT["dependencies"], *extras["flax"], *extras["orbax"], *extras["test"]]
    found = (re.fullmatch(r"([\w-]+)>=([\w.]+)", r) for r in requirements)
    return {m[1].lower().replace("-", "_"): m[2] for m in found if m}


def test_the_minimums_are_the_pinned_oldest_versions():
    pins, minimums = _pins(), _minimums()
    libraries = {"jax", "tensorstore", "numpy", "ml_dtypes", "crc32c", "flax", "orbax_checkpoint", "optax"}
    assert set(pins) == libraries | {"jaxlib"}  # jax requires its own jaxlib exactly
    assert {name: minimums[name] for name in libraries} == {name: pins[name] for name in libraries}
    assert pins["jaxlib"] == pins["jax"]


def test_the_readme_states_the_tested_range():
    line = next(p for p in (ROOT / "README.md").read_text().split("\n\n") if p.startswith("Supported versions:"))
    text = " ".join(line.split())
    shown = {"jax": "jax/jaxlib", "jaxlib": "jax/jaxlib", "orbax_checkpoint": "orbax-checkpoint"}
    for name, version in _pins().items():
        assert f"{shown.get(name, name)} {version}+" in text, name
    assert "make test-compat" in text and "constraints-oldest.txt" in text


def test_make_test_runs_the_fast_tier_with_the_pins():
    """``make -n -B`` prints every command ``make test`` would run, without running one (the
    flags of a ``make`` that runs this suite are left out: they would carry its jobserver)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    commands = out.stdout.splitlines()
    install = next(c for c in commands if "pip install" in c and "-c constraints-oldest.txt" in c)
    assert install.startswith(".venv-compat/bin/python ") and '".[test]"' in install
    compat_tier = f'.venv-compat/bin/python -m pytest -q -m "{FAST_TIER}"'
    assert compat_tier in commands  # after the main suite, which runs first
    main_suite = next(i for i, c in enumerate(commands) if c.startswith(".venv/bin/python -m pytest -q"))
    assert commands.index(compat_tier) > main_suite
