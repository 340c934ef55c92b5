"""The tpu-ckpt command line, run as the installed console script (and as python -m tpu_ckpt).

Checkpoints are made here with the library; the commands only read them, in subprocesses
that need no JAX devices. Every assertion is on real output, exit statuses and files.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import axis_types, leaf, manifest

pytestmark = [pytest.mark.slow]  # every test runs the command in a fresh interpreter

TPU_CKPT = os.path.join(os.path.dirname(sys.executable), "tpu-ckpt")
READ_ONLY = ("ls", "inspect", "verify", "diff", "gc")
COMMANDS = (*READ_ONLY, "export")


def tpu_ckpt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([TPU_CKPT, *map(str, args)], capture_output=True, text=True, timeout=120)


def params(mesh, spec, w=None):
    w = np.arange(32, dtype=np.float32).reshape(8, 4) if w is None else w
    return {"w": jax.device_put(w, NamedSharding(mesh, spec)), "b": np.full(4, np.nan, np.float32)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, mesh42):
    """A CheckpointManager directory: steps 1 and 2 committed (params + Adam state), a linked
    serving export, the leftovers of two interrupted saves (one died between writing its
    manifest and the rename), and a directory of the user's own."""
    directory = tmp_path_factory.mktemp("cli") / "run"
    p = params(mesh42, P("data", "model"))
    state = {"params": p, "opt_state": optax.adam(1e-3).init(p), "step": 7}
    with tc.CheckpointManager(directory, max_to_keep=None) as manager:
        manager.save(1, state)
        manager.save(2, state)
    tc.export_for_serving(directory / "step_1", directory / "serving", link=True)
    for name in ("step_3", "step_4.tmp-0a1b2c", "notes"):
        os.makedirs(directory / name)
        (directory / name / "d00000-00000.safetensors").write_bytes(b"partial")
    shutil.copy(directory / "step_1" / "manifest.json", directory / "step_4.tmp-0a1b2c")
    marker = {"final": "step_4", "token": "0a1b2c", "started": 0, "grace_s": 3600}  # a save long dead
    (directory / "step_4.tmp-0a1b2c" / "staging.json").write_text(json.dumps(marker))
    return directory


def test_every_command_has_help():
    runs = {
        c: subprocess.Popen([TPU_CKPT, *c.split(), "--help"], stdout=subprocess.PIPE, text=True)
        for c in ("", *COMMANDS)
    }
    for command, process in runs.items():
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, command
        assert out.startswith(f"usage: tpu-ckpt {command}".rstrip()) and "exit status" in out


def test_python_dash_m_runs_the_same_cli(run_dir):
    result = subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "ls", run_dir], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "step_1" in result.stdout and result.stderr == ""


def test_ls_lists_steps_leftovers_sizes_and_file_counts(run_dir):
    result = tpu_ckpt("ls", run_dir)
    assert result.returncode == 0 and result.stderr == ""
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["STEP", "NAME", "STATE", "SIZE", "FILES", "AGE"]
    table = {row.split()[1]: row.split() for row in rows}
    # Steps first, then other checkpoints and leftovers by name; never the user's "notes".
    assert [row.split()[1] for row in rows] == ["step_1", "step_2", "serving", "step_3", "step_4.tmp-0a1b2c"]
    size = (
        sum(n for _, n in manifest(run_dir / "step_1")["files"]) + os.path.getsize(run_dir / "step_1" / "manifest.json")
    )
    files = len(os.listdir(run_dir / "step_1"))
    assert table["step_1"][:3] == ["1", "step_1", "committed"]
    assert table["step_1"][3:6] == [f"{size / 1e3:.1f}", "KB", str(files)]
    link = os.path.getsize(run_dir / "serving" / "manifest.json")  # a link's data is its source's
    assert table["serving"][:6] == ["-", "serving", "committed", f"{link / 1e3:.1f}", "KB", "2"]
    # A leftover's size is that of its files: a partial data file, and a manifest still staging.
    assert table["step_3"][:6] == ["-", "step_3", "uncommitted", "7", "B", "1"] and table["step_3"][6].endswith("s")
    staged = 7 + sum(os.path.getsize(run_dir / "step_4.tmp-0a1b2c" / f) for f in ("manifest.json", "staging.json"))
    assert table["step_4.tmp-0a1b2c"][:6] == ["-", "step_4.tmp-0a1b2c", "uncommitted", f"{staged / 1e3:.1f}", "KB", "3"]
    entries = {e["name"]: e for e in json.loads(tpu_ckpt("ls", run_dir, "--json").stdout)}
    assert entries["step_2"]["step"] == 2
    assert entries["step_2"]["nbytes"] == size and entries["step_2"]["files"] == files
    assert entries["step_4.tmp-0a1b2c"]["committed"] is False and entries["step_4.tmp-0a1b2c"]["nbytes"] == staged


