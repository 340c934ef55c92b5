"""tpu-ckpt: look at, check, compare, clean up and export checkpoints from a shell.

The commands but export, import-orbax and export-orbax only read (gc also deletes leftovers),
so they need no accelerator and no JAX devices, and they never import JAX: they start in a
fraction of a second. Only those three, which restore and save arrays, import it (and Orbax),
and plan, which builds its target's shardings on CPU devices.
This module parses and dispatches; cli/_read.py, cli/_convert.py and cli/_plan.py hold the commands and cli/_format.py
what they share. They are the only modules of the package that print; the work is done by catalog/_listing.py,
catalog/_verify.py, catalog/_diff.py, interop/_export.py, interop/_orbax.py and restoring/_check.py, which report
through return values and logging.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Sequence

from tpu_ckpt.cli import _convert as cli_convert
from tpu_ckpt.cli import _format as cli_format
from tpu_ckpt.cli import _plan as cli_plan
from tpu_ckpt.cli import _read as cli_read
from tpu_ckpt.errors import CheckpointError

_EXIT_STATUS = (
    "exit status: 0 ok; 1 verification failed, the checkpoints differ, ls found nothing, or a planned "
    "restore would fail; 2 a "
    "usage error, or a path that holds no (committed) checkpoint."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status (see ``tpu-ckpt --help``)."""
    args = _parser().parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        # a key Python holds but UTF-8 cannot (a lone surrogate) prints escaped
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        status = args.run(args)
        sys.stdout.flush()  # here, so that a reader gone early is handled below and not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except (CheckpointError, OSError, ValueError) as e:
        if isinstance(e, BrokenPipeError):  # `tpu-ckpt inspect X | head`: the reader left
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        cli_format.error(str(e))
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=cli_format.PROG,
        description="Look at, verify, compare, clean up and export tpu_ckpt checkpoints, and convert Orbax "
        "checkpoints to and from them. Paths are local "
        "directories or gs:// and s3:// URLs, with the environment tpu_ckpt itself reads.",
        epilog=_EXIT_STATUS,
        parents=[cli_format.global_flags()],
    )
    parser.set_defaults(verbose=False)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (
        cli_read.add_ls, cli_read.add_inspect, cli_read.add_verify, cli_read.add_diff, cli_read.add_gc,
        cli_convert.add_export, cli_convert.add_import_orbax, cli_convert.add_export_orbax, cli_plan.add_plan,
    ):
        add(commands)
    return parser
