"""Fingerprints of pieces' bytes, for incremental saves (``saving/_incremental.py``).

A piece in an accelerator's memory is fingerprinted there: one jitted program per device
(per group of at most ``_GROUP`` pieces) reduces each piece to 128 bits, and only those
16 bytes per piece cross to the host. A piece already on the host (a numpy array, or a
CPU device's buffer seen as one) is fingerprinted by a 128-bit BLAKE2b digest of its bytes
(of a piece over 16 MiB, of its 16 MiB chunks' digests, hashed on up to 8 threads).
The two kinds never compare equal: a fingerprint starts with the scheme that made it.

Hashing on the host is slower than writing to a local disk, so a host piece is sampled
first (``_SAMPLE`` elements spread over it, an indexing of its buffer): a piece of 1 MiB or
more whose sample is not last time's has changed, and is not hashed at all; its fingerprint
is then unknown (empty), and it is hashed at the next save whose sample matches, which
writes it once more. A save that changes everything pays for the samples only (the first
save of a manager hashes every piece).

The device scheme is four 32-bit lanes. Word ``w`` (the piece's bytes in C order as
unsigned integers, one per element, an 8-byte element as two) at position ``i`` adds
``fmix(((w ^ s_j) + p_i * m_j))`` to lane ``j`` (mod 2^32), with ``p_i = fmix(i * φ)``,
``fmix`` MurmurHash3's finaliser (a bijection) and ``s_j``, ``m_j`` constants per lane.
For a fixed position each term is a bijection of the word, so a piece that differs from
the last in one word always changes every lane; pieces differing in more words collide
in a lane with probability about 2^-32, in all four about 2^-128 if the lanes behave
independently. This is not a cryptographic hash: values crafted to collide could be
built, which a training run's state is not. An equal fingerprint is trusted only with the
same leaf, slice, dtype and shape as well (FORMAT.md, "References").
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpu_ckpt.sharding import on_cpu

_SAMPLE = 64  # elements of a host piece compared before it is hashed
_SAMPLED = 1 << 20  # the smallest piece left unhashed when its sample changed
_CHUNK = 16 << 20  # bytes hashed by one thread at a time
_GROUP = 256  # pieces per jitted program: a bounded program, compiled once per run and device
_DEVICE, _HOST = b"x", b"b"  # the scheme, a fingerprint's first byte
_SEEDS = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def fingerprints(
    pieces: Sequence[Any], previous: Sequence[tuple[bytes, bytes] | None], unchanged: Sequence[bool]
) -> list[tuple[bytes, bytes]]:
    """Each piece's sample and fingerprint (17 bytes: the scheme and 128 bits), given the
    same piece's last time (``previous``, or None), and whether its bytes are known to be
    the same (``unchanged``: the same immutable jax.Array, not deleted). A host piece known
    unchanged keeps its fingerprint; one whose sample differs from the last gets an empty
    fingerprint (module docstring). Every piece on a device is fingerprinted, so that its
    programs, the same at every save of a run, compile once. The device programs are all
    started before the host's work, and waited on last."""
    out: list[tuple[bytes, bytes]] = [(b"", b"")] * len(pieces)
    started: list[tuple[list[int], jax.Array]] = []
    by_device: dict[Any, list[int]] = {}
    for position, data in enumerate(pieces):
        if _on_device(data):
            by_device.setdefault(next(iter(data.devices())), []).append(position)
    for positions in by_device.values():
        for first in range(0, len(positions), _GROUP):
            group = positions[first : first + _GROUP]
            started.append((group, _lanes(tuple(pieces[p] for p in group))))
    on_host = [position for position, data in enumerate(pieces) if not _on_device(data)]
    for position in on_host:
        if unchanged[position] and (before := previous[position]) is not None and before[1]:
            out[position] = before
    hashed = [position for position in on_host if not out[position][1]]
    for position, fingerprint in zip(hashed, _host([pieces[p] for p in hashed], [previous[p] for p in hashed])):
        out[position] = fingerprint
    for group, lanes in started:
        for position, row in zip(group, np.asarray(jax.device_get(lanes))):
            out[position] = (b"", _DEVICE + row.astype("<u4").tobytes())
    return out


def _host(pieces: list[Any], previous: list[tuple[bytes, bytes] | None]) -> list[tuple[bytes, bytes]]:
    """Host pieces' samples and fingerprints: BLAKE2b of each ``_CHUNK`` of bytes, on
    threads (hashlib lets go of the GIL), and of a piece of several chunks, BLAKE2b of its
    chunks' digests."""
    samples, chunks = [], []
    for position, (data, before) in enumerate(zip(pieces, previous)):
        flat = np.ascontiguousarray(np.asarray(data)).reshape(-1)
        sample = flat[np.linspace(0, flat.size - 1, min(_SAMPLE, flat.size), dtype=np.int64)].tobytes()
        samples.append(sample)
        if before is None or before[0] == sample or flat.nbytes < _SAMPLED:
            whole = flat.view(np.uint8)
            chunks += [(position, whole[at : at + _CHUNK]) for at in range(0, max(whole.size, 1), _CHUNK)]
    digests: list[list[bytes]] = [[] for _ in pieces]
    for (position, _), digest in zip(chunks, _pool().map(_blake2b, [chunk for _, chunk in chunks])):
        digests[position].append(digest)
    return [(sample, _joined(parts)) for sample, parts in zip(samples, digests)]


def _joined(parts: list[bytes]) -> bytes:
    """A host fingerprint from its chunks' digests (none: not hashed, empty)."""
    if len(parts) <= 1:
        return _HOST + parts[0] if parts else b""
    return _HOST + hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def _blake2b(flat_bytes: np.ndarray) -> bytes:
    return hashlib.blake2b(flat_bytes.data, digest_size=16).digest()


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="tpu_ckpt-fingerprint")


def _on_device(data: Any) -> bool:
    """Whether ``data`` is fingerprinted by the device scheme: a jax.Array not on a CPU
    (whose buffer the host reads in place), of a dtype whose elements are whole bytes."""
    if not isinstance(data, jax.Array) or on_cpu(data):
        return False  # on a CPU, BLAKE2b of the buffer in place is faster than XLA's program (~2x)
    dtype = np.dtype(data.dtype)
    if data.size * max(1, dtype.itemsize // 4) >= 2**32:  # positions are 32-bit
        return False
    return dtype == np.bool_ or (dtype.kind != "c" and jax.dtypes.itemsize_bits(dtype) in (8, 16, 32, 64))


@jax.jit
def _lanes(arrays: tuple[jax.Array, ...]) -> jax.Array:
    """uint32[len(arrays), 4]: each array's four lanes (module docstring)."""
    return jnp.stack([_hash(a) for a in arrays])


def _hash(array: jax.Array) -> jax.Array:
    words = _words(array)
    position = _fmix(lax.iota(jnp.uint32, words.size) * jnp.uint32(0x9E3779B9))
    lanes = [
        jnp.sum(_fmix((words ^ jnp.uint32(seed)) + position * jnp.uint32(multiplier)), dtype=jnp.uint32)
        for seed, multiplier in zip(_SEEDS, _MULTIPLIERS)
    ]
    return jnp.stack(lanes)


def _words(array: jax.Array) -> jax.Array:
    """The array's bytes as one unsigned word per element (an 8-byte element: two), flat."""
    flat = array.reshape(-1)
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint32)
    unsigned = lax.bitcast_convert_type(flat, _UNSIGNED[flat.dtype.itemsize])
    return unsigned.reshape(-1).astype(jnp.uint32)


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser, elementwise (uint32 arithmetic wraps)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)
