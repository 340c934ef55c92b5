"""Issue #27, what a newcomer met in the docs and notebooks: install lines pip cannot follow,
notebooks a fresh Colab runtime cannot install from, and citations of files users do not have."""

import glob
import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "colab", "*.ipynb")))
# What a user reads: the docs, the notebooks and the scripts (not the tests).
USER_FACING = [
    os.path.join(ROOT, name) for name in ("README.md", "FORMAT.md", "Makefile")
] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")) + glob.glob(os.path.join(ROOT, "colab", "*"))
           + glob.glob(os.path.join(ROOT, "scripts", "*.py")) + glob.glob(os.path.join(ROOT, "tpu_ckpt", "*.py")))
# `pip install tpu_ckpt` or `pip install "tpu_ckpt[orbax]"`: a name PyPI does not have (a
# requirement naming where to get it, `tpu_ckpt[flax] @ git+https://...`, is fine).
BY_NAME = re.compile(r"""pip install\s+["']?tpu_ckpt(?:\[[^\]]*\])?(?=["'\s`]|$)(?!["']?\s*@)""", re.MULTILINE)
COLAB_LINK = re.compile(r"https://colab\.research\.google\.com/github/([^/\s]+/[^/\s]+)/blob/main/colab/([\w.]+\.ipynb)")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def install_cell(path: str) -> str:
    return nbformat.read(path, as_version=4).cells[1].source


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: os.path.relpath(p, ROOT))
def test_docs_cite_public_sources_not_paths_outside_the_repository(path):
    text = read(path)
    assert not re.findall(r"shared/reference|\.\./shared|/work/", text), path


@pytest.mark.parametrize("path", USER_FACING, ids=lambda p: os.path.relpath(p, ROOT))
def test_install_lines_name_somewhere_pip_can_install_tpu_ckpt_from(path):
    assert not BY_NAME.findall(read(path)), f"{path}: tpu_ckpt is not on PyPI; name a clone, a wheel or a git URL"


def test_readme_tells_how_to_install_from_a_clone_a_wheel_and_git_and_that_flax_brings_orbax():
    readme = read(os.path.join(ROOT, "README.md"))
    assert 'pip install ".[flax]"' in readme and "make wheel" in readme
    assert re.search(r'pip install "tpu_ckpt-[\d.]+-py3-none-any\.whl\[orbax\]"', readme)
    assert re.search(r'pip install "tpu_ckpt\[\w+\] @ git\+https://github\.com/[^/"]+/tpu_ckpt"', readme)
    assert "`[flax]` brings Orbax too" in readme


def test_colab_links_open_each_notebook_from_the_repository_its_install_cell_names():
    readme = read(os.path.join(ROOT, "README.md"))
    linked = COLAB_LINK.findall(readme)
    assert sorted(name for _, name in linked) == sorted(os.path.basename(p) for p in NOTEBOOKS)
    repositories = {repo for repo, _ in linked}
    repositories |= set(re.findall(r"git\+https://github\.com/([^/\s\"]+/tpu_ckpt)", readme))
    for path in NOTEBOOKS:
        first = nbformat.read(path, as_version=4).cells[0]
        assert first.cell_type == "markdown"
        assert [name for _, name in COLAB_LINK.findall(first.source)] == [os.path.basename(path)], path
        repositories |= {repo for repo, _ in COLAB_LINK.findall(first.source)}
        repositories |= set(re.findall(r'REPOSITORY, EXTRAS = "https://github\.com/([^"]+)"', install_cell(path)))
    assert len(repositories) == 1, repositories  # one place to point them all elsewhere


def run_install_cell(python: str, notebook: str, cwd, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("TPU_CKPT_PIP_SPEC", "PYTHONPATH")}
    return subprocess.run([python, "-c", install_cell(notebook)], cwd=cwd, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_install_cell_does_nothing_where_tpu_ckpt_is_importable(notebook, tmp_path):
    (tmp_path / "tpu_ckpt-0.0.1-py3-none-any.whl").write_bytes(b"not a wheel: installing it would fail")
    out = run_install_cell(sys.executable, notebook, tmp_path)
    assert out.returncode == 0 and not out.stdout, out.stdout + out.stderr


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory) -> str:
    """A Python like a fresh Colab runtime's: pip, and no tpu_ckpt."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run(
        [sys._base_executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True
    )
    python = str(venv / "bin" / "python")
    probe = "import importlib.util as u; print(u.find_spec('tpu_ckpt') is None, u.find_spec('pip') is not None)"
    found = subprocess.run([python, "-c", probe], cwd=venv, capture_output=True, text=True).stdout.split()
    assert found == ["True", "True"]
    return python


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=os.path.basename)
def test_install_cell_on_a_fresh_runtime_installs_from_the_git_repository_it_names(notebook, fresh_python, tmp_path):
    """No wheel uploaded: the cell installs from git (here git may not use https, so pip
    stops at the clone; what matters is the requirement the cell hands to pip)."""
    out = run_install_cell(fresh_python, notebook, tmp_path, GIT_ALLOW_PROTOCOL="file", PIP_NO_INDEX="1")
    extras = "[flax]" if os.path.basename(notebook) == "quickstart.ipynb" else ""
    pattern = rf"installing tpu_ckpt{re.escape(extras)} @ git\+https://github\.com/[^/]+/tpu_ckpt\n"
    assert re.fullmatch(pattern, out.stdout), out.stdout + out.stderr


@pytest.mark.slow
def test_install_cell_on_a_fresh_runtime_installs_an_uploaded_wheel(fresh_python, tmp_path):
    """`make wheel`'s wheel, uploaded next to the notebook, wins over the git repository."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), ROOT],
                   check=True, timeout=300)
    (wheel,) = [name for name in os.listdir(tmp_path) if name.endswith(".whl")]
    notebook = os.path.join(ROOT, "colab", "quickstart.ipynb")
    out = run_install_cell(fresh_python, notebook, tmp_path, PIP_NO_DEPS="1", PIP_NO_INDEX="1")
    assert out.returncode == 0 and out.stdout == f"installing {wheel}[flax]\n", out.stdout + out.stderr
    version = "import importlib.metadata as m, json; print(json.dumps(m.version('tpu_ckpt')))"
    installed = subprocess.run([fresh_python, "-c", version], cwd=tmp_path, capture_output=True, text=True)
    assert json.loads(installed.stdout) == "0.1.0", installed.stderr
