"""Faces as contracts: a package's face (its ``__init__.py``) lists what other packages use of it,
nothing more, one name a line, so a diff of a face is a change of the contract.

A name only tests or benchmarks use stays in its private module: tests import it from there,
from their package's own folder (``tests/<package>/``, see test_layering.py).
"""

import ast
import collections
import pathlib

from tests.project.test_layering import PACKAGE, library_files, unit_of

FACES = {path.parent.name: path for path in sorted(PACKAGE.glob("*/__init__.py"))}


def _listed(face: pathlib.Path) -> list[ast.Constant]:
    """The entries of ``face``'s ``__all__``."""
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]:
            assert isinstance(node.value, ast.List), f"{face}: __all__ is a list"
            return [e for e in node.value.elts if isinstance(e, ast.Constant)]
    raise AssertionError(f"{face} has no __all__")


def _names_used(path: pathlib.Path) -> set[tuple[str, str]]:
    """(package, name) for every name ``path`` takes from a package's face: ``from tpu_ckpt.p
    import name``, or ``from tpu_ckpt import p`` and then ``p.name``."""
    tree = ast.parse(path.read_text())
    aliases, used = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tpu_ckpt":
            aliases.update({a.asname or a.name: a.name for a in node.names if a.name in FACES})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in {f"tpu_ckpt.{p}" for p in FACES}:
            used.update((node.module.split(".")[1], a.name) for a in node.names if not a.name.startswith("_"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add((aliases[node.value.id], node.attr))
    return used


def _imported_by_others() -> dict[str, set[str]]:
    """Per package, the names of its face other library units import (tpu_ckpt/__init__.py too)."""
    found = collections.defaultdict(set)
    for path in library_files():
        me = unit_of(path)
        for package, name in _names_used(path):
            if package != me:
                found[package].add(name)
    return found


def test_a_face_exports_exactly_what_other_packages_import():
    others = _imported_by_others()
    wrong = []
    for package, face in FACES.items():
        listed = {e.value for e in _listed(face)}
        wrong += [f"{package}.{name}: no other package imports it" for name in sorted(listed - others[package])]
        wrong += [f"{package}.{name}: imported, not in __all__" for name in sorted(others[package] - listed)]
    assert not wrong, "a name only tests use is imported from its private module, by tests/<package>/: " + str(wrong)


def test_a_face_is_imports_and_all_one_name_a_line():
    wrong = []
    for package, face in FACES.items():
        tree = ast.parse(face.read_text())
        body = tree.body[1:] if ast.get_docstring(tree) else tree.body
        wrong += [
            f"{package}:{n.lineno} is neither an import nor __all__"
            for n in body if not isinstance(n, (ast.ImportFrom, ast.Assign))
        ]
        lines = [a.lineno for n in body if isinstance(n, ast.ImportFrom) for a in n.names]
        lines += [e.lineno for e in _listed(face)]
        wrong += [
            f"{package}:{line} holds more than one name"
            for line, count in collections.Counter(lines).items() if count > 1
        ]
        assignments = [n for n in body if isinstance(n, ast.Assign)]
        wrong += [
            f"{package}:{n.lineno} starts __all__ with a name on its line"
            for n in assignments if any(e.lineno == n.lineno for e in _listed(face))
        ]
    assert not wrong, wrong
