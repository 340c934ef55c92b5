"""Issue #23's throttling targets on moto, behind the tests' fault-injecting proxy
(``tests/object_stores.FaultyProxy``), in one run:

- a 30 s storm of 429 answers to every upload during a save, and to every read during a
  restore: both must complete, bit-exactly;
- a 1 GiB save with 20% of requests answered 503 against the same save with none: the
  target is <= 2x the clean time.

``python benchmarks/object_store_faults.py [--storm-s 30] [--mib 1024]``; exits 1 if a target fails.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests/
from multitier_bench import start_moto  # noqa: E402 - scripts/: moto_server with the bucket "bench"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storm-s", type=float, default=30.0)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="tpu_ckpt_faults_")
    moto, endpoint = start_moto(scratch)
    from tests.support.object_stores import FaultyProxy

    proxy = FaultyProxy(endpoint)
    empty = os.path.join(scratch, "empty")  # no AWS profile files to look for (and log about)
    open(empty, "w").close()
    os.environ.update(AWS_ENDPOINT_URL=proxy.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                      AWS_CONFIG_FILE=empty, AWS_SHARED_CREDENTIALS_FILE=empty)
    try:
        failed = storms(proxy, args.storm_s) + flaky_save(proxy, args.mib)
    finally:
        proxy.close()
        moto.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


def storms(proxy, seconds: float) -> int:
    """A save during an upload storm and a restore during a read storm; returns the failures."""
    import tpu_ckpt as tc

    tree = {"w": np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32), "step": 7}
    options = tc.CheckpointOptions(sharding_callback=tc.MaxShardSizePolicy(1 << 20))
    uploads = lambda method, path: method in ("PUT", "POST")  # noqa: E731
    proxy.storm(429, seconds, uploads)
    started = time.monotonic()
    tc.save("s3://bench/storm", tree, options=options).wait()
    save_s = time.monotonic() - started
    proxy.storm(429, seconds, lambda method, path: method == "GET")
    started = time.monotonic()
    restored = tc.restore("s3://bench/storm")
    restore_s = time.monotonic() - started
    refused = sum(r.status == 429 for r in proxy.requests)
    exact = restored["w"].tobytes() == tree["w"].tobytes() and restored["step"] == 7
    print(f"{seconds:g} s 429 storm: save {save_s:.1f} s, restore {restore_s:.1f} s, {refused} requests refused, "
          f"bit-exact: {exact}  {'PASS' if exact else 'FAIL'}")
    return 0 if exact else 1


def flaky_save(proxy, mib: int) -> int:
    """The same save clean and with 20% of requests answered 503; returns the failures."""
    import tpu_ckpt as tc

    tree = {"w": np.random.default_rng(1).integers(0, 255, size=mib << 20, dtype=np.uint8)}
    times = {}
    for name, fraction in (("clean", 0.0), ("20% 503", 0.2)):
        if fraction:
            proxy.flaky(fraction, 503)
        started = time.monotonic()
        tc.save(f"s3://bench/flaky-{int(fraction * 100)}", tree).wait()
        times[name] = time.monotonic() - started
        proxy.calm()
    ratio = times["20% 503"] / times["clean"]
    ok = ratio <= 2.0
    print(f"{mib} MiB save: clean {times['clean']:.1f} s, 20% 503 {times['20% 503']:.1f} s, "
          f"{ratio:.2f}x (target <= 2x)  {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
