"""The ``tpu-ckpt`` command line; reading commands import no JAX."""

from tpu_ckpt.cli._convert import export, export_arguments
from tpu_ckpt.cli._main import main

__all__ = ["export", "export_arguments", "main"]
