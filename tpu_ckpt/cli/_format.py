"""What every tpu-ckpt command shares: its parser's shape, its error line, and the way
numbers and tables are printed (aligned columns, greppable, no boxes)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import tpu_ckpt
from tpu_ckpt import catalog, storage
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError
from tpu_ckpt.format import Manifest
from tpu_ckpt.runtime import plural, size, table  # noqa: F401 - one format for the commands, the bar and reports

PROG = "tpu-ckpt"


def manifest_of(where: str | storage.Location) -> Manifest:
    """A checkpoint's manifest, for the commands that show its tree (no piece table is read)."""
    with catalog.open_checkpoint(where, threads=1) as checkpoint:
        return checkpoint.manifest


def error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def global_flags() -> argparse.ArgumentParser:
    """The flags every command takes as well, so that they may come before the command or
    after it (`tpu-ckpt verify -v X`). Unset, they are left out of the namespace (SUPPRESS):
    a command's parser must not overwrite what was given before the command."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help="log what the library does")
    flags.add_argument("--version", action="version", version=f"{PROG} {tpu_ckpt.__version__}")
    return flags


def command(commands: Any, name: str, summary: str, description: str, exits: str) -> argparse.ArgumentParser:
    return commands.add_parser(
        name, help=summary, description=description, epilog=f"exit status: {exits}", parents=[global_flags()]
    )


def checkpoints_under(path: str, error: CheckpointNotFoundError) -> dict[str, int | None]:
    """The checkpoints in ``path``, named as one checkpoint, which failed with ``error``:
    a directory of them is handled by the command; anything else re-raises ``error``."""
    try:
        found = catalog.checkpoints_in(path) if type(error) is CheckpointNotFoundError else {}
    except (CheckpointError, OSError):
        found = {}
    if not found:
        raise error
    return found


def or_dash(value: Any, fmt: Any = str) -> str:
    return "-" if value is None else fmt(value)


def age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"
