"""Issue #27: the README's quickstart, pasted into a Python on a machine without accelerators
(no XLA_FLAGS set), failed in JAX: 1 device cannot make a (4, 2) mesh."""

import os

import pytest

from tests.docs.test_readme import ROOT, by_section, readme_blocks, run_sections

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


def test_quickstart_runs_as_pasted_on_a_cpu_without_xla_flags(tmp_path):
    blocks = by_section([b for b in readme_blocks("python") if not b.marker])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cpu = {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    assert run_sections(tmp_path, {"Quickstart": blocks["Quickstart"]}, cpu) >= 3
