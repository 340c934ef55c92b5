"""The house's shape: packages in layers, each reached through its face, no circle anywhere.

docs/architecture.md draws the same picture; this test is what keeps it true.
"""

import ast
import importlib
import os
import pathlib
import subprocess
import sys

import tpu_ckpt as tc

PACKAGE = pathlib.Path(tc.__file__).parent
TESTS = pathlib.Path(__file__).parents[1]
BENCHMARKS = PACKAGE.parent / "benchmarks"

# Bottom to top. A unit imports only units on lower rows; units on one row never import each other.
LAYERS = [
    ["errors", "settings"],
    ["runtime"],
    ["format"],
    ["storage"],
    ["relay"],
    ["catalog"],
    ["cluster"],
    ["sharding"],
    ["options"],
    ["saving", "restoring"],
    ["tiers"],
    ["manager"],
    ["interop"],
    ["cli"],
]
RANK = {unit: row for row, units in enumerate(LAYERS) for unit in units}
NO_JAX = ["format", "storage", "relay", "catalog", "cli"]  # what keeps `tpu-ckpt ls` fast


def library_files() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def unit_of(path: pathlib.Path) -> str:
    """The package (or top-level module) a library file belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def imports(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, dotted module, at module level) for every tpu_ckpt import in ``path``, those
    inside functions and ``TYPE_CHECKING`` blocks included: a circle through a function-local
    import is still a circle."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tpu_ckpt":
                names = [f"tpu_ckpt.{a.name}" for a in node.names]
            else:  # ``from tpu_ckpt.p import _m`` imports the module _m; ``import x`` takes x from p's face
                names = [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                names += [node.module] * any(not a.name.startswith("_") for a in node.names)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, name, id(node) in top) for name in names if name.startswith("tpu_ckpt.")]
    return found


def test_every_unit_is_in_a_layer():
    units = {unit_of(p) for p in library_files()} - {"__init__", "__main__", "py"}
    assert units == set(RANK), "add the new package to LAYERS here and to docs/architecture.md"


def test_packages_import_only_from_lower_layers():
    wrong = []
    for path in library_files():
        me = unit_of(path)
        for line, module, _ in imports(path):
            other = module.split(".")[1]
            if me in RANK and other != me and RANK[other] >= RANK[me]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} {me} -> {other}")
    assert not wrong, wrong


def test_other_packages_reach_a_package_only_through_its_face():
    wrong = []
    for path in library_files():
        me = unit_of(path)
        for line, module, _ in imports(path):
            parts = module.split(".")
            if len(parts) > 2 and parts[1] != me:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not wrong, wrong


def test_tests_reach_private_modules_of_their_own_package_only():
    """tests/<package>/ may test its package's private modules; every other test uses faces."""
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        parts = path.relative_to(TESTS).parts
        home = parts[0] if len(parts) > 1 else None
        for line, module, _ in imports(path):
            names = module.split(".")
            if len(names) > 2 and names[2].startswith("_") and names[1] != home:
                wrong.append(f"{path.relative_to(TESTS)}:{line} imports {module}")
    assert not wrong, wrong


# The developers' benchmarks (benchmarks/) use the public API and the faces; one that measures
# inside a stage may also import that stage's private modules, each named here, so that a new
# reach into a private module is a decision this list records, and a rename updates it.
BENCHMARK_PRIVATE_MODULES = {
    "control_plane.py": {"tpu_ckpt.relay._wire", "tpu_ckpt.cluster._relays"},  # connection counts; the fan-out
    "kernel_reads_probe.py": {"tpu_ckpt.storage._direct_writes"},  # the O_DIRECT writer's chunk, timed alone
    "leader_commit_bench.py": {"tpu_ckpt.saving._commit"},  # a process's index, and the leader's commit alone
    "pod_scale.py": {  # wraps them to count: files opened and bytes read, the commit, the index sent, table rows
        "tpu_ckpt.format._table_reads",
        "tpu_ckpt.format._table_rows",
        "tpu_ckpt.saving._commit",
        "tpu_ckpt.saving._save",
        "tpu_ckpt.storage._safe_reads",
    },
    "tier_phases.py": {"tpu_ckpt.tiers._range_merge"},  # a local step's merge, timed alone
}


