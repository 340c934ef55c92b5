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
    assert users == {"object_store.py"}


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
