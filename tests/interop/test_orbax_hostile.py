"""Hostile or damaged Orbax checkpoints on import (issue #26): real checkpoints written by
orbax-checkpoint, in both its layouts (OCDBT, its default, and one zarr directory per
array), then damaged on disk. Each import must fail at once with a typed error naming the
Orbax checkpoint, and the array where one is at fault; leave nothing in DST (no staging
directory); and make ``tpu-ckpt import-orbax`` print one line of error and exit 2. Never a
hang, a dead process (``std::bad_alloc``, a crash in tensorstore's parser), or Orbax's or
tensorstore's own error."""

import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import tpu_ckpt as tc
from tpu_ckpt import cli

TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int32), "n": 3}
TPU_CKPT = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = pytest.mark.timeout(60, method="thread")  # a hang ends the run: a blocked read cannot be interrupted


def orbax_save(path, tree=TREE, ocdbt=True):
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt)).save(path, args=ocp.args.PyTreeSave(tree))
    return path


def edit_zarray(src, key, edit, ocdbt):
    """Rewrites array ``key``'s .zarray: a file of its own, or a key inside the OCDBT database."""
    if ocdbt:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{src}/"}).result()
        kv.write(f"{key}/.zarray", edit(kv.read(f"{key}/.zarray").result().value)).result()
    else:
        (src / key / ".zarray").write_bytes(edit((src / key / ".zarray").read_bytes()))


def with_shape(shape):
    return lambda data: json.dumps({**json.loads(data), "shape": shape}).encode()


def ocdbt_data_files(src):
    """The files of the OCDBT database: the .zarray of every array is in them too."""
    return sorted(glob.glob(f"{src}/d/*") + glob.glob(f"{src}/ocdbt.process_*/d/*"))


def replace_by_fifo(path):
    os.unlink(path)
    os.mkfifo(path)


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def corrupt(path):
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)


