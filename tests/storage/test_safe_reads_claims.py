"""Sizes claimed by a resealed (hostile) manifest are checked against the object's real size
before anything in proportion to them is allocated, on every backend: a typed error, with
little memory, never a process that keeps allocating or dies (issues #26, #28, #29)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import seal, sealed
from tests.support.rss import reset_peak, rss
from tpu_ckpt import storage

HEADROOM = 64 << 20  # what a refused claim may cost, at most


def _saved(url: str) -> dict:
    tc.save(url, {"w": np.arange(64, dtype=np.float32)})
    with storage.Store(storage.location(url)) as store:
        return json.loads(store.read_file("manifest.json"))


def _reseal(url: str, doc: dict) -> None:
    """Replaces the manifest: deleted first, as an object store's manifest is created only if
    absent (the commit's guard against a second writer)."""
    with storage.Store(storage.location(url)) as store:
        store.delete("manifest.json")
        store.write("manifest.json", [sealed(doc)]).result()


def _huge_piece(doc: dict) -> None:
    """One inline piece of 2^57 bytes, inside a data file claimed as large."""
    n = 1 << 55
    leaf = doc["leaves"][0]
    del leaf["grid"], leaf["table"]
    leaf.update(shape=[n], pieces=[[[[0, n]], 0, 0, n * 4, 0]])
    doc.update(files=[[doc["files"][0][0], n * 4]], tables=[])


def _huge_table(doc: dict) -> None:
    """A leaf of 2^34 one-element cells: a piece table of 256 GiB claimed for a 16-byte object."""
    n = 1 << 34
    doc["leaves"][0].update(shape=[n], grid=[1], table=[0, 0, n, 0])
    doc["tables"][0][1] = n * 16
    doc["files"][0][1] = n * 4


def _refused_cheaply(url: str, match: str) -> None:
    reset_peak(trim=True)
    before = rss("VmRSS")
    with pytest.raises(tc.CorruptCheckpointError, match=match) as e:
        tc.restore(url)
    assert rss("VmHWM") - before <= HEADROOM
    assert e.value.file.startswith(url)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("edit, match", [(_huge_piece, "safetensors is missing, or truncated"),
                                         (_huge_table, "pieces-00000.bin is missing, or truncated")])
def test_a_huge_claim_in_memory_is_refused_before_it_is_allocated(edit, match):
    url = f"memory://claims-{edit.__name__}/c"
    doc = _saved(url)
    edit(doc)
    _reseal(url, doc)
    _refused_cheaply(url, match)


@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("edit, match", [(_huge_piece, "safetensors is missing, or truncated"),
                                         (_huge_table, "pieces-00000.bin is missing, or truncated")])
def test_a_huge_claim_on_an_object_store_is_refused_before_it_is_allocated(bucket, edit, match):
    url = bucket.url("c")
    doc = _saved(url)
    edit(doc)
    _reseal(url, doc)
    _refused_cheaply(url, match)


@pytest.mark.timeout(300, method="thread")
def test_an_object_larger_than_its_bound_is_refused_unread(bucket):
    bucket.put("big/manifest.json", b"x" * (1 << 20))
    with storage.Store(storage.location(bucket.url("big"))) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="more than the 1000 bytes"):
            store.read_file("manifest.json", max_bytes=1000)
        assert store.read_file("manifest.json", max_bytes=1 << 20) == b"x" * (1 << 20)
        assert store.read_file("absent.json", max_bytes=10) is None


BRACKETS = """
import resource, sys
import jax
import tpu_ckpt as tc
jax.devices()  # its threads started before the limit
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (768 << 20), resource.RLIM_INFINITY))
try:
    tc.restore(sys.argv[1])
except tc.CorruptCheckpointError as e:
    print("refused:", e)
"""


@pytest.mark.timeout(300, method="thread")
def test_a_sealed_manifest_of_empty_lists_is_refused_not_a_memory_error(tmp_path):
    """64 MB of ``[],``: under the size bound, but over 1.4 GB decoded; in a process allowed
    768 MB more, as a smaller host would be."""
    (tmp_path / "c").mkdir()
    body = b'{"format":"tpu_ckpt","format_version":"2.0","leaves":[' + b"[]," * ((64 << 20) // 3) + b"[]]}"
    (tmp_path / "c" / "manifest.json").write_bytes(seal(body))
    del body
    # Two malloc arenas: each IO thread's own arena reserves 64 MB of address space, which the
    # limit counts though nothing is allocated, so how many the threads made before the read
    # (timing, on a loaded machine) decided whether the 64 MB read itself fit.
    run = subprocess.run([sys.executable, "-c", BRACKETS, str(tmp_path / "c")], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_ARENA_MAX": "2"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.startswith("refused:") and "GB of memory" in run.stdout, run.stdout
