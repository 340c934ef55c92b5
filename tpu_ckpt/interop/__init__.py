"""Other formats and APIs: Orbax import and export, the params-only serving export (also to
the Hugging Face layout), Hugging Face safetensors loaded onto a mesh, and the TF-style
``Checkpoint``."""

from tpu_ckpt.interop._checkpoint import Checkpoint
from tpu_ckpt.interop._export import export_for_serving
from tpu_ckpt.interop._hf_load import load_safetensors
from tpu_ckpt.interop._orbax import (
    ImportReport,
    export_orbax,
    import_orbax,
)

__all__ = [
    "Checkpoint",
    "ImportReport",
    "export_for_serving",
    "export_orbax",
    "import_orbax",
    "load_safetensors",
]
