"""What `pip install tpu_ckpt` pulls in, and what `import tpu_ckpt` costs.

The core install declares exactly the third-party packages the library imports; Flax,
which it never imports, is the ``flax`` extra. Importing the package imports no public
module until one of its names is used, so the command line starts without JAX.
"""

import ast
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import tpu_ckpt as tc

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;@]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def third_party_imports() -> set[str]:
    """The top-level packages that tpu_ckpt/*.py import, the standard library left out."""
    names = set()
    for path in (ROOT / "tpu_ckpt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"tpu_ckpt"}


# Orbax (and etils, its path type) is the ``orbax`` extra, imported inside orbax_interop.py's
# functions only (tests/test_orbax_interop.py checks where).
OPTIONAL_IMPORTS = {"orbax", "etils"}


def test_the_core_requires_what_the_package_imports_and_nothing_else():
    assert {_name(r) for r in PYPROJECT["dependencies"]} == third_party_imports() - OPTIONAL_IMPORTS
    assert [_name(r) for r in PYPROJECT["optional-dependencies"]["orbax"]] == ["orbax_checkpoint"]


def test_flax_is_an_extra_that_the_tests_and_the_benchmark_install():
    extras = PYPROJECT["optional-dependencies"]
    assert [_name(r) for r in extras["flax"]] == ["flax"]
    assert "tpu_ckpt[flax]" in extras["test"] and "tpu_ckpt[flax]" in extras["bench"]


def test_the_declared_minimums_are_installed_here():
    """The minimums are the tested versions: this environment must satisfy them."""
    from importlib.metadata import version

    for requirement in [*PYPROJECT["dependencies"], *PYPROJECT["optional-dependencies"]["flax"]]:
        name, minimum = re.fullmatch(r"([\w-]+)>=([\d.]+)", requirement).groups()
        installed = tuple(int(p) for p in re.findall(r"\d+", version(name))[:3])
        assert installed >= tuple(int(p) for p in minimum.split(".")), requirement


def test_every_public_name_is_the_object_of_its_module():
    for name in tc.__all__:
        module = tc._MODULE_OF[name]
        assert getattr(tc, name) is getattr(sys.modules[f"tpu_ckpt.{module}"], name), name
    assert set(tc._MODULE_OF) == set(tc.__all__) and set(tc.__all__) <= set(dir(tc))
    assert callable(tc.save) and callable(tc.restore)  # not hidden by the submodules save.py and restore.py
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tc.nope  # noqa: B018


@pytest.mark.slow
def test_importing_the_package_imports_neither_jax_nor_tensorstore():
    code = "import json, sys, tpu_ckpt; print(json.dumps(['jax' in sys.modules, 'tensorstore' in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert json.loads(out.stdout) == [False, False], out.stderr
