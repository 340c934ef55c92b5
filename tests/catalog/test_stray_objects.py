"""`tpu-ckpt gc` removes, from each committed checkpoint on an object store, the objects of a
save that never committed it (a writer that stalled for good: issue #23), and nothing else:
every object a manifest, a retired step's referenced.json or a kept step's reference names
stays, a stray beside a staging marker still in its grace period stays, and the checkpoint
restores bit-exactly afterwards. Against moto and gcp-storage-emulator (tests/support/object_stores.py)."""

import json
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tpu_ckpt.catalog import remove_strays, strays, verify
from tpu_ckpt.cli import main
from tpu_ckpt.format import MANIFEST_FILE, REFERENCED_FILE, token_of

pytestmark = pytest.mark.emulator

STALLED = "5c0e9b21d4aa"  # the token of the save that stalled


def state(mesh42, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(mesh42, P("data", "model")))
    return {"w": w, "ids": rng.integers(0, 1 << 40, 300), "step": 1}


def objects(bucket, step: str) -> set[str]:
    return {key.split("/", 2)[2] for key in bucket.keys(f"run/{step}/")}


def plant_stalled_writer(bucket, step: str) -> set[str]:
    """What a writer of ``step`` that stalled for good leaves: every object the committing
    save wrote under its token, under the stalled save's token instead (same sizes and
    layout), plus its staged index. Its staging marker went with the commit."""
    planted = set()
    for name in objects(bucket, step):
        token = token_of(name)
        if token is not None:
            planted.add(name.replace(f"-{token}-", f"-{STALLED}-"))
            bucket.put(f"run/{step}/{name.replace(f'-{token}-', f'-{STALLED}-')}", bucket.get(f"run/{step}/{name}"))
    index = f"0bad-{STALLED}-index-00001.bin"
    bucket.put(f"run/{step}/{index}", b"rows of a process that never finished")
    return planted | {index}


def mark(bucket, step: str, started: float) -> None:
    marker = {"final": step, "token": STALLED, "started": started, "grace_s": 3600}
    bucket.put(f"run/{step}/staging.json", json.dumps(marker).encode())


def named(bucket, step: str) -> set[str]:
    """What step's manifest names in its own prefix (data files, piece tables)."""
    doc = json.loads(bucket.get(f"run/{step}/{MANIFEST_FILE}"))
    return {name for name, _ in doc["files"] + doc.get("tables", []) if not name.startswith("../")}


def assert_bit_exact(restored, expected) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e), strict=True)


def test_gc_removes_a_stalled_writers_objects_and_the_checkpoint_restores_bit_exactly(bucket, mesh42, capsys):
    saved = state(mesh42)
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, saved)
    committed = objects(bucket, "step_1") | {"notes.txt"}
    bucket.put("run/step_1/notes.txt", b"a user's own file: no token, never removed")
    planted = plant_stalled_writer(bucket, "step_1")
    assert len(planted) >= 4 and named(bucket, "step_1") <= committed

    assert main(["gc", "--dry-run", bucket.url("run")]) == 0
    line = (
        f"would remove {len(planted)} stray objects in step_1 (written by a save {STALLED} that never committed it)\n"
    )
    assert capsys.readouterr().out == line
    assert objects(bucket, "step_1") == committed | planted

    assert main(["gc", bucket.url("run")]) == 0
    assert capsys.readouterr().out == line.replace("would remove", "removed")
    assert objects(bucket, "step_1") == committed
    assert_bit_exact(tc.restore(bucket.url("run/step_1")), jax.tree.map(np.asarray, saved))
    assert verify(bucket.url("run/step_1")).ok
    assert main(["gc", bucket.url("run")]) == 0
    assert capsys.readouterr().out == f"no leftovers in {bucket.url('run')}\n"


