"""The Colab notebooks run top to bottom on CPU (so they cannot rot), and print what they say."""

import os
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

COLAB = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "colab")
NOTEBOOKS = sorted(name for name in os.listdir(COLAB) if name.endswith(".ipynb"))


def printed(notebook, start: str) -> str:
    """What the code cell whose source starts with ``start`` printed."""
    cell = next(c for c in notebook.cells if c.cell_type == "code" and c.source.startswith(start))
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def check_sharding_policies(notebook, devices: int) -> None:
    """The default policy's files, as their safetensors headers list them: every piece once,
    the replicated bias once, each device's block of the (data, model)-sharded embedding."""
    text = printed(notebook, "def describe")
    files = re.findall(r"^(\S+\.safetensors) +\d+ B +(\d+) pieces?: (.+)$", text, re.MULTILINE)
    names = [piece for _, _, pieces in files for piece in pieces.split(", ")]
    rows, cols = (4, 2) if devices == 8 else (1, 1)
    assert len(files) == devices and f"{devices} files" in text, text
    assert len(names) == sum(int(count) for _, count, _ in files) == rows * cols + cols + 1, text
    assert names.count("bias[0:256]") == 1, text
    assert f"embed[0:{512 // rows},0:{256 // cols}]" in names and f"dense[0:256,0:{256 // cols}]" in names, text
    assert " piece" in printed(notebook, "options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy")


def check_quickstart(notebook, devices: int) -> None:
    assert "committed steps: [51, 101, 151]" in printed(notebook, "options = tc.CheckpointOptions"), notebook.cells[4]
    resumed = printed(notebook, "del state, manager")
    assert "resumed at step 151" in resumed and "kept steps [151, 201, 251]" in resumed, resumed
    assert "bfloat16" in printed(notebook, "latest_path =")


CHECKS = {"sharding_policies.ipynb": check_sharding_policies, "quickstart.ipynb": check_quickstart}


@pytest.mark.parametrize("devices", [8, 1], ids=["8_devices", "1_device"])
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_on_cpu(name, devices, tmp_path, monkeypatch):
    """On 8 devices (a Colab TPU runtime's count) and on 1 (a GPU runtime): the notebooks
    build their mesh from the devices present."""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    notebook = nbformat.read(os.path.join(COLAB, name), as_version=4)
    resources = {"metadata": {"path": str(tmp_path)}}
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources=resources).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert not printed(notebook, "# Install tpu_ckpt")  # importable here: the install cell does nothing
    assert any("image/png" in o.get("data", {}) for o in outputs) or name != "sharding_policies.ipynb"
    CHECKS[name](notebook, devices)


# What a notebook's first cell installs brings these (tpu_ckpt, its dependencies, and with [flax] Flax and optax).
INSTALLED_WITH_TPU_CKPT = {"tpu_ckpt", "jax", "numpy", "ml_dtypes", "tensorstore", "flax", "optax"}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_install_cell_installs_what_the_notebook_imports_and_prints_plain_text(name):
    """A local Jupyter without matplotlib failed at cell 2: every module a notebook imports is
    the standard library's, comes with tpu_ckpt, or is installed by the first cell when missing;
    pip runs with --no-color (a cell shows its escape codes raw)."""
    cells = [c.source for c in nbformat.read(os.path.join(COLAB, name), as_version=4).cells if c.cell_type == "code"]
    install = cells[0]
    imported = {
        module.strip().split(".")[0].split(" ")[0]
        for source in cells
        for names in re.findall(r"^[ \t]*(?:import|from)[ \t]+([\w., ]+?)(?:[ \t]+import\b.*)?$", source, re.MULTILINE)
        for module in names.split(",")
    }
    missing = imported - set(sys.stdlib_module_names) - INSTALLED_WITH_TPU_CKPT
    assert all(f'find_spec("{module}") is None' in install for module in missing), (missing, install)
    pip_calls = re.findall(r'"pip", "install"[^\]]*\]', install)
    assert pip_calls and all('"--no-color"' in call for call in pip_calls), install
