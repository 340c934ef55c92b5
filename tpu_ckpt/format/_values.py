"""Per-process values (``tc.PerProcess``) and the bytes one is stored as (FORMAT.md "Per-process values").

A per-process value is host data: JSON-like Python (dicts, lists, tuples, bool, int, float,
str, None), ``bytes`` and numpy arrays, nested. It is stored as a small JSON header that
describes the tree, followed by the raw bytes of its ``bytes`` and arrays, so a 16 MiB
iterator state costs 16 MiB plus a few bytes, not a base64 text. Decoding trusts nothing:
the header's length, every node's kind, every byte range and every array's size are checked
before anything is built, and nesting is bounded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpu_ckpt.errors import CorruptCheckpointError, FormatVersionError
from tpu_ckpt.format._manifest import dtype_from_name, dtype_itemsize, dtype_name

MAX_DEPTH = 64
_SCALARS = (bool, int, float, str, type(None))
_HEADER = struct.Struct("<Q")
Reshard = Callable[[Sequence[Any], int, int], Any]


class PerProcess:
    """A leaf whose value each process saves for itself: a data iterator's position, a
    process's own random state. Not a ``jax.Array``: JSON-like Python data, ``bytes`` and
    numpy arrays, nested.

    On save, ``tc.PerProcess(value)``: every process stores its own ``value`` (each in its
    own values file; nothing large goes through the coordination service). On restore with
    the same process count every process gets back exactly the value it saved, plain (not
    wrapped). With another process count the restore raises ``ProcessCountMismatchError``
    unless the target holds ``tc.PerProcess(reshard=fn)`` at that key: then each process gets
    ``fn(saved_values, process_index, process_count)``, ``saved_values`` being every saved
    value in process order.

    Args:
      value: what this process saves (ignored in a restore target).
      reshard: in a restore target only: ``fn(saved_values, process_index, process_count)``,
        called when the process count differs from the one that saved.

    Raises:
      TypeError: ``reshard`` is given but not callable.
    """

    __slots__ = ("reshard", "value")

    def __init__(self, value: Any = None, *, reshard: Reshard | None = None):
        if reshard is not None and not callable(reshard):
            raise TypeError(
                "PerProcess(reshard=...) takes a function (saved_values, process_index, process_count), "
                f"got {reshard!r}"
            )
        self.value = value
        self.reshard = reshard

    def __repr__(self) -> str:
        return f"PerProcess(reshard={self.reshard!r})" if self.reshard is not None else f"PerProcess({self.value!r})"


def encode_value(value: Any, key: str, process: int) -> bytes:
    """``value`` as stored: ``<u64 header length><JSON header><raw bytes>``; TypeError naming
    ``key`` and ``process`` for anything a per-process value cannot hold."""
    buffers: list[bytes] = []
    offset = [0]

    def raw(data: bytes) -> list[int]:
        buffers.append(data)
        offset[0] += len(data)
        return [offset[0] - len(data), len(data)]

    def node(x: Any, depth: int) -> list[Any]:
        if depth > MAX_DEPTH:
            raise TypeError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, _SCALARS):
            return ["v", x]
        if isinstance(x, (bytes, bytearray, memoryview)):
            return ["b", *raw(bytes(x))]
        if isinstance(x, (np.ndarray, np.generic)) and type(x).__module__ == "numpy":
            array = np.ascontiguousarray(x)
            return ["a", dtype_name(array.dtype), list(array.shape), *raw(array.tobytes())]
        if isinstance(x, dict):
            return ["d", [[_dict_key(k), node(v, depth + 1)] for k, v in x.items()]]
        if type(x) in (list, tuple):
            return ["l" if type(x) is list else "t", [node(v, depth + 1) for v in x]]
        raise TypeError(f"holds a {type(x).__name__}")

    try:
        header = json.dumps(node(value, 0), separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"PerProcess leaf {key!r} on process {process} {e}; a per-process value holds JSON-like Python data "
            "(dict, list, tuple, bool, int, float, str, None), bytes and numpy arrays "
            "(a jax.Array is a leaf of its own)."
        ) from None
    return b"".join([_HEADER.pack(len(header)), header, *buffers])


def _dict_key(k: Any) -> Any:
    if not isinstance(k, _SCALARS):
        raise TypeError(f"has a dict key of type {type(k).__name__} (keys are str, int, float, bool or None)")
    return k


def decode_value(data: np.ndarray | bytes, where: str, key: str) -> Any:
    """The value ``encode_value`` stored in ``data``; CorruptCheckpointError naming ``where``
    and ``key`` when anything in it does not hold together."""
    view = memoryview(data if isinstance(data, bytes) else np.ascontiguousarray(data, np.uint8).tobytes())

    def fail(problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: the per-process value of key {key!r} is damaged: {problem}", key=key, file=where
        )

    if len(view) < _HEADER.size or _HEADER.unpack_from(view)[0] > len(view) - _HEADER.size:
        raise fail("its header runs past its bytes")
    start = _HEADER.size + _HEADER.unpack_from(view)[0]
    try:
        tree = json.loads(bytes(view[_HEADER.size:start]))
    except (ValueError, RecursionError):
        raise fail("its header is not JSON") from None
    body = view[start:]
    return _Decoder(body, fail).node(tree, 0)


class _Decoder:
    def __init__(self, body: memoryview, fail: Callable[[str], CorruptCheckpointError]):
        self.body = body
        self.fail = fail

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or type(node) is not list or not node or node[0] not in ("v", "b", "a", "d", "l", "t"):
            raise self.fail(f"a node is not one a value holds: {str(node)[:60]}")
        kind = node[0]
        if kind == "v" and len(node) == 2 and isinstance(node[1], _SCALARS):
            return node[1]
        if kind == "b" and len(node) == 3:
            return bytes(self.raw(node[1], node[2]))
        if kind == "a" and len(node) == 5:
            return self.array(node[1], node[2], node[3], node[4])
        if kind == "d" and len(node) == 2 and type(node[1]) is list:
            return {self.key(item): self.node(item[1], depth + 1) for item in node[1]}
        if kind in ("l", "t") and len(node) == 2 and type(node[1]) is list:
            items = [self.node(v, depth + 1) for v in node[1]]
            return items if kind == "l" else tuple(items)
        raise self.fail(f"a {kind!r} node is malformed: {str(node)[:60]}")

    def key(self, item: Any) -> Any:
        if type(item) is not list or len(item) != 2 or not isinstance(item[0], _SCALARS):
            raise self.fail(f"a dict entry is malformed: {str(item)[:60]}")
        return item[0]

    def raw(self, offset: Any, length: Any) -> memoryview:
        if (
            type(offset) is not int or type(length) is not int
            or not 0 <= offset <= offset + length <= len(self.body) or length < 0
        ):
            raise self.fail(f"bytes [{offset}, +{length}) lie outside its {len(self.body)} bytes")
        return self.body[offset:offset + length]

    def array(self, dtype: Any, shape: Any, offset: Any, length: Any) -> np.ndarray:
        if type(dtype) is not str or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            raise self.fail(f"an array's dtype or shape is malformed: {dtype!r} {shape!r}")
        try:
            itemsize = dtype_itemsize(dtype)
        except FormatVersionError as e:
            raise self.fail(str(e)) from None
        if len(shape) > MAX_DEPTH or int(np.prod(shape, dtype=object)) * itemsize != length:
            raise self.fail(f"an array of shape {shape} and dtype {dtype} does not hold {length} bytes")
        return np.frombuffer(bytes(self.raw(offset, length)), dtype_from_name(dtype)).reshape(shape).copy()
