"""docs/architecture.md names every private module of the library: a new module is placed on
the map (its package's row of "What each package owns") when it is written."""

import pathlib

import tpu_ckpt as tc

PACKAGE = pathlib.Path(tc.__file__).parent
PAGE = PACKAGE.parent / "docs" / "architecture.md"


def _unnamed() -> list[str]:
    text = PAGE.read_text()
    rows = {line.split("|")[1].strip(" `/"): line for line in text.splitlines() if line.startswith("| `")}
    unnamed = []
    for path in sorted(PACKAGE.rglob("_*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        package = path.parent.relative_to(PACKAGE).as_posix()
        in_row = f"`{path.stem}`" in rows.get(package, "")
        if not in_row and f"{package}/{path.name}" not in text:
            unnamed.append(f"{package}/{path.name}")
    return unnamed


def test_every_private_module_is_named_in_the_architecture_page():
    assert _unnamed() == [], "name each in its package's row of docs/architecture.md, with its job"
