"""The ``tpu-ckpt`` command line; reading commands import no JAX."""

from tpu_ckpt.cli._main import main

__all__ = [
    "main",
]
