"""Device-to-host and host-to-device bandwidth of JAX's default backend: the floor a save's
snapshot and a restore's placement cannot beat on an accelerator (scripts/accelerator_check.sh).

Prints one line per direction (GB/s, best of --reps) and, with --json, writes them to a file.
"""

import argparse
import json
import time

import jax
import numpy as np


def best_seconds(operation, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return min(times)


def bandwidths(megabytes: int, reps: int) -> dict:
    """Both directions' bandwidth of the default backend's first device (best of ``reps``)."""
    device = jax.devices()[0]
    host = np.random.default_rng(0).integers(0, 255, size=megabytes << 20, dtype=np.uint8)
    on_device = jax.device_put(host, device).block_until_ready()
    to_device = best_seconds(lambda: jax.device_put(host, device).block_until_ready(), reps)
    to_host = best_seconds(lambda: np.asarray(jax.device_put(on_device, device) + 0), reps)
    nbytes = host.nbytes
    return {"platform": device.platform, "device": str(device), "bytes": nbytes,
            "host_to_device_gb_s": nbytes / to_device / 1e9, "device_to_host_gb_s": nbytes / to_host / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args()
    out = bandwidths(args.megabytes, args.reps)
    print(f"{out['platform']}: host->device {out['host_to_device_gb_s']:.1f} GB/s, "
          f"device->host {out['device_to_host_gb_s']:.1f} GB/s ({out['bytes'] >> 20} MiB, best of {args.reps})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
