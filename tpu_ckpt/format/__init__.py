"""The checkpoint format as data: the manifest and its sealed encoding, piece tables, data-file
layout, key paths, slices and byte-range reads. No IO, no JAX: ``tpu-ckpt`` reads through it."""

from tpu_ckpt.format._data_layout import SAFETENSORS_CODES, SMALL_PIECE, PlannedPiece, Texts, data_file_bytes, file_size
from tpu_ckpt.format._decode import decode_manifest
from tpu_ckpt.format._decode_layout import check_byte_ranges
from tpu_ckpt.format._index import (
    IndexPlan,
    IndexRows,
    decode_index,
    encode_index,
    encode_parts,
    encode_rows,
    index_manifest,
    piece_rows,
    sort_order,
)
from tpu_ckpt.format._keys import PathEntry, flatten, join, normalise_subtree, path_entries, under, unflatten_nested
from tpu_ckpt.format._manifest import (
    ALIGNMENT,
    DTYPE_NAMES,
    FORMAT_VERSION,
    PER_PROCESS,
    LeafEntry,
    Manifest,
    PieceEntry,
    crc32c,
    dtype_from_name,
    dtype_itemsize,
    dtype_name,
    metric_values,
    seal,
    sharding_text,
    tensor_name,
    unseal,
    version_for,
)
from tpu_ckpt.format._names import (
    MANIFEST_FILE,
    PLAN_FILE,
    REFERENCED_FILE,
    STAGING_DIRECTORY,
    STAGING_MARKER,
    TIER_FILE,
    TOKENED,
    data_file_name,
    is_marker,
    marker_name,
    spread,
    staged_index_file,
    staging_directory,
    table_file,
    table_prefix,
    token_of,
    values_file_name,
    written_by,
)
from tpu_ckpt.format._piece_table import encode_manifest, grid_of, write
from tpu_ckpt.format._read_plan import MAX_READ_BYTES, Read, byte_batches, check_crcs, coalesce, overlapping
from tpu_ckpt.format._slices import (
    MAX_GRID_CELLS,
    SliceSpec,
    contains,
    cover,
    extent,
    full_slice,
    grids_shared,
    intersect,
    relative,
    tiling_problem,
    volume,
)
from tpu_ckpt.format._table_reads import (
    ROW,
    ROW_BYTES,
    TableSource,
    load_rows,
    loaded_overlapping,
    piece_cells,
    piece_columns,
    piece_layout,
    prefetch,
)
from tpu_ckpt.format._values import PerProcess, decode_value, encode_value

__all__ = ["ALIGNMENT", "PER_PROCESS", "PerProcess", "decode_value", "encode_value", "version_for", "DTYPE_NAMES", "FORMAT_VERSION", "IndexPlan", "IndexRows", "LeafEntry", "MANIFEST_FILE", "REFERENCED_FILE", "TOKENED", "MAX_GRID_CELLS", "MAX_READ_BYTES", "Manifest", "PathEntry", "PieceEntry", "PlannedPiece", "ROW", "ROW_BYTES", "Read", "SAFETENSORS_CODES", "SMALL_PIECE", "SliceSpec", "TableSource", "Texts", "byte_batches", "check_byte_ranges", "check_crcs", "coalesce", "contains", "cover", "crc32c", "data_file_bytes", "decode_index", "decode_manifest", "dtype_from_name", "dtype_itemsize", "dtype_name", "encode_index", "encode_manifest", "encode_parts", "encode_rows", "extent", "file_size", "flatten", "full_slice", "grid_of", "grids_shared", "index_manifest", "intersect", "join", "load_rows", "loaded_overlapping", "metric_values", "normalise_subtree", "overlapping", "path_entries", "piece_cells", "piece_rows", "piece_columns", "piece_layout", "prefetch", "relative", "seal", "sharding_text", "sort_order", "spread", "tensor_name", "tiling_problem", "token_of", "under", "unflatten_nested", "unseal", "volume", "write", "PLAN_FILE", "STAGING_DIRECTORY", "STAGING_MARKER", "TIER_FILE", "data_file_name", "is_marker", "marker_name", "staged_index_file", "staging_directory", "table_file", "table_prefix", "values_file_name", "written_by"]
