#!/usr/bin/env python3
"""Turn a training checkpoint into a compact serving checkpoint (params only).

    python scripts/export_for_serving.py SRC DST [--subtree params] [--dtype bfloat16]
                                         [--max-shard-size SIZE] [--link]
                                         [--layout huggingface] [--names MAP.json]

The same as `tpu-ckpt export` (whose implementation this runs), kept for the scripts that
call it: it logs what the library does and exits 1 on an error. SRC and DST are local paths
or gs:// / s3:// URLs (the library's environment variables apply, e.g. AWS_ENDPOINT_URL).
The result restores with `tc.restore(DST)`. --link writes only a manifest pointing at SRC's
data files (no data copied); it stays valid only while SRC exists unchanged, which
`tc.restore` checks. Local directories only. --layout huggingface writes the Hugging Face
files serving stacks read instead (docs/serving.md).
"""

from __future__ import annotations

import argparse
import logging
import sys

from tpu_ckpt import cli
from tpu_ckpt.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.export_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return cli.export(args)
    except (CheckpointError, ValueError, TypeError) as e:
        print(f"export_for_serving: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