def test_inspect_shows_the_tree_with_slot_flags(run_dir):
    result = tpu_ckpt("inspect", run_dir / "step_1")
    assert result.returncode == 0
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line}
    assert rows["params/w"].split() == [
        "params/w", "[8,", "4]", "float32", "data=4,model=2", "P(data,model)", "no", "128", "B"
    ]
    assert rows["opt_state/0/mu/w"].split()[-3:] == ["yes", "128", "B"]
    assert rows["step"].split() == ["step", "int", "=", "7"]
    assert "8 leaves (7 arrays, 4 slots)" in result.stdout


def test_inspect_json(run_dir):
    result = tpu_ckpt("inspect", run_dir / "step_1", "--json")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    leaves = {entry["key"]: entry for entry in doc["leaves"]}
    assert leaves["params/w"] == {
        "key": "params/w", "kind": "array", "shape": [8, 4], "dtype": "float32", "is_slot": False, "nbytes": 128,
        "sharding": {
            "type": "NamedSharding", "mesh": {"data": 4, "model": 2}, "spec": ["data", "model"],
            **axis_types(jax.make_mesh((4, 2), ("data", "model"))),
        },
    }
    assert [k for k, e in leaves.items() if e.get("is_slot")] == [
        "opt_state/0/mu/b", "opt_state/0/mu/w", "opt_state/0/nu/b", "opt_state/0/nu/w"
    ]
    assert leaves["opt_state/0/count"]["shape"] == [] and leaves["opt_state/0/count"]["dtype"] == "int32"
    assert leaves["step"] == {"key": "step", "kind": "value", "value": 7}
    assert doc["nbytes"] == 3 * (128 + 16) + 4  # params, mu and nu, and Adam's count
    assert doc["files"] == len(manifest(run_dir / "step_1")["files"])


def test_verify_passes_a_sound_checkpoint_quietly_when_not_a_tty(run_dir):
    result = tpu_ckpt("verify", run_dir / "step_1")
    assert result.returncode == 0
    assert result.stdout.startswith(f"ok: {run_dir / 'step_1'}: 8 leaves")
    assert result.stderr == ""  # no progress bar into a pipe


