"""The stores a tier restore reads and serves through: files held in memory, a store routing
each read to the store holding its file, and one layering memory over a disk."""

from __future__ import annotations

import abc
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np

from tpu_ckpt import storage


class ReadOnly(storage.ReadableStore):
    """A store a restore reads through and nothing writes to; ``with`` closes it."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class InMemory(ReadOnly):
    """Files held in memory (the merged manifest and its piece tables), for a relay server
    to serve: whole, or by byte range."""

    def __init__(self, location: storage.Location, files: dict[str, bytes]):
        self.location = location
        self._files = files

    def read_file(self, name: str) -> bytes | None:
        return self._files.get(name)

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Each file's size (the files never change: a holder asks for every read)."""
        return {name: len(data) for name, data in self._files.items()}

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        data, chunks = self._files[name], []
        for n in lengths:
            chunks.append(np.frombuffer(data, np.uint8, n, start).copy())
            start += n
        if then is not None:
            then(chunks)
        future.set_result(chunks)
        return future

    def close(self) -> None:
        """Nothing to release: the bytes are the caller's."""


class Routed(ReadOnly):
    """A store that sends each read to the store holding the file (:meth:`_store_of`)."""

    def read(
        self, name: str, start: int, lengths: Sequence[int], then: Callable[[list[np.ndarray]], Any] | None = None
    ) -> concurrent.futures.Future:
        return self._store_of(name).read(name, start, lengths, then)

    def read_file(self, name: str) -> bytes | None:
        return self._store_of(name).read_file(name)

    @abc.abstractmethod
    def _store_of(self, name: str) -> storage.ReadableStore:
        """The store holding ``name``."""


class Layered(Routed):
    """The files of ``memory`` (this host's parts' rows cut by range), else those of ``own``
    (its disk): what a part's holder serves."""

    def __init__(self, own: storage.ReadableStore, memory: InMemory):
        self.location = own.location
        self._own = own
        self._memory = memory

    @property
    def sizes(self) -> dict[str, int]:
        """The sizes of the files held in memory."""
        return self._memory.sizes

    def _store_of(self, name: str) -> storage.ReadableStore:
        return self._memory if name in self._memory.sizes else self._own

    def close(self) -> None:
        """Nothing to release: both stores are the caller's."""
