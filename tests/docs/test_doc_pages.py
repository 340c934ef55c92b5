"""The README and the docs/ pages hang together: every link lands on a page and a heading,
every file and logger they name exists, the architecture page draws the layers the layering
test enforces, and the README stays a guide (its reference sections live in docs/).

Their code blocks are run by tests/docs/test_readme.py, page by page."""

import glob
import importlib
import os
import re

import pytest

from tests.docs.test_readme import PAGES, ROOT, doc_blocks
from tests.project.test_layering import LAYERS

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 600


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def prose(text: str) -> str:
    """The page without its fenced code blocks (a ``# ...`` line there is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, as GitHub and mkdocs' toc both spell them."""
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_link_lands_on_a_file_and_a_heading(page):
    text, here = read(page), os.path.dirname(os.path.join(ROOT, page))
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(here, path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(file):
            broken.append(f"{target}: no such file")
        elif anchor and file.endswith(".md") and anchor not in anchors(open(file).read()):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page}: {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("docs/")])
def test_docs_pages_link_no_file_outside_docs(page):
    """`mkdocs build --strict` fails on a link out of docs/ (README.md, FORMAT.md): name them instead."""
    outside = [t for t in LINK.findall(prose(read(page))) if t.startswith("../")]
    assert not outside, f"{page}: {outside}"


def _repository_files() -> set[str]:
    return {
        os.path.relpath(p, ROOT)
        for top in ("tpu_ckpt", "tests", "scripts", "benchmarks")
        for p in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)
    }


@pytest.mark.parametrize("page", PAGES)
def test_every_python_file_named_in_prose_exists(page):
    """Module paths went stale when the flat modules became packages (``save_plan.py``,
    ``distributed.py``); a page names files that exist, by their path or their name."""
    files = _repository_files()
    names = {os.path.basename(f) for f in files}
    stale = []
    for mention in re.findall(r"`([\w./-]+\.py)\b", prose(read(page))):
        if "/" in mention and mention.split("/")[0] in ("tpu_ckpt", "tests", "scripts", "benchmarks"):
            if mention not in files:
                stale.append(mention)
        elif "/" not in mention and mention not in names:
            stale.append(mention)
    assert not stale, f"{page} names files that do not exist: {stale}"


def test_the_logging_table_names_every_logger_that_logs_and_only_those():
    """Loggers are ``logging.getLogger(__name__)``: their names are module paths, and the
    table must follow the modules when they move."""
    text = read("docs/operations.md")
    table = [line for line in text.splitlines() if line.startswith("| ") and "`tpu_ckpt." in line]
    named = {name for line in table for name in re.findall(r"`(tpu_ckpt\.[\w.]+)`", line.split("|")[2])}
    logging_modules = set()
    for path in glob.glob(os.path.join(ROOT, "tpu_ckpt", "**", "*.py"), recursive=True):
        source = open(path).read()
        if re.search(r"\blogger\.(debug|info|warning|error|exception)\(", source):
            assert "logging.getLogger(__name__)" in source, path
            logging_modules.add(os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, "."))
    assert named == logging_modules
    assert 'logging.getLogger("tpu_ckpt")' in text and "parent" in text


def test_the_architecture_page_draws_the_layers_the_layering_test_enforces():
    text = read("docs/architecture.md")
    diagram = re.search(r"^```text\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL).group(1)
    rows = [
        [t.rstrip("/").removesuffix(".py") for t in line.split() if re.fullmatch(r"[a-z_]+(/|\.py)", t)]
        for line in diagram.splitlines()
    ]
    assert [row for row in reversed(rows) if row] == LAYERS
    for row in LAYERS:
        for unit in row:
            module = os.path.exists(os.path.join(ROOT, "tpu_ckpt", f"{unit}.py"))
            path = f"tpu_ckpt/{unit}.py" if module else f"tpu_ckpt/{unit}/"
            assert os.path.exists(os.path.join(ROOT, path)), path
            row_name = f"{unit}{'.py' if path.endswith('.py') else '/'}"
            assert f"| `{row_name}` |" in text, f"no row for {unit} in the table of packages"


def test_the_architecture_page_names_only_modules_that_exist():
    """``package/_module.py`` in the pipelines, and ``_module`` in a package's row of the table."""
    text = prose(read("docs/architecture.md"))
    named = set(re.findall(r"`([a-z_]+/_[a-z][a-z_]*\.py)`", text))
    for row in re.findall(r"^\| `([a-z_]+)/` \|(.*)$", text, flags=re.MULTILINE):
        named |= {f"{row[0]}/{module}.py" for module in re.findall(r"`(_[a-z_]+)`", row[1])}
    missing = [m for m in named if not os.path.exists(os.path.join(ROOT, "tpu_ckpt", m))]
    assert len(named) > 30 and not missing, missing


def test_the_architecture_page_shows_each_face_as_it_is():
    """The last column of the table of packages names what each face exports."""
    rows = re.findall(r"^\| `([a-z_]+)(/|\.py)` \|.*\|(.*)\|$", read("docs/architecture.md"), flags=re.MULTILINE)
    assert len(rows) == sum(map(len, LAYERS))
    wrong = []
    for unit, _, face in rows:
        module = importlib.import_module(f"tpu_ckpt.{unit}")
        exported = set(getattr(module, "__all__", None) or vars(module))
        names = [name.split("(")[0].split(".")[0] for name in re.findall(r"`([\w.()]+)`", face)]
        wrong += [f"{unit}.{name}" for name in names if name not in exported]
    assert not wrong, wrong


def test_the_readme_is_a_guide_that_sends_readers_to_the_pages():
    readme = read("README.md")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "## Layout" not in readme and "](docs/architecture.md)" in readme
    linked = {p for p in PAGES if p.startswith("docs/") and f"]({p}" in readme}
    assert linked == {p for p in PAGES if p.startswith("docs/")}, "a docs page the README does not link"
    assert {b.page for b in doc_blocks("python")} > {"README.md"}


def test_every_page_is_in_the_site_navigation():
    nav = set(re.findall(r"^  - .*: (\w+\.md)$", read("mkdocs.yml"), flags=re.MULTILINE))
    assert nav == {os.path.basename(p) for p in PAGES if p.startswith("docs/")}

