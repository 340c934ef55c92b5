"""Where bytes live: a ``Location`` (a directory or an object-store prefix), the store protocols
(read-only, writable, backend), local files, object stores through tensorstore, the IO pool
and the only local ``open`` (confined to the checkpoint)."""

from tpu_ckpt.storage._file_writes import (
    FileWriter,
    ensure_directory,
    file_size,
)
from tpu_ckpt.storage._io_pool import (
    IOPool,
    PooledStore,
)
from tpu_ckpt.storage._local import (
    make_directory,
    rename_durably,
)
from tpu_ckpt.storage._location import (
    Location,
    location,
    new_token,
)
from tpu_ckpt.storage._objects import ObjectStore
from tpu_ckpt.storage._protocols import (
    Backend,
    CheckpointStore,
    ReadableStore,
)
from tpu_ckpt.storage._safe_reads import (
    aligned_empty,
    byte_view,
    confine,
    open_confined,
    read_json,
    read_ranges,
    read_whole,
)
from tpu_ckpt.storage._stores import (
    Store,
    check_written,
    has_staging_leftover,
    is_empty,
    latest_marker,
    markers,
    open_staging,
    publish,
    read_marker,
    remove,
    remove_files,
)
from tpu_ckpt.storage._writers import shorter_grace

__all__ = [
    "Backend",
    "CheckpointStore",
    "FileWriter",
    "IOPool",
    "Location",
    "ObjectStore",
    "PooledStore",
    "ReadableStore",
    "Store",
    "aligned_empty",
    "byte_view",
    "check_written",
    "confine",
    "ensure_directory",
    "file_size",
    "has_staging_leftover",
    "is_empty",
    "latest_marker",
    "location",
    "make_directory",
    "markers",
    "new_token",
    "open_confined",
    "open_staging",
    "publish",
    "read_json",
    "read_marker",
    "read_ranges",
    "read_whole",
    "remove",
    "remove_files",
    "rename_durably",
    "shorter_grace",
]