def test_verify_lists_every_problem_with_file_and_key(run_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "step_1", ckpt)
    truncated, deleted = leaf(ckpt, "params/w")["pieces"][0], leaf(ckpt, "params/b")["pieces"][0]
    flipped = next(
        p for p in leaf(ckpt, "opt_state/0/mu/w")["pieces"] if p["file"] not in (truncated["file"], deleted["file"])
    )
    os.truncate(ckpt / truncated["file"], truncated["offset"] + 1)
    with open(ckpt / flipped["file"], "r+b") as f:
        f.seek(flipped["offset"] + 3)
        byte = f.read(1)
        f.seek(flipped["offset"] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(ckpt / deleted["file"])
    result = tpu_ckpt("verify", ckpt)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"missing: {ckpt / deleted['file']} (key params/b): data file does not exist" in lines
    assert any(line.startswith(f"truncated: {ckpt / truncated['file']} (key") and "params/w" in line for line in lines)
    where = ",".join(f"{a}:{b}" for a, b in flipped["slice"])
    assert (
        f"crc32c: {ckpt / flipped['file']} (key opt_state/0/mu/w): piece [{where}] does not match its crc32c" in lines
    )
    assert lines[-1].startswith(f"FAILED: {ckpt}: 8 leaves") and lines[-1].endswith("3 problems")
    assert "Traceback" not in result.stderr


def test_verify_reports_an_uncommitted_checkpoint(run_dir):
    result = tpu_ckpt("verify", run_dir / "step_3")
    assert result.returncode == 1 and result.stdout.startswith("uncommitted: ")


@pytest.fixture(scope="module")
def changed(run_dir, mesh24):
    """Step 1 of run_dir saved again on another mesh, with one element of params/w changed."""
    directory = run_dir.parent / "changed"
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    w[5, 2] = -1
    p = params(mesh24, P(None, "model"), w)
    opt_state = optax.adam(1e-3).init(params(mesh24, P("data", "model")))
    tc.save(directory, {"params": p, "opt_state": opt_state, "step": 7}).wait()
    return directory


def test_diff_values_finds_exactly_the_leaf_that_differs(run_dir, changed):
    result = tpu_ckpt("diff", run_dir / "step_1", changed, "--values")
    assert result.returncode == 1 and result.stderr == ""
    # w[5, 2] was 22, is -1; the NaNs in params/b are equal.
    assert result.stdout.splitlines() == [
        "~  params/w  data differs in 1 of 32 elements, max abs diff 23", "1 difference"
    ]
    same = tpu_ckpt("diff", run_dir / "step_1", run_dir / "step_2", "--values")
    assert same.returncode == 0 and same.stdout == "no differences\n"


def test_diff_structure(run_dir, mesh42):
    other = run_dir.parent / "restructured"
    p = {"w": np.zeros((8, 8), np.float32), "b": np.zeros(4, np.float16), "new": np.ones(2, np.int32)}
    tc.save(other, {"params": p, "step": 8}).wait()
    result = tpu_ckpt("diff", run_dir / "step_1", other)
    assert result.returncode == 1
    *changes, summary = result.stdout.splitlines()
    changes = [" ".join(line.split()) for line in changes]
    assert changes == [  # in tree order, then what only B has
        *(f"- opt_state/0/{k} {d}" for k, d in [("count", "int32[]"), ("mu/b", "float32[4]"), ("mu/w", "float32[8, 4]"),
                                                 ("nu/b", "float32[4]"), ("nu/w", "float32[8, 4]")]),
        "~ params/b dtype float32 -> float16",
        "~ params/w shape [8, 4] -> [8, 8]",
        "~ step value 7 -> 8",
        "+ params/new int32[2]",
    ]
    assert summary == "9 differences in structure (add --values to compare the data)"


def test_gc_dry_run_removes_nothing(run_dir):
    before = sorted(os.listdir(run_dir))
    result = tpu_ckpt("gc", run_dir, "--dry-run")
    assert result.returncode == 0
    staged = 7 + sum(os.path.getsize(run_dir / "step_4.tmp-0a1b2c" / f) for f in ("manifest.json", "staging.json"))
    assert result.stdout.splitlines() == [
        "would remove step_3 (uncommitted, 1 file, 7 B)",
        f"would remove step_4.tmp-0a1b2c (uncommitted, 3 files, {staged / 1e3:.1f} KB)",
    ]
    assert sorted(os.listdir(run_dir)) == before


def test_gc_removes_leftovers_only(run_dir, tmp_path):
    directory = tmp_path / "run"
    shutil.copytree(run_dir, directory)
    result = tpu_ckpt("gc", directory)
    assert result.returncode == 0 and result.stdout.splitlines()[0] == "removed step_3 (uncommitted, 1 file, 7 B)"
    assert sorted(os.listdir(directory)) == ["notes", "serving", "step_1", "step_2"]
    assert tc.CheckpointManager(directory).all_steps() == [1, 2]
    assert tpu_ckpt("verify", directory / "step_2").returncode == 0
    assert tpu_ckpt("gc", directory).stdout == f"no leftovers in {directory}\n"


NO_JAX = """
import json, sys
from tpu_ckpt import cli
status = cli.main(json.loads(sys.argv[1]))
print("STATUS", status, "JAX", "jax" in sys.modules)
"""


@pytest.mark.parametrize("command", READ_ONLY)
def test_the_read_only_commands_never_import_jax(run_dir, command):
    """JAX's import is most of a second; these commands read manifests and bytes only."""
    args = {
        "ls": [run_dir], "inspect": [run_dir / "step_1"], "verify": [run_dir / "step_1"],
        "diff": [run_dir / "step_1", run_dir / "step_2", "--values"], "gc": [run_dir, "--dry-run"],
    }[command]
    result = subprocess.run(
        [sys.executable, "-c", NO_JAX, json.dumps([command, *map(str, args)])],
        capture_output=True, text=True, timeout=120,
    )
    assert result.stdout.splitlines()[-1] == "STATUS 0 JAX False", result.stdout + result.stderr


def test_export_writes_params_only(run_dir, tmp_path):
    result = tpu_ckpt("export", run_dir / "step_1", tmp_path / "serving", "--dtype", "bfloat16", "--max-shard-size", 64)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'serving'}: 72 B in ")  # 64 + 8 B of bfloat16
    out = tc.restore(tmp_path / "serving")
    assert set(out) == {"w", "b"} and out["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["w"].astype(np.float32), np.arange(32, dtype=np.float32).reshape(8, 4))
    assert len(manifest(tmp_path / "serving")["files"]) > 1  # re-cut into files of at most 64 bytes


def test_export_link_copies_no_data(run_dir, tmp_path):
    source = tmp_path / "step_2"
    shutil.copytree(run_dir / "step_2", source)
    result = tpu_ckpt("export", source, tmp_path / "serving", "--link", "-v")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'serving'}: a link to {source}, no data copied in ")
    assert "linked" in result.stderr  # -v: the library's log
    assert sorted(os.listdir(tmp_path / "serving")) == ["manifest.json", "pieces-00000.bin"]
    assert set(tc.restore(tmp_path / "serving")) == {"w", "b"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--subtree", "nope"], "subtree 'nope' is not in checkpoint"),
        (["--dtype", "int8"], "dtype must be a float type"),
        (["--dtype", "nonsense"], "--dtype 'nonsense' is not a dtype"),
        (["--link", "--dtype", "bfloat16"], "cannot also change the dtype"),
    ],
)
def test_export_errors_are_one_line(run_dir, tmp_path, args, message):
    result = tpu_ckpt("export", run_dir / "step_1", tmp_path / "serving", *args)
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("tpu-ckpt: error: ") and message in result.stderr
    assert not os.path.exists(tmp_path / "serving")


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "diff"])
def test_a_missing_path_is_one_line_no_traceback(command, tmp_path):
    missing = tmp_path / "nope"
    result = tpu_ckpt(command, missing, *([missing] if command == "diff" else []))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("tpu-ckpt: error: ") and str(missing) in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_directory_of_checkpoints_given_to_diff_is_named_as_such(run_dir):
    """The library's own message (tests/test_manager_dirs.py), not "an interrupted save"."""
    result = tpu_ckpt("diff", run_dir, run_dir / "step_1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"tpu-ckpt: error: {run_dir} is a directory of checkpoints, not a checkpoint: "
        "it holds step_1, step_2, serving. "
        f'Name one of them, e.g. tc.restore("{run_dir}/step_2") or tc.CheckpointManager("{run_dir}").restore(2).\n'
    )


