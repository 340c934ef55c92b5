"""The Colab notebooks run top to bottom on CPU (so they cannot rot)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

COLAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colab")
NOTEBOOKS = sorted(name for name in os.listdir(COLAB) if name.endswith(".ipynb"))


@pytest.mark.parametrize("devices", [8, 1], ids=["8_devices", "1_device"])
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_on_cpu(name, devices, tmp_path, monkeypatch):
    """On 8 devices (a Colab TPU runtime's count) and on 1 (a GPU runtime): the notebooks
    build their mesh from the devices present."""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={devices}")
    notebook = nbformat.read(os.path.join(COLAB, name), as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs) or name != "sharding_policies.ipynb"