def test_benchmarks_reach_only_the_private_modules_listed_for_them():
    reached = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        private = {module for _, module, _ in imports(path) if any(p.startswith("_") for p in module.split(".")[2:])}
        if private:
            reached[str(path.relative_to(BENCHMARKS))] = private
    assert reached == BENCHMARK_PRIVATE_MODULES, (
        "name the private modules a benchmark uses in BENCHMARK_PRIVATE_MODULES"
    )


def _is_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def _names_used(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, module, name) for every name ``path`` imports from a tpu_ckpt module or reads off
    one it imported (``tc.save``, ``commit.commit``); an imported module binds its alias."""
    tree, bound, used = ast.parse(path.read_text()), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname: a.name for a in node.names if a.asname and a.name.startswith("tpu_ckpt")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tpu_ckpt"):
            for alias in node.names:
                if _is_module(f"{node.module}.{alias.name}"):
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                else:
                    used.append((node.lineno, node.module, alias.name))
    attributes = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)]
    return used + [(n.lineno, bound[n.value.id], n.attr) for n in attributes if n.value.id in bound]


def test_benchmarks_use_names_that_exist():
    """The suite runs no benchmark: a name one uses that a rename or a smaller face removed fails here."""
    missing = [f"{path.name}:{line} {module}.{name}" for path in sorted(BENCHMARKS.rglob("*.py"))
               for line, module, name in _names_used(path) if not hasattr(importlib.import_module(module), name)]
    assert not missing, missing


def _module_graph() -> dict[str, set[str]]:
    """Module -> the tpu_ckpt modules it imports; a face import means the face's file."""
    graph = {}
    for path in library_files():
        name = ".".join(("tpu_ckpt", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        graph[name] = {module for _, module, _ in imports(path)}
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_no_circle_anywhere_inside_packages_too():
    graph = _module_graph()
    for path in library_files():
        if path.name != "__init__.py":
            me = unit_of(path)
            own_face = f"tpu_ckpt.{me}"
            imported = {m for _, m, _ in imports(path)}
            assert own_face not in imported or path.parent == PACKAGE, f"{path}: imports its own face"
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join([*trail[trail.index(target):], target]) if target in trail else target)
            if target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_reading_packages_import_no_jax():
    code = (
        f"import sys; import {', '.join(f'tpu_ckpt.{p}' for p in NO_JAX)}; "
        "print(sorted(m for m in ('jax', 'ml_dtypes', 'tensorstore') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _users(text_test) -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in library_files() if text_test(p.read_text())}


def test_only_the_object_store_backend_imports_tensorstore():
    users = _users(lambda text: "import tensorstore" in text)
    assert users == {"storage/_objects.py", "interop/_orbax_checks.py"}  # the latter reads Orbax's OCDBT as Orbax does


def test_only_the_coordinator_touches_the_coordination_client():
    assert _users(lambda text: "global_state" in text) == {"cluster/_coordinator.py"}


def test_public_names_are_exported_from_the_package_only():
    for name in tc.__all__:
        assert getattr(tc, name) is not None
    assert (PACKAGE / "py.typed").exists()
    for path in library_files():
        if path.name != "__init__.py":
            assert "__all__" not in path.read_text(), path


def test_library_code_never_prints():
    """The library logs; only the command line (cli/) talks to the user."""
    for path in library_files():
        if unit_of(path) == "cli":
            continue
        calls = [
            n for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"
        ]
        assert not calls, path


MAX_MODULE_LINES = 360
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_readable_in_one_sitting():
    """Each module one stage, short enough to read at once; complexity is ruff's C901 (<= 10)."""
    too_long = []
    for path in library_files():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
                length = node.end_lineno - node.lineno + 1
                too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, too_long


def test_ruff_is_clean():
    """`make lint` in the suite, so its rules (complexity <= 10 among them) hold in CI too."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    result = subprocess.run(
        [ruff, "check", "tpu_ckpt", "tests", "scripts", "benchmarks"],
        cwd=PACKAGE.parent, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_test_files_have_unique_names():
    """pytest imports tests/<package>/test_x.py as module ``test_x`` (no __init__.py): two files
    of one name stop the collection of the whole suite."""
    names = [p.name for p in TESTS.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
