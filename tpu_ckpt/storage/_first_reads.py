"""Checks that run before the first read of a file through a store, once, whatever thread reads it.

An incremental checkpoint on an object store references other steps' objects; checking one
costs requests (its size, its step), so each process checks those it reads, when it first
reads them, instead of every one of the checkpoint on every host (``ObjectStore.check_before_reading``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable


class FirstReadChecks:
    """``check(name)`` for each name given, run by the first read of it; its error is raised
    by that read and by every later one."""

    def __init__(self) -> None:
        self._checks: dict[str, Callable[[str], None]] = {}
        self._done: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def add(self, names: Iterable[str], check: Callable[[str], None]) -> None:
        self._checks.update(dict.fromkeys(names, check))

    def before_reading(self, name: str) -> None:
        check = self._checks.get(name)
        if check is None:
            return
        with self._lock:
            done, mine = self._done.get(name), False
            if done is None:
                done = self._done[name] = concurrent.futures.Future()
                mine = True
        if mine:
            try:
                check(name)
                done.set_result(None)
            except BaseException as error:  # noqa: BLE001 - raised below, and by every later read of it
                done.set_exception(error)
        done.result()
