"""The package's shape: one gateway per external system, one public door."""

import ast
import pathlib

import tpu_ckpt as tc

PACKAGE = pathlib.Path(tc.__file__).parent


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_object_store_backend_imports_tensorstore():
    users = {p.name for p in PACKAGE.glob("*.py") if any(m.startswith("tensorstore") for m in imported_modules(p))}
    assert users == {"object_store.py", "orbax_checks.py"}  # the latter reads Orbax's OCDBT as Orbax does


def test_only_distributed_touches_the_coordination_client():
    users = {p.name for p in PACKAGE.glob("*.py") if "global_state" in p.read_text()}
    assert users == {"distributed.py"}


def test_save_and_restore_do_not_import_each_other():
    assert "tpu_ckpt.restore" not in imported_modules(PACKAGE / "save.py")
    assert "tpu_ckpt.save" not in imported_modules(PACKAGE / "restore.py")


def test_public_names_are_exported_from_the_package_only():
    for name in tc.__all__:
        assert getattr(tc, name) is not None
    assert (PACKAGE / "py.typed").exists()
    for path in PACKAGE.glob("*.py"):
        if path.name != "__init__.py":
            assert "__all__" not in path.read_text(), path


def test_library_code_never_prints():
    """The library logs; only the command line (cli*.py) talks to the user."""
    for path in PACKAGE.glob("*.py"):
        if path.name.startswith("cli"):
            continue
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
        assert not calls, path


MAX_MODULE_LINES = 360
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_readable_in_one_sitting():
    """Each module one stage, short enough to read at once; complexity is ruff's C901 (<= 10)."""
    too_long = []
    for path in PACKAGE.glob("*.py"):
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
                too_long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


def test_ruff_is_clean():
    """`make lint` in the suite, so its rules (complexity <= 10 among them) hold in CI too."""
    import os
    import subprocess
    import sys

    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    root = PACKAGE.parent
    result = subprocess.run([ruff, "check", "tpu_ckpt", "tests", "scripts"], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
