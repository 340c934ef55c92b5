"""The Hugging Face safetensors layout as data, no IO: shard files and their names, the
index, a file's header written and read back.

What ``huggingface_hub`` (``split_torch_state_dict_into_shards``) and ``transformers``
(``save_pretrained``) write: tensors packed in order into files of at most
``max_shard_size`` bytes of data (``"5GB"``: 5 * 10**9; a tensor bigger than that gets a
file of its own), ``model.safetensors`` when one file holds them all, else
``model-00001-of-0000N.safetensors``... and ``model.safetensors.index.json``.

A header read here trusts nothing (the ``safetensors`` library's own checks and more):
its claimed length is bounded before anything is allocated, it must be UTF-8 JSON with
no name twice, and every tensor's bytes must lie inside the file, match its dtype and
shape, and overlap no other tensor's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import SAFETENSORS_CODES, SliceSpec, dtype_itemsize, extent

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's "5GB"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's bound
MAX_INDEX_BYTES = 256 << 20
_DTYPES = {code: name for name, code in SAFETENSORS_CODES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor of a file: its name, dtype (numpy's name: ``bfloat16``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtype_itemsize(self.dtype) * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A tensor found in a file's header, with its bytes' place in the file."""

    tensor: Tensor
    file: str
    start: int  # from the file's first byte
    stop: int


def parse_size(size: int | str) -> int:
    """Bytes from an int or Hugging Face's spelling (``"5GB"`` = 5 * 10**9, ``"500MiB"``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_shard_size {size!r} is not a size: give bytes or e.g. '5GB', '500MiB'")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def split_shards(tensors: Sequence[Tensor], max_size: int) -> list[list[Tensor]]:
    """``huggingface_hub``'s packing: in order, a new file when the next tensor would take
    the current one past ``max_size``; a tensor bigger than that alone in a file."""
    shards: list[list[Tensor]] = []
    current: list[Tensor] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > max_size:
            shards.append([tensor])
            continue
        if current and size + tensor.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def encode_header(tensors: Sequence[Tensor]) -> tuple[bytes, list[int]]:
    """A file's first bytes (length, JSON header padded with spaces to 8 bytes, as the
    ``safetensors`` library writes) and each tensor's offset in the file."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without it
    at = 0
    for tensor in tensors:
        code = SAFETENSORS_CODES.get(tensor.dtype)
        if code is None:
            raise ValueError(f"tensor {tensor.name!r} is {tensor.dtype}, which safetensors has no code for; cast it")
        entries[tensor.name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [at, at + tensor.nbytes]}
        at += tensor.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data_start = 8 + len(text)
    offsets = [data_start + entries[t.name]["data_offsets"][0] for t in tensors]
    return struct.pack("<Q", len(text)) + text, offsets


def runs_of(shape: Sequence[int], itemsize: int, spec: SliceSpec) -> Iterator[tuple[int, int]]:
    """The ``(start, length)`` byte runs of slice ``spec`` of a row-major tensor, in order:
    its trailing whole dimensions and the one before them are contiguous."""
    if math.prod(extent(spec)) == 0:
        return
    whole = len(shape)
    while whole > 0 and tuple(spec[whole - 1]) == (0, shape[whole - 1]):
        whole -= 1
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    if whole == 0:
        yield 0, math.prod(shape) * itemsize
        return
    length = (spec[whole - 1][1] - spec[whole - 1][0]) * strides[whole - 1]
    base = sum(spec[d][0] * strides[d] for d in range(whole))
    starts = np.zeros(1, np.int64)
    for d in range(whole - 1):
        starts = (starts[:, None] + np.arange(spec[d][1] - spec[d][0], dtype=np.int64) * strides[d]).ravel()
    for start in starts.tolist():
        yield base + start, length


def encode_index(weight_map: dict[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json`` as ``transformers`` writes it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def header_length(first: bytes, size: int | None, where: str) -> int:
    """The header length a file's first 8 bytes claim, refused past the bound or the file."""
    if len(first) < 8:
        raise _corrupt(where, "is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", first[:8])
    if length > MAX_HEADER_BYTES or (size is not None and 8 + length > size):
        raise _corrupt(where, f"claims a {length}-byte header, more than the file or the {MAX_HEADER_BYTES} allowed")
    return length


def decode_header(raw: bytes, size: int | None, file: str, where: str) -> list[Entry]:
    """The tensors of a header (``raw``: its JSON bytes), each checked (module docstring)."""
    doc = _json(raw, where)
    if not isinstance(doc, dict):
        raise _corrupt(where, "has a header that is not a JSON object")
    data_start = 8 + len(raw)
    entries = [_entry(name, value, data_start, file, where) for name, value in doc.items() if name != "__metadata__"]
    if size is not None and entries and max(e.stop for e in entries) > size:
        raise _corrupt(where, f"has tensors whose bytes end past its end ({size} bytes)")
    entries.sort(key=lambda e: (e.start, e.stop))
    for before, after in zip(entries, entries[1:]):
        if after.start < before.stop:
            raise _corrupt(where, f"has overlapping tensors {before.tensor.name!r} and {after.tensor.name!r}")
    return entries


def decode_index(raw: bytes, where: str) -> dict[str, str]:
    """The weight map of an index: tensor name -> file."""
    doc = _json(raw, where)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise _corrupt(where, 'has no "weight_map" of tensor names to file names')
    return weight_map


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except UnicodeDecodeError:
        raise _corrupt(where, "has a header that is not UTF-8") from None
    except (ValueError, RecursionError) as e:
        raise _corrupt(where, f"has a header that is not valid JSON ({str(e)[:200]})") from None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {twice!r} appears twice")
    return doc


def _entry(name: str, value: Any, data_start: int, file: str, where: str) -> Entry:
    known = isinstance(value, dict) and value.get("dtype") in _DTYPES
    shape = _naturals(value.get("shape")) if known else None
    offsets = _naturals(value.get("data_offsets"), 2) if known else None
    if shape is None or offsets is None:
        raise _corrupt(where, f"describes tensor {name!r} wrongly (a dtype code, a shape and data_offsets needed)")
    tensor = Tensor(name, _DTYPES[value["dtype"]], tuple(shape))
    begin, end = offsets
    if begin > end or end - begin != tensor.nbytes:
        raise _corrupt(where, f"gives tensor {name!r} bytes [{begin}, {end}), not the {tensor.nbytes} its shape needs")
    return Entry(tensor, file, data_start + begin, data_start + end)


def _naturals(value: Any, length: int | None = None) -> list[int] | None:
    """``value`` if it is a list of ints >= 0 (of ``length`` of them, if given), else None."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    return value if all(type(v) is int and v >= 0 for v in value) else None


def _corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where} {what}: it is not a safetensors file we can trust; download or export it again", file=where
    )