def test_inspect_of_a_manager_directory_shows_its_latest_step(run_dir):
    result = tpu_ckpt("inspect", run_dir)
    assert result.returncode == 0
    assert result.stdout == tpu_ckpt("inspect", run_dir / "step_2").stdout
    assert result.stderr == f"tpu-ckpt: {run_dir} is a directory of checkpoints; showing the latest, {run_dir}/step_2\n"
    assert json.loads(tpu_ckpt("inspect", run_dir, "--json").stdout)["path"] == f"{run_dir}/step_2"


def test_verify_of_a_manager_directory_verifies_every_checkpoint_in_it(run_dir, tmp_path):
    result = tpu_ckpt("verify", run_dir)
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert [line.split(":")[:2] for line in lines[:3]] == [
        ["ok", f" {run_dir}/{name}"] for name in ("step_1", "step_2", "serving")
    ]
    assert lines[3:] == [f"ok: all 3 checkpoints in {run_dir}"]
    directory = tmp_path / "run"
    shutil.copytree(run_dir, directory)
    piece = leaf(directory / "step_2", "params/w")["pieces"][0]
    os.truncate(directory / "step_2" / piece["file"], piece["offset"] + 1)
    result = tpu_ckpt("verify", directory)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ok: {directory}/step_1") and lines[-2].startswith(f"ok: {directory}/serving")
    assert any(line.startswith(f"truncated: {directory}/step_2/{piece['file']}") for line in lines)
    assert lines[-1] == f"FAILED: 1 of 3 checkpoints in {directory}: step_2"


