"""A commit checks every file its manifest names, the piece tables too (#26).

A piece table lost after it was written (a cleanup removing it, a store that loses an
object it acknowledged) still gave a committed checkpoint whose leaves cannot be read: the
commit checked the data files only, before the tables were even written. It now checks
the tables with the data files, once the tables are written and before the manifest is:
nothing is committed, and the error names the table.

The loss comes at exactly that moment from the save's own staging store (a real one),
which removes the table once its write is durable, before saying it is done.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage

TABLE = "pieces-00000.bin"


class LosesTheTable:
    """A save's real staging store, which deletes the piece table right after writing it."""

    def __init__(self, store: storage.Backend):
        self.store = store

    def write(self, name: str, buffers) -> concurrent.futures.Future:
        written = self.store.write(name, buffers)
        if not name.endswith(TABLE):  # in an object store: <hash>-<token>-pieces-00000.bin
            return written
        lost: concurrent.futures.Future = concurrent.futures.Future()

        def lose(done: concurrent.futures.Future) -> None:
            if done.exception() is None:
                self.store.delete(name)
            lost.set_result(None)

        written.add_done_callback(lose)
        return lost

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.store.close()

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.fixture
def losing_staging(monkeypatch):
    opened = storage.open_staging
    monkeypatch.setattr(storage, "open_staging", lambda *args, **kwargs: LosesTheTable(opened(*args, **kwargs)))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_piece_table_lost_before_the_manifest_is_written_commits_nothing(tmp_path, losing_staging, where):
    path = str(tmp_path / "c") if where == "local" else f"memory://tables-{tmp_path.name}/c"
    w = np.arange(64, dtype=np.float32)
    with pytest.raises(tc.CheckpointError, match=f"{TABLE} is missing") as raised:
        tc.save(path, {"w": w}).wait()
    assert raised.value.file.endswith(TABLE) and "Nothing was committed" in str(raised.value)
    if where == "local":
        assert os.listdir(tmp_path) == []  # no checkpoint, no staging area
    assert storage.is_empty(storage.location(path))
    with pytest.raises(tc.CheckpointNotFoundError):
        tc.restore(path)