def test_strays_beside_a_staging_marker_in_its_grace_period_are_kept_until_it_ends(bucket, mesh42, capsys):
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, state(mesh42))
    committed = objects(bucket, "step_1")
    planted = plant_stalled_writer(bucket, "step_1")
    mark(bucket, "step_1", started=time.time())  # a save of step_1 that started a moment ago

    [found] = strays(bucket.url("run"))
    assert found.name == "step_1" and set(found.files) == planted and found.tokens == [STALLED]
    assert found.held_until is not None and found.held_until > time.time() + 3000
    assert main(["gc", bucket.url("run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"kept {len(planted)} stray objects in step_1 (a save that may still be running; removable in "
    )
    assert objects(bucket, "step_1") == committed | planted | {"staging.json"}

    mark(bucket, "step_1", started=0)  # the same save, its grace period long over
    assert main(["gc", bucket.url("run")]) == 0
    assert capsys.readouterr().out.startswith(f"removed {len(planted)} stray objects in step_1")
    assert objects(bucket, "step_1") == committed | {"staging.json"}
    tc.restore(bucket.url("run/step_1"))


def test_an_incremental_runs_referenced_files_are_never_removed(bucket, capsys):
    base = {"w": np.arange(4096, dtype=np.float32)}
    states = {step: {"base": base, "t": np.full(4, step, np.float32)} for step in range(3)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=2, incremental=True) as manager:
        for step, saved in states.items():
            manager.save(step, saved)
    kept = {step: objects(bucket, step) for step in ("step_0", "step_1", "step_2")}
    assert REFERENCED_FILE in kept["step_0"] and MANIFEST_FILE not in kept["step_0"]  # retired: 1 and 2 read it
    planted = {step: plant_stalled_writer(bucket, step) for step in kept}

    found = {s.name: set(s.files) for s in strays(bucket.url("run"))}
    assert found == planted
    assert main(["gc", bucket.url("run")]) == 0
    assert capsys.readouterr().out.count("removed") == 3
    assert {step: objects(bucket, step) for step in kept} == kept
    for step in (1, 2):
        assert_bit_exact(tc.restore(bucket.url(f"run/step_{step}")), states[step])


def test_a_local_checkpoint_is_left_as_it_was(tmp_path, mesh42, capsys):
    """A local save stages in a directory of its own: nothing strays into a committed one."""
    with tc.CheckpointManager(tmp_path / "run", max_to_keep=None) as manager:
        manager.save(1, state(mesh42))
    user_file = tmp_path / "run" / "step_1" / f"0bad-{STALLED}-notes.txt"
    user_file.write_bytes(b"a name like a token's, in a local checkpoint")
    assert strays(tmp_path / "run") == []
    assert main(["gc", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out == f"no leftovers in {tmp_path / 'run'}\n"
    assert user_file.exists()


def test_strays_a_save_marks_after_they_were_listed_are_not_removed(bucket, mesh42):
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=None) as manager:
        manager.save(1, state(mesh42))
    planted = plant_stalled_writer(bucket, "step_1")
    found = strays(bucket.url("run"))
    assert [s.held_until for s in found] == [None]
    mark(bucket, "step_1", started=time.time())  # a save started between the listing and the removal
    assert remove_strays(bucket.url("run"), found) == []
    assert planted <= objects(bucket, "step_1")


def test_an_unreadable_referenced_json_keeps_its_steps_objects_and_gc_goes_on_with_the_rest(bucket, capsys, caplog):
    """A retired step's referenced.json nested 100,000 deep (a RecursionError to parse, before
    issue #39 a traceback that stopped gc): its step's objects are all kept, with a warning,
    and the other steps' strays are removed as usual."""
    base = {"w": np.arange(4096, dtype=np.float32)}
    states = {step: {"base": base, "t": np.full(4, step, np.float32)} for step in range(3)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=2, incremental=True) as manager:
        for step, saved in states.items():
            manager.save(step, saved)
    bucket.put(f"run/step_0/{REFERENCED_FILE}", b'{"files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    kept = {step: objects(bucket, step) for step in ("step_0", "step_1", "step_2")}
    planted = {step: plant_stalled_writer(bucket, step) for step in kept}

    assert {s.name: set(s.files) for s in strays(bucket.url("run"))} == {
        "step_1": planted["step_1"], "step_2": planted["step_2"]
    }
    assert main(["gc", bucket.url("run")]) == 0
    assert capsys.readouterr().out.count("removed") == 2
    assert f"{bucket.url('run')}/step_0 cannot be read: keeping every object in it" in caplog.text
    assert objects(bucket, "step_0") == kept["step_0"] | planted["step_0"]
    assert {step: objects(bucket, step) for step in ("step_1", "step_2")} == {s: kept[s] for s in ("step_1", "step_2")}