def test_global_flags_are_accepted_after_the_command(run_dir):
    for args in (
        ["-v", "verify", run_dir / "step_1"], ["verify", "-v", run_dir / "step_1"],
        ["verify", run_dir / "step_1", "--verbose"],
    ):
        result = tpu_ckpt(*args)
        assert result.returncode == 0 and result.stdout.startswith("ok: "), args
        assert "tpu_ckpt: verified" in result.stderr, args  # the library's log
    assert tpu_ckpt("verify", run_dir / "step_1").stderr == ""
    version = tpu_ckpt("ls", "--version")
    assert version.returncode == 0 and version.stdout == f"tpu-ckpt {tc.__version__}\n"


def test_ls_of_a_directory_without_checkpoints_fails_and_names_the_subdirectories_that_hold_some(tmp_path):
    for name in ("a/step_1", "a/step_2", "b/step_5", "b/step_6.tmp-0a1b2c"):
        tc.save(tmp_path / "top" / name, {"step": 1}).wait()
    os.makedirs(tmp_path / "top" / "notes")
    result = tpu_ckpt("ls", tmp_path / "top")
    assert result.returncode == 1 and result.stderr == ""
    assert [line.split() for line in result.stdout.splitlines()] == [
        ["no", "checkpoints", "in", str(tmp_path / "top")],
        ["these", "subdirectories", "hold", "some:"],
        [f"{tmp_path}/top/a", "2", "checkpoints"],
        [f"{tmp_path}/top/b", "1", "checkpoint"],  # a staging directory is no checkpoint
    ]
    as_json = tpu_ckpt("ls", tmp_path / "top", "--json")
    assert as_json.returncode == 1 and json.loads(as_json.stdout) == [] and f"{tmp_path}/top/a" in as_json.stderr
    os.makedirs(tmp_path / "empty")
    empty = tpu_ckpt("ls", tmp_path / "empty")
    assert empty.returncode == 1 and empty.stdout == f"no checkpoints in {tmp_path / 'empty'}\n"


def test_progress_bar_is_drawn_on_a_terminal(run_dir):
    controller, terminal = os.openpty()
    try:
        process = subprocess.Popen(
            [TPU_CKPT, "verify", run_dir / "step_1"], stdout=subprocess.PIPE, stderr=terminal, text=True
        )
        os.close(terminal)
        out, _ = process.communicate(timeout=120)
        drawn = _read_all(controller)
    finally:
        os.close(controller)
    assert process.returncode == 0 and out.startswith("ok: ")
    assert "\rverifying [" in drawn and "100%" in drawn and drawn.endswith("\r\n")


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()



@pytest.mark.emulator
def test_ls_verify_and_gc_work_on_object_store_urls(bucket, mesh42):
    """Through the GCS and S3 emulators of tests/support/object_stores.py (the subprocess inherits
    the environment that points tensorstore at them)."""
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, {"params": params(mesh42, P("data", "model")), "step": 1})
    bucket.put("run/step_2/d00000-00000.safetensors", b"partial")
    raw = bucket.get("run/step_1/manifest.json")
    size = sum(n for _, n in json.loads(raw)["files"]) + len(raw)
    rows = [line.split() for line in tpu_ckpt("ls", bucket.url("run")).stdout.splitlines()[1:]]
    assert rows == [
        ["1", "step_1", "committed", f"{size / 1e3:.1f}", "KB", "11", "-"],
        ["-", "step_2", "uncommitted", "-", "1", "-"],
    ]
    verified = tpu_ckpt("verify", bucket.url("run/step_1"))
    assert verified.returncode == 0 and verified.stdout.startswith(f"ok: {bucket.url('run/step_1')}: 3 leaves")
    assert tpu_ckpt("gc", bucket.url("run")).stdout == "removed step_2 (uncommitted, 1 file)\n"
    assert not [key for key in bucket.keys() if not key.startswith("run/step_1/")]



