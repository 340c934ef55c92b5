#!/usr/bin/env python3
"""Turn a training checkpoint into a compact serving checkpoint (params only).

    python scripts/export_for_serving.py SRC DST [--subtree params] [--dtype bfloat16]
                                         [--max-shard-size BYTES] [--link]

The result restores with `tc.restore(DST)`. --link writes only a manifest pointing at SRC's
data files (no data copied); it stays valid only while SRC exists unchanged, which
`tc.restore` checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import tpu_ckpt as tc


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
        path = tc.export_for_serving(
            args.src, args.dst, subtree=args.subtree, dtype=args.dtype,
            max_shard_size=args.max_shard_size, link=args.link,
            progress=_progress_bar if sys.stderr.isatty() else None,
        )
    except (tc.CheckpointError, ValueError, TypeError) as e:
        print(f"export_for_serving: {e}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) if os.path.isdir(path) else 0
    print(f"wrote {path}: {size / 1e6:.1f} MB in {time.perf_counter() - started:.2f}s")
    return 0


def _progress_bar(done: int, total: int, width: int = 40) -> None:
    """A one-line bar on a terminal (the caller passes it only when stderr is a TTY)."""
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\rcopying [{'#' * filled}{'.' * (width - filled)}] {done / 1e6:8.1f} / {total / 1e6:.1f} MB")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
