"""Issue 41: large local files are written through a reused bounce buffer with O_DIRECT
(storage/_direct_writes.py); the bytes on disk and the restored values must be exact for
pieces larger than the bounce buffer, odd sizes, and where direct IO is refused."""

import dataclasses
import os

import jax
import numpy as np
import pytest

import tpu_ckpt as tc
from tpu_ckpt import storage
from tpu_ckpt.settings import configure, settings
from tpu_ckpt.storage import _direct_writes as direct_writes

CHUNK = direct_writes.CHUNK
ODD_SIZES = [1, 4095, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 12345, 7]


def _counting(monkeypatch, name):
    """Wraps direct_writes' real ``name`` to record its calls' arguments after the first."""
    calls, real = [], getattr(direct_writes, name)

    def counted(first, *rest):
        calls.append(rest)
        return real(first, *rest)

    monkeypatch.setattr(direct_writes, name, counted)
    return calls


def _random_bytes(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("sizes", [[CHUNK], [3 * CHUNK + 17], ODD_SIZES, [5, CHUNK - 5], [1] * 3 + [CHUNK + 4096]])
def test_a_store_writes_large_files_exactly(tmp_path, sizes):
    buffers = _random_bytes(sizes)
    with storage.Store(storage.location(tmp_path)) as store:
        store.write("f", buffers).result()
    assert (tmp_path / "f").read_bytes() == b"".join(b.tobytes() for b in buffers)


def test_one_bounce_buffer_serves_writes_one_after_another(tmp_path):
    """The buffer is reused (memory the host already backs), not one per write. The pool is
    the process's: earlier tests on this worker (pytest-xdist runs them in any order) may have
    left buffers in it, which the writes reuse too."""
    pooled = len(direct_writes._BOUNCES._free)
    for i in range(3):
        buffers = _random_bytes([CHUNK + i * 999], seed=i)
        fd = os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            direct_writes.write_file(fd, buffers)
        finally:
            os.close(fd)
        assert (tmp_path / f"f{i}").read_bytes() == buffers[0].tobytes()
    assert len(direct_writes._BOUNCES._free) == max(pooled, 1)


def test_a_write_direct_io_refuses_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """An alignment the file system refuses (here: none at all, so the padded last chunk
    is odd-sized and O_DIRECT fails with EINVAL) sends the rest of the file through the
    page cache: the file is still exact, padding and all truncated away."""
    monkeypatch.setattr(direct_writes, "ALIGNMENT", 1)
    switched = _counting(monkeypatch, "_set_direct")
    buffers = _random_bytes([CHUNK + 4097, 3])
    with storage.Store(storage.location(tmp_path)) as store:
        store.write("f", buffers).result()
    assert (tmp_path / "f").read_bytes() == b"".join(b.tobytes() for b in buffers)
    assert switched == [(True,), (False,)]  # on for the file, off once the odd tail was refused


@pytest.mark.parametrize("enable_async", [False, True])
def test_saves_through_the_bounce_buffer_restore_bit_exact(tmp_path, monkeypatch, enable_async):
    """Leaves larger than the bounce buffer, of odd byte sizes, sharded and not, several
    dtypes: every restored bit equals the saved one."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    rng = np.random.default_rng(1)
    tree = {
        "big": jax.device_put(rng.standard_normal((2048, 1538), np.float32), sharded),  # 12.6 MB, 3 MB shards
        "odd": jax.device_put(rng.integers(0, 255, (3 * CHUNK + 4099,), np.uint8), jax.devices()[0]),
        "bf16": jax.device_put(rng.standard_normal((1001, 4097)).astype(jax.numpy.bfloat16), jax.devices()[1]),
        "host": rng.integers(-(2**31), 2**31 - 1, (1237, 1723), np.int32),
        "tiny": np.arange(7, dtype=np.int16),
    }
    options = tc.CheckpointOptions(enable_async=enable_async, sharding_callback=tc.MaxShardSizePolicy(64 << 20))
    direct = _counting(monkeypatch, "write_file")
    tc.save(tmp_path / "c", tree, options=options).wait()
    assert direct, "no data file went through the bounce buffer"
    restored = tc.restore(tmp_path / "c", tree)
    for key, value in tree.items():
        got = np.asarray(restored[key])
        assert got.dtype == np.asarray(value).dtype and got.tobytes() == np.asarray(value).tobytes(), key


def test_the_direct_writes_setting_turns_the_bounce_buffer_off(tmp_path, monkeypatch):
    buffers = _random_bytes([CHUNK + 1])
    direct = _counting(monkeypatch, "write_file")
    previous = configure(dataclasses.replace(settings(), direct_writes=False))
    try:
        with storage.Store(storage.location(tmp_path)) as store:
            store.write("f", buffers).result()
    finally:
        configure(previous)
    assert (tmp_path / "f").read_bytes() == buffers[0].tobytes()
    assert direct == []


def test_a_json_document_of_any_size_is_written_through_the_page_cache(tmp_path, monkeypatch):
    """A manifest of many leaves (14 MB for 65,536) is written buffered: through the bounce
    buffer, a process's first such save created 8 MiB of it, kept, beyond host_memory_limit
    (issue 39's many small leaves). A data file of the same size still goes direct."""
    document = [b'{"leaves": [' + b"0," * CHUNK + b"0]}"]
    direct = _counting(monkeypatch, "write_file")
    with storage.Store(storage.location(tmp_path)) as store:
        store.write("manifest.json", document).result()
        assert direct == []
        store.write("d00000-00000.safetensors", document).result()
    assert len(direct) == 1
    assert (tmp_path / "manifest.json").read_bytes() == document[0]
    assert (tmp_path / "d00000-00000.safetensors").read_bytes() == document[0]


@pytest.mark.parametrize("out_of_order", [False, True])
def test_a_file_writer_goes_direct_while_its_parts_come_in_order(tmp_path, monkeypatch, out_of_order):
    """A Hugging Face export's file (storage.FileWriter with its size): parts in order go
    through the bounce buffer with O_DIRECT; the first part out of order (a transposed
    tensor's runs) writes what was gathered through the page cache and the rest goes there
    too. Either way the file is exact and every bounce buffer taken (one per chunk in flight)
    is handed back."""
    switched = _counting(monkeypatch, "_set_direct")
    head, middle, tail = _random_bytes([4097, 2 * CHUNK + 5, 3 * 4096 + 1])
    size = len(head) + len(middle) + len(tail)
    taken, given = [], []
    bounces = direct_writes._BOUNCES
    monkeypatch.setattr(bounces, "take", lambda real=bounces.take: taken.append(real()) or taken[-1])
    monkeypatch.setattr(bounces, "give_back", lambda b, real=bounces.give_back: given.append(b) or real(b))
    with storage.FileWriter(storage.location(tmp_path), "model.safetensors", size=size) as writer:
        writer.write_at(0, [head])
        if out_of_order:
            writer.write_at(size - len(tail), [tail])
            writer.write_at(len(head), [middle])
        else:
            writer.write_at(len(head), [middle[:100], middle[100:]])
            writer.write_at(size - len(tail), [tail])
    assert (tmp_path / "model.safetensors").read_bytes() == b"".join(b.tobytes() for b in (head, middle, tail))
    assert switched == ([(True,), (False,)] if out_of_order else [(True,)])
    assert len(taken) == (1 if out_of_order else 3) and sorted(map(id, taken)) == sorted(map(id, given))
    assert os.listdir(tmp_path) == ["model.safetensors"]