# Linux carries a process's peak RSS over fork and exec, so the script is started from a
# small interpreter: started from pytest it would report pytest's own peak.
_PEAK_RSS = (
    "import os, sys; pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ); print(os.wait4(pid, 0)[2].ru_maxrss)"
)


def peak_rss(*args) -> int:
    """The peak RSS, in bytes, of one run of the console script."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, TPU_CKPT, *map(str, args)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.splitlines()[-1]) * 1024


def test_diff_values_memory_does_not_grow_with_the_checkpoints(tmp_path, mesh42, mesh24):
    leaves = {f"w{i}": np.random.default_rng(i).standard_normal((1024, 4096), np.float32) for i in range(4)}
    for name, mesh in (("a", mesh42), ("b", mesh24)):  # 64 MB each, in 2 MB pieces cut differently
        sharding = NamedSharding(mesh, P("data", "model"))
        tc.save(tmp_path / name, {k: jax.device_put(v, sharding) for k, v in leaves.items()}).wait()
    structure = peak_rss("diff", tmp_path / "a", tmp_path / "b")
    grown = peak_rss("diff", tmp_path / "a", tmp_path / "b", "--values") - structure
    assert grown < 40e6  # a few pieces (and allocator slack), not the 128 MB compared


def test_diff_compares_bits_of_every_dtype(tmp_path, mesh42):
    """The library function behind diff --values (in-process: no script start-up needed)."""
    import ml_dtypes

    from tpu_ckpt.catalog import diff

    def tree(nan_payload, zero):
        nan = np.array([np.nan, 1.0])
        nan.view(np.uint64)[0] += nan_payload
        return {
            "scalar": np.float32(1.5), "empty": np.zeros((0, 3), np.float32),
            "int4": np.arange(8).astype(ml_dtypes.int4),
            "bf16": jax.device_put(np.ones((8, 4), ml_dtypes.bfloat16), NamedSharding(mesh42, P("data", "model"))),
            "nan": nan, "zero": np.array([zero]), "c128": np.array([1 + 2j]),
        }

    tc.save(tmp_path / "a", tree(0, 0.0)).wait()
    tc.save(tmp_path / "b", tree(0, 0.0)).wait()
    tc.save(tmp_path / "c", tree(1, -0.0)).wait()  # another NaN payload, and -0.0 == 0.0 but not bitwise
    assert diff(tmp_path / "a", tmp_path / "b", values=True) == []
    changes = diff(tmp_path / "a", tmp_path / "c", values=True)
    assert [(c.kind, c.key, c.differing, c.elements) for c in changes] == [
        ("data", "nan", 1, 2), ("data", "zero", 1, 1)
    ]
    assert np.isnan(changes[0].max_abs_diff) and changes[1].max_abs_diff == 0.0  # -0.0 vs 0.0: other bits, same value


def test_diff_values_counts_and_measures_across_differently_cut_pieces(tmp_path, mesh42, mesh24):
    from tpu_ckpt.catalog import diff

    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    changed = w.copy()
    changed[[0, 3, 7], [1, 4, 7]] += [0.5, -2.0, 1e3]
    i = np.array([-128, 0, 127], np.int8)
    tc.save(tmp_path / "a", {"w": jax.device_put(w, NamedSharding(mesh42, P("data", "model"))), "i": i}).wait()
    tc.save(
        tmp_path / "b", {"w": jax.device_put(changed, NamedSharding(mesh24, P("data", "model"))), "i": i[::-1]}
    ).wait()
    changes = diff(tmp_path / "a", tmp_path / "b", values=True)
    assert [(c.key, c.differing, c.elements, c.max_abs_diff) for c in changes] == [
        ("i", 2, 3, 255.0), ("w", 3, 64, 1e3),  # 127 - -128 measured wide, not wrapped in int8
    ]


def test_a_key_utf8_cannot_encode_is_printed_escaped(tmp_path):
    """A dict key holding a lone surrogate is a legal Python string and saves; the command
    prints it escaped rather than stopping with a codec error."""
    tc.save(tmp_path / "c", {"odd\ud800": np.ones(2, np.float32)}).wait()
    done = subprocess.run(
        [sys.executable, "-m", "tpu_ckpt", "inspect", str(tmp_path / "c")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "odd\\ud800" in done.stdout
