"""Deleting only what is ours (issue #29): object keys under a run directory whose names hold
``..``, ``.`` or empty segments, a leading ``/``, or lead into another bucket, are never
joined into a path, read or deleted, whatever deletes (``tpu-ckpt gc``, retention, the
manager's leftover cleanup) or reads (``tpu-ckpt verify``, ``ls``) the directory.

Every test runs on the GCS emulator and on moto, behind a FaultyProxy that records every
request tpu_ckpt makes, and compares every object of both buckets, bytes included, before
and after.
"""

import posixpath
import urllib.parse

import numpy as np
import pytest

import tpu_ckpt as tc
from tests.support.object_stores import BUCKET, Bucket
from tpu_ckpt import cli

pytestmark = [pytest.mark.emulator]


def escaping(step: str, other_prefix: str) -> list[str]:
    """Keys (relative to the run directory) under ``step`` that an HTTP layer would resolve
    elsewhere: out of the run, to the bucket's root, into the other bucket (as an S3
    path-style URL and as a GCS JSON API URL resolve them), or onto another object."""
    return [
        f"{step}/../../victim/manifest.json",
        f"{step}/../../../victim-root-{other_prefix}",
        f"{step}/../../../../{BUCKET}/{other_prefix}/victim.bin",
        f"{step}/../../../../../../{BUCKET}/o/{other_prefix}/victim.bin",
        f"{step}/./d00000-00000.safetensors",
        f"{step}//d00000-00000.safetensors",
        f"{step}/sub/../manifest.json",
    ]


def snapshot(bucket: Bucket) -> dict[tuple[str, str], bytes]:
    """Every object of both buckets (the run's own and the other one), with its bytes."""
    return {
        (name, key): bucket.server.get(name, key)
        for name in (bucket.name, BUCKET)
        for key in bucket.server.keys(name, "")
    }


def outside(requests, bucket: Bucket) -> list[str]:
    """The requests tpu_ckpt made for anything but the run directory's objects (or a listing
    within its prefix), with the paths as a server resolves them."""
    run = f"{bucket.prefix}/run/"
    return [f"{r.method} {r.path}" for r in requests if not run_object(r.path, bucket.name, run)]


def run_object(request: str, name: str, run: str) -> bool:
    """Whether an S3 path-style or GCS JSON API request is for an object under ``run`` in
    bucket ``name``, or lists no more than ``run``."""
    path, _, query = request.partition("?")
    args = {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}
    resolved = posixpath.normpath(urllib.parse.unquote(path))
    for api in ("/download/storage/v1/b/", "/upload/storage/v1/b/", "/storage/v1/b/", "/"):
        if resolved.startswith(api):
            resolved = resolved[len(api) :]
            break
    if resolved in (name, f"{name}/o"):  # the bucket itself: a listing, an upload, S3's region
        key = args.get("name", args.get("prefix", args.get("startOffset")))
        return key is None and not query or key is not None and key.startswith(run)
    return resolved.startswith((f"{name}/{run}", f"{name}/o/{run}"))


@pytest.fixture
def run(faulty):
    """A run directory in a bucket reached only through a recording proxy, with objects
    outside it, in its bucket and in the other bucket, that nothing may touch."""
    proxy, bucket = faulty
    bucket.put("victim/manifest.json", b"victim")
    bucket.put("victim2/keep.bin", b"victim2")
    bucket.put("manifest.json", b"not the run's")
    bucket.server.put(bucket.name, f"victim-root-{bucket.prefix}", b"root")
    bucket.server.put(BUCKET, f"{bucket.prefix}/victim.bin", b"other bucket")
    bucket.server.put(BUCKET, f"o/{bucket.prefix}/victim.bin", b"other bucket, as a GCS path")
    return proxy, bucket


def plant(bucket: Bucket, step: str) -> list[str]:
    """Puts the escaping keys under ``step``; none on GCS, whose emulator stores no such name
    (it refuses ``..`` and drops ``.`` and empty segments, as a file system would)."""
    keys = escaping(step, bucket.prefix) if bucket.scheme == "s3" else []
    for key in keys:
        bucket.put(f"run/{key}", b"planted")
    return keys


def test_no_deleter_or_reader_touches_an_object_outside_the_run(run, caplog):
    proxy, bucket = run
    tree = {"w": np.arange(12, dtype=np.float32)}
    with tc.CheckpointManager(bucket.url("run"), max_to_keep=1) as manager:
        manager.save(1, tree)
        plant(bucket, "step_1")  # retention removes step_1 at the next save
        plant(bucket, "step_5")  # a leftover the manager removes
        for key in ("../manifest.json", "./manifest.json", "/manifest.json") if bucket.scheme == "s3" else ():
            bucket.put(f"run/{key}", b"planted")  # would make '..', '.' or '' look like checkpoints
        before = snapshot(bucket)
        manager.save(2, tree)
        planted = plant(bucket, "step_8") + plant(bucket, "model.tmp-0a1b2c")
        before = {**before, **{k: v for k, v in snapshot(bucket).items() if k not in before}}
        statuses = [cli.main([command, bucket.url("run")]) for command in ("gc", "verify", "ls")]
        steps = manager.all_steps()
        restored = manager.restore(2)["w"]
    after = snapshot(bucket)
    run_keys = f"{bucket.prefix}/run/"
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert {k for k in changed if not (k[0] == bucket.name and k[1].startswith(run_keys))} == set()
    assert outside(proxy.requests, bucket) == []
    assert statuses == [0, 0, 0] and steps == [2]
    np.testing.assert_array_equal(restored, tree["w"])
    # The planted keys are not deleted either: no name with such segments is ever sent.
    assert all(after.get((bucket.name, f"{run_keys}{key}")) == b"planted" for key in planted)
    assert not planted or "refused" in caplog.text
