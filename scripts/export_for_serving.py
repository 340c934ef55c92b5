#!/usr/bin/env python3
"""Turn a training checkpoint into a compact serving checkpoint (params only).

    python scripts/export_for_serving.py SRC DST [--subtree params] [--dtype bfloat16]
                                         [--max-shard-size BYTES] [--link]

SRC and DST are local paths or gs:// / s3:// URLs (the library's environment variables apply,
e.g. AWS_ENDPOINT_URL). The result restores with `tc.restore(DST)`. --link writes only a
manifest pointing at SRC's data files (no data copied); it stays valid only while SRC exists
unchanged, which `tc.restore` checks. Local directories only.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import tpu_ckpt as tc
from tpu_ckpt.progress import Progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="training checkpoint")
    parser.add_argument("dst", help="where to write the serving checkpoint (must not exist)")
    parser.add_argument("--subtree", default="params", help="key path of the params (default: params)")
    parser.add_argument("--dtype", default=None, help="cast float leaves, e.g. bfloat16")
    parser.add_argument("--max-shard-size", type=int, default=None, help="bytes per data file")
    parser.add_argument("--link", action="store_true", help="reuse SRC's data files; copy nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    try:
        with Progress("copying") as bar:
            path = tc.export_for_serving(
                args.src, args.dst, subtree=args.subtree, dtype=args.dtype,
                max_shard_size=args.max_shard_size, link=args.link, progress=bar,
            )
    except (tc.CheckpointError, ValueError, TypeError) as e:
        print(f"export_for_serving: {e}", file=sys.stderr)
        return 1
    what = f"a link to {args.src}, no data copied" if args.link else f"{_array_bytes(tc.metadata(path)) / 1e6:.1f} MB"
    print(f"wrote {path}: {what} in {time.perf_counter() - started:.2f}s")
    return 0


def _array_bytes(tree: object) -> int:
    """The arrays' bytes, from the manifest alone: the same answer on a disk and in a bucket."""
    if isinstance(tree, dict):
        return sum(_array_bytes(value) for value in tree.values())
    if isinstance(tree, list):
        return sum(_array_bytes(value) for value in tree)
    return getattr(tree, "nbytes", 0)


if __name__ == "__main__":
    sys.exit(main())
