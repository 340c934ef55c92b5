"""The supported version range is the tested one.

``constraints-oldest.txt`` pins the oldest versions; ``make test-compat`` (which ``make test``
runs) installs exactly those into a second virtualenv and runs the fast tier there. So
``pyproject.toml``'s minimums must be those pins, and the README must state the same range,
or a minimum would claim support nobody tested.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

from tests.conftest import _is_heavy

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
    assert install.startswith(".venv-compat/bin/python ") and '".[test-fast]"' in install
    compat_tier = f'.venv-compat/bin/python -m pytest -q -m "{FAST_TIER}" -n 2'
    assert compat_tier in commands  # after the main suite, which runs first
    main_suite = next(i for i, c in enumerate(commands) if c.startswith(".venv/bin/python -m pytest -q"))
    assert commands.index(compat_tier) > main_suite


def _make_commands(*argv: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "-B", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_demo_and_the_wheel_install_only_what_they_need():
    """A newcomer's `make demo` installs the library and Flax, not the tests' moto, mypy and
    mkdocs (minutes); `make wheel` needs pip alone. `make test` still installs everything."""
    demo = [c for c in _make_commands("demo") if "pip install" in c and "--upgrade pip" not in c]
    assert demo == ['.venv/bin/python -m pip install --quiet -e ".[flax]"']
    assert not [c for c in _make_commands("wheel") if "pip install" in c and "--upgrade pip" not in c]
    suite = '.venv/bin/python -m pip install --quiet -e ".[test,bench,docs]" -c constraints-test.txt'
    assert suite in _make_commands("test")


def test_the_fast_tier_installs_what_its_modules_import():
    """The compatibility virtualenv holds `.[test-fast]` alone: every module the fast tier
    collects (tests/conftest.py leaves the heavy ones uncollected), and every tests module they
    import, imports only the standard library, pytest, the library and its core dependencies."""
    extras = PROJECT["optional-dependencies"]
    assert {re.match(r"[\w-]+", r)[0] for r in extras["test-fast"]} == {
        "pytest", "pytest-timeout", "pytest-xdist", "safetensors"
    }
    assert "tpu_ckpt[test-fast]" in extras["test"]
    allowed = set(sys.stdlib_module_names) | {
        "pytest", "safetensors", "tpu_ckpt", "jax", "numpy", "ml_dtypes", "tensorstore", "crc32c"
    }
    todo = [p for p in (ROOT / "tests").rglob("test_*.py") if not _is_heavy(p)]
    # their fixtures run on use only
    plugins = {ROOT / "tests" / "conftest.py", ROOT / "tests" / "support" / "object_stores.py"}
    todo += plugins
    seen: set[pathlib.Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path, everywhere=path not in plugins):
            local = ROOT.joinpath(*name.split(".")).with_suffix(".py")
            if name.split(".")[0] == "tests":
                todo += [local] if local.exists() else []
            else:
                assert name.split(".")[0] in allowed, f"{path.relative_to(ROOT)} imports {name}"
    test = '.venv/bin/python -m pytest -q --durations=25 -n 2 --dist loadgroup'
    assert test in _make_commands("test") and "-n 0" in " ".join(_make_commands("test", "WORKERS=0"))


def _imports(path: pathlib.Path, everywhere: bool) -> list[str]:
    """The modules ``path`` imports at its top level, and inside its functions if ``everywhere``."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names if node.module == "tests"]
    return found