def deep_json(path):
    path.write_text('{"tree_metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")


# Each: the id, whether the checkpoint is OCDBT, the damage (given the checkpoint's path),
# what the error says, and the array it names (None: the checkpoint as a whole).
CASES = [
    ("fifo _METADATA", True, lambda s: replace_by_fifo(s / "_METADATA"),
     r"_METADATA is a FIFO, not a regular file", None),
    ("fifo chunk", False, lambda s: replace_by_fifo(s / "w" / "0.0"), r"w/0\.0 is a FIFO", None),
    ("fifo OCDBT data file", True, lambda s: [replace_by_fifo(p) for p in ocdbt_data_files(s)], "is a FIFO", None),
    ("/dev/zero as _METADATA", True, lambda s: (os.unlink(s / "_METADATA"), os.symlink("/dev/zero", s / "_METADATA")),
     r"_METADATA leads, through a symbolic link, to /dev/zero", None),
    ("chunk linked out", False, lambda s: (os.rename(s / "w" / "0.0", s.parent / "outside"),
                                           os.symlink(s.parent / "outside", s / "w" / "0.0")),
     r"w/0\.0 leads.* outside", None),
    ("deeply nested _METADATA", True, lambda s: deep_json(s / "_METADATA"),
     r"the metadata cannot be read \(RecursionError", None),
    ("missing chunk", False, lambda s: os.unlink(s / "w" / "0.0"), r"array 'w' cannot be read .*NOT_FOUND", "w"),
    ("missing OCDBT data files", True, lambda s: [os.unlink(p) for p in ocdbt_data_files(s)],
     r"the metadata cannot be read .*NOT_FOUND", None),
    ("truncated chunk", False, lambda s: truncate(s / "w" / "0.0"), r"array 'w' cannot be read .*Truncated", "w"),
    ("truncated OCDBT data files", True, lambda s: [truncate(p) for p in ocdbt_data_files(s)], "cannot be read", None),
    ("corrupted chunk", False, lambda s: corrupt(s / "w" / "0.0"), r"array 'w' cannot be read .*ZSTD", "w"),
    ("corrupted OCDBT data files", True, lambda s: [corrupt(p) for p in ocdbt_data_files(s)], "cannot be read", None),
    ("deleted manifest.ocdbt", True, lambda s: os.unlink(s / "manifest.ocdbt"), "the metadata cannot be read", None),
    ("wrong dtype", True, lambda s: edit_zarray(s, "w", lambda d: d.replace(b'"<f4"', b'"<f8"'), True),
     r"array 'w' cannot be read .*Not enough data", "w"),
    ("unsupported dtype", True, lambda s: edit_zarray(s, "w", lambda d: d.replace(b'"<f4"', b'"|O"'), True),
     r'the metadata cannot be read .*Unsupported zarr dtype: "\|O"', None),
    ("malformed .zarray", False, lambda s: edit_zarray(s, "w", lambda d: d[:30], False),
     r"w/\.zarray is not valid JSON", None),
    ("malformed .zarray in OCDBT", True, lambda s: edit_zarray(s, "w", lambda d: d[:30], True),
     r"'w/\.zarray' in .*manifest\.ocdbt is not valid JSON", None),
    (".zarray not an object", False, lambda s: edit_zarray(s, "w", lambda d: b"[1, 2]", False),
     "is not a JSON object", None),
    ("negative shape", True, lambda s: edit_zarray(s, "w", with_shape([-3, 4]), True), r'"w/\.zarray".*"shape"', None),
]


def assert_refused(src, dst, capsys, match, key=None):
    """The library's typed error, the command's one line, and nothing written."""
    with pytest.raises(tc.CorruptCheckpointError, match=match) as e:
        tc.import_orbax(src, dst)
    assert e.value.key == key
    assert str(src) in str(e.value) and e.value.file.startswith(str(src))
    assert os.listdir(dst.parent) == []
    capsys.readouterr()
    assert cli.main(["import-orbax", str(src), str(dst)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("tpu-ckpt: error: ") and str(src) in err, err
    assert os.listdir(dst.parent) == []


@HANG
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the closed loop's callbacks, see below
@pytest.mark.parametrize(("ocdbt", "damage", "match", "key"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_damaged_orbax_checkpoint_is_refused_with_a_typed_error(tmp_path, capsys, ocdbt, damage, match, key):
    src = orbax_save(tmp_path / "orbax", ocdbt=ocdbt)
    damage(src)
    (tmp_path / "out").mkdir()
    assert_refused(src, tmp_path / "out" / "tc", capsys, match, key)


def run_cli(src, dst):
    return subprocess.run([TPU_CKPT, "import-orbax", str(src), str(dst)], capture_output=True, text=True, timeout=120)


def assert_one_line_error(run, match):
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpu-ckpt: error: "), run.stderr[-2000:]
    assert match in lines[0], lines[0]


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "zarr"])
def test_a_4tib_array_declared_in_a_zarray_is_refused_before_orbax_allocates_it(tmp_path, ocdbt):
    """The command runs in its own process first: before the fix, tensorstore's failed
    allocation ended the process (std::bad_alloc) and left DST's staging directory behind."""
    src = orbax_save(tmp_path / "orbax", ocdbt=ocdbt)
    edit_zarray(src, "w", with_shape([1 << 40, 1]), ocdbt)
    (tmp_path / "out").mkdir()
    assert_one_line_error(run_cli(src, tmp_path / "out" / "tc"), "declares array 'w' as float32[1099511627776, 1]")
    assert os.listdir(tmp_path / "out") == []
    with pytest.raises(tc.CorruptCheckpointError, match=r"needs 4398\.0 GB of memory, more than") as e:
        tc.import_orbax(src, tmp_path / "out" / "tc", max_batch_bytes=1)
    assert e.value.key == "w" and e.value.file == str(src)
    assert os.listdir(tmp_path / "out") == []


SMALL_HOST = """
import resource, sys
import jax
import orbax.checkpoint
import tpu_ckpt as tc
jax.devices()  # its threads started before the limit
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
try:
    tc.import_orbax(sys.argv[1], sys.argv[2])
except tc.CorruptCheckpointError as e:
    print("refused:", e)
"""


def test_a_2gib_array_is_refused_where_the_process_may_have_1gib_more(tmp_path):
    """The bound is the memory this process can have, ``ulimit -v`` included, as on a
    smaller host: there, before the fix, 2 GiB declared was enough to end the process."""
    src = orbax_save(tmp_path / "orbax")
    edit_zarray(src, "w", with_shape([1 << 27, 4]), True)
    (tmp_path / "out").mkdir()
    run = subprocess.run([sys.executable, "-c", SMALL_HOST, str(src), str(tmp_path / "out" / "tc")],
                         capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.startswith("refused: "), run.stdout
    assert "declares array 'w' as float32[134217728, 4]" in run.stdout, run.stdout
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("ocdbt", [True, False], ids=["ocdbt", "zarr"])
def test_a_zarray_nested_too_deeply_for_tensorstore_is_refused_before_it_parses_it(tmp_path, ocdbt):
    """Arrays nested 200,000 deep crash tensorstore's JSON parser (SIGSEGV), so the command
    runs in its own process; the .zarray is checked before, in its file or in the OCDBT
    database."""
    src = orbax_save(tmp_path / "orbax", ocdbt=ocdbt)
    edit_zarray(src, "w", lambda data: b"[" * 200_000 + b"]" * 200_000, ocdbt)
    (tmp_path / "out").mkdir()
    says = ".zarray" + ("' in " if ocdbt else " is not valid JSON")
    assert_one_line_error(run_cli(src, tmp_path / "out" / "tc"), says)
    assert os.listdir(tmp_path / "out") == []


def test_the_command_prints_one_line_when_orbax_fails_on_one_array_of_several(tmp_path):
    """Orbax closes its event loop while tensorstore still opens the other arrays, whose
    callbacks then print "RuntimeError: Event loop is closed" tracebacks, at random."""
    tree = {f"a{i}": np.full((4, 4), i, np.float32) for i in range(32)}
    src = orbax_save(tmp_path / "orbax", tree)
    edit_zarray(src, "a7", lambda d: d.replace(b'"<f4"', b'"|O"'), True)
    for attempt in range(2):
        (tmp_path / f"out{attempt}").mkdir()
        assert_one_line_error(run_cli(src, tmp_path / f"out{attempt}" / "tc"), "Unsupported zarr dtype")


def manager_step(directory, step, tree, prefix=None):
    options = ocp.CheckpointManagerOptions(step_prefix=prefix) if prefix else None
    with ocp.CheckpointManager(directory, options=options) as manager:
        manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()


def test_only_orbax_step_names_are_steps(tmp_path):
    """``x_5`` and ``x_7`` beside ``5`` are not Orbax's steps (a manager writes plain
    numbers, or one ``step_prefix``): step 5 is ``5``, and there is no step 7."""
    other = {"w": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.int32), "n": 0}
    manager_step(tmp_path / "orbax", 5, TREE)
    manager_step(tmp_path / "elsewhere", 5, other, prefix="x")
    manager_step(tmp_path / "elsewhere", 7, other, prefix="x")
    for name in ("x_5", "x_7"):
        shutil.move(tmp_path / "elsewhere" / name, tmp_path / "orbax" / name)
    [report] = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert report.step == 5 and report.src == str(tmp_path / "orbax" / "5" / "default")
    restored = tc.restore(report.dst)
    np.testing.assert_array_equal(restored["w"], TREE["w"])
    assert sorted(os.listdir(tmp_path / "tc")) == ["step_5"]


def test_a_step_prefix_manager_still_imports_and_ambiguous_names_are_refused(tmp_path):
    for step in (0, 1):
        manager_step(tmp_path / "orbax", step, {**TREE, "n": step}, prefix="ckpt")
    reports = tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert [(r.step, os.path.basename(r.dst)) for r in reports] == [(0, "step_0"), (1, "step_1")]
    assert tc.restore(tmp_path / "tc" / "step_1")["n"] == 1

    manager_step(tmp_path / "other", 2, TREE, prefix="run")
    shutil.move(tmp_path / "other" / "run_2", tmp_path / "orbax" / "run_2")
    with pytest.raises(tc.CheckpointError, match=r"several prefixes \(ckpt_, run_\)"):
        tc.import_orbax(tmp_path / "orbax", tmp_path / "tc2")
    manager_step(tmp_path / "plain", 5, TREE)
    shutil.copytree(tmp_path / "plain" / "5", tmp_path / "plain" / "05")
    with pytest.raises(tc.CheckpointError, match="both 05 and 5 name step 5|both 5 and 05 name step 5"):
        tc.import_orbax(tmp_path / "plain", tmp_path / "tc3")
    assert not os.path.exists(tmp_path / "tc2") and not os.path.exists(tmp_path / "tc3")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_step_of_a_manager_stops_the_import_there_and_leaves_no_staging(tmp_path):
    """The steps before it stay converted (a rerun skips them); the damaged one is named."""
    for step in (0, 1):
        manager_step(tmp_path / "orbax", step, TREE)
    for path in ocdbt_data_files(tmp_path / "orbax" / "1" / "default"):
        corrupt(path)
    with pytest.raises(
        tc.CorruptCheckpointError, match=f"Orbax checkpoint {tmp_path / 'orbax' / '1' / 'default'} is damaged"
    ):
        tc.import_orbax(tmp_path / "orbax", tmp_path / "tc")
    assert os.listdir(tmp_path / "tc") == ["step_0"] and sorted(os.listdir(tmp_path)) == ["orbax", "tc"]
    np.testing.assert_array_equal(tc.restore(tmp_path / "tc" / "step_0")["w"], TREE["w"])
