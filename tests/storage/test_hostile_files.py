"""Checkpoint files that are not what a save wrote: FIFOs, devices, huge or outside files,
and data files changed after (or while) they were restored. Each must give a typed error
naming the file, or leave the restored arrays as they were; never a hang, an unbounded
allocation, a read outside the checkpoint or a dead process."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.helpers import bits, files
from tpu_ckpt import storage
from tpu_ckpt.catalog import verify
from tpu_ckpt.storage._safe_reads import MAX_WHOLE_FILE_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREE = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(7, np.int32)}


@pytest.fixture
def ckpt(tmp_path):
    tc.save(tmp_path / "c", TREE)
    return tmp_path / "c"


def data_file(path) -> str:
    (name,) = files(path)
    return str(path / name)


@pytest.mark.timeout(30, method="thread")  # a hang ends the run: a blocked read cannot be interrupted
def test_a_fifo_data_file_is_refused_at_once(ckpt):
    path = data_file(ckpt)
    os.unlink(path)
    os.mkfifo(path)
    with pytest.raises(tc.CorruptCheckpointError, match="is a FIFO, not a regular file") as e:
        tc.restore(ckpt)
    assert e.value.file == path
    report = verify(ckpt)
    assert not report.ok and [p.where for p in report.problems] == [path]


@pytest.mark.timeout(30, method="thread")  # a hang ends the run: a blocked read cannot be interrupted
def test_a_fifo_manifest_is_refused_at_once(ckpt):
    os.unlink(ckpt / "manifest.json")
    os.mkfifo(ckpt / "manifest.json")
    with pytest.raises(tc.CorruptCheckpointError, match="is a FIFO") as e:
        tc.restore(ckpt)
    assert e.value.file == str(ckpt / "manifest.json")
    assert not verify(ckpt).ok


@pytest.mark.timeout(30, method="thread")  # a hang ends the run: a blocked read cannot be interrupted
def test_a_manifest_linked_to_a_device_is_refused(ckpt):
    os.unlink(ckpt / "manifest.json")
    os.symlink("/dev/zero", ckpt / "manifest.json")
    with pytest.raises(tc.CorruptCheckpointError, match="is a character device") as e:
        tc.restore(ckpt)
    assert e.value.file == str(ckpt / "manifest.json")


@pytest.mark.timeout(30, method="thread")  # a hang ends the run: a blocked read cannot be interrupted
def test_a_huge_manifest_is_refused_before_it_is_read(ckpt):
    """A sparse 2 GiB file: reading it would take 2 GiB of memory."""
    with storage.Store(storage.location(ckpt)) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="more than the 10 "):
            store.read_file("manifest.json", max_bytes=10)
    os.truncate(ckpt / "manifest.json", 2 * MAX_WHOLE_FILE_BYTES)
    with pytest.raises(tc.CorruptCheckpointError, match="more than the 1073741824"):
        tc.restore(ckpt)


def test_a_piece_larger_than_its_file_allocates_nothing(ckpt):
    """What a manifest claiming a 1 TiB piece asks for: refused from the file's size."""
    with storage.Store(storage.location(ckpt)) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="truncated"):
            store.read(os.path.basename(data_file(ckpt)), 0, [1 << 40]).result()


@pytest.mark.parametrize("name", ["../../outside", "../outside", "/ABS/outside", "sub/../../outside", "", "."])
def test_names_outside_the_checkpoint_are_not_read(ckpt, name):
    outside = ckpt.parent.parent / "outside"
    outside.write_bytes(b"secret")
    (ckpt.parent / "outside").write_bytes(b"secret")
    name = name.replace("/ABS/outside", str(outside))
    with storage.Store(storage.location(ckpt)) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read(name, 0, [6]).result()
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read_file(name)
    with storage.Store(storage.location("memory://hostile/c")) as store:
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read_file(name)


def test_a_linked_name_reads_a_sibling_checkpoint_only(ckpt):
    """``../<sibling>/<file>``, the linked-checkpoint form, where the sibling is a checkpoint."""
    name = os.path.basename(data_file(ckpt))
    (ckpt.parent / "plain").mkdir()
    (ckpt.parent / "plain" / name).write_bytes(b"secret")
    with storage.Store(storage.location(ckpt.parent / "link")) as store:
        assert store.read(f"../c/{name}", 0, [8]).result()[0].tobytes() == (ckpt / name).read_bytes()[:8]
        with pytest.raises(tc.CorruptCheckpointError, match="outside checkpoint"):
            store.read(f"../plain/{name}", 0, [6]).result()


def test_a_restored_array_keeps_its_values_when_the_file_is_overwritten(ckpt):
    numpy_out = tc.restore(ckpt)
    on_device = tc.restore(ckpt, {"w": jax.ShapeDtypeStruct((64, 64), np.float32), "b": np.zeros(7, np.int32)})
    path = data_file(ckpt)
    with open(path, "r+b") as f:
        f.write(b"\xff" * os.path.getsize(path))
    for out in (numpy_out, on_device):
        assert np.array_equal(bits(out["w"]), bits(TREE["w"])) and np.array_equal(out["b"], TREE["b"])


TRUNCATE = textwrap.dedent("""
    import os, sys
    import jax, numpy as np
    import tpu_ckpt as tc
    path = sys.argv[1]
    expected = np.arange(1 << 20, dtype=np.float32)
    tc.save(path, {"w": expected})
    numpy_out = tc.restore(path)["w"]
    on_device = tc.restore(path, {"w": jax.ShapeDtypeStruct(expected.shape, expected.dtype)})["w"]
    name = next(n for n in os.listdir(path) if n.endswith(".safetensors"))
    os.truncate(os.path.join(path, name), 0)
    os.unlink(os.path.join(path, name))
    assert np.array_equal(numpy_out, expected) and np.array_equal(np.asarray(on_device), expected)
    print("intact")
""")


def test_a_restored_array_survives_its_file_being_truncated_and_deleted(tmp_path):
    """In a child process: with arrays mapped from the file, reading them would be SIGBUS."""
    run = subprocess.run([sys.executable, "-c", TRUNCATE, str(tmp_path / "c")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0 and run.stdout.strip() == "intact", (run.returncode, run.stderr[-2000:])
