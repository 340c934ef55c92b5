"""tpu-ckpt: look at, check, compare, clean up and export checkpoints from a shell.

The commands but export, import-orbax and export-orbax only read (gc also deletes leftovers),
so they need no accelerator and no JAX devices, and they never import JAX: they start in a
fraction of a second. Only those three, which restore and save arrays, import it (and Orbax). This module is the only one of the
package that prints; the work is done by listing.py, verify.py, diff.py and export.py,
which report through return values and logging.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

import tpu_ckpt
from tpu_ckpt import listing, storage
from tpu_ckpt.committed import read_manifest
from tpu_ckpt.diff import Change, diff
from tpu_ckpt.errors import CheckpointError, CheckpointNotFoundError
from tpu_ckpt.format import LeafEntry, Manifest
from tpu_ckpt.progress import Progress
from tpu_ckpt.verify import verify

PROG = "tpu-ckpt"
_EXIT_STATUS = (
    "exit status: 0 ok; 1 verification failed, the checkpoints differ, or ls found nothing; 2 a "
    "usage error, or a path that holds no (committed) checkpoint."
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns the exit status (see ``tpu-ckpt --help``)."""
    args = _parser().parse_args(argv)
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
        _error(str(e))
    return 2


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look at, verify, compare, clean up and export tpu_ckpt checkpoints, and convert Orbax "
        "checkpoints to and from them. Paths are local "
        "directories or gs:// and s3:// URLs, with the environment tpu_ckpt itself reads.",
        epilog=_EXIT_STATUS,
        parents=[_global_flags()],
    )
    parser.set_defaults(verbose=False)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (_add_ls, _add_inspect, _add_verify, _add_diff, _add_gc, _add_export, _add_import_orbax, _add_export_orbax):
        add(commands)
    return parser


def _global_flags() -> argparse.ArgumentParser:
    """The flags every command takes as well, so that they may come before the command or
    after it (`tpu-ckpt verify -v X`). Unset, they are left out of the namespace (SUPPRESS):
    a command's parser must not overwrite what was given before the command."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what the library does")
    flags.add_argument("--version", action="version", version=f"{PROG} {tpu_ckpt.__version__}")
    return flags


def _command(commands: Any, name: str, summary: str, description: str, exits: str) -> argparse.ArgumentParser:
    return commands.add_parser(
        name, help=summary, description=description, epilog=f"exit status: {exits}", parents=[_global_flags()]
    )


# ls


def _add_ls(commands: Any) -> None:
    p = _command(
        commands, "ls", "list the checkpoints in a directory",
        "List the checkpoints directly under DIR (a CheckpointManager directory, or any directory holding "
        "checkpoints) and the uncommitted leftovers of interrupted saves: step, state, size, file count, "
        "age (local directories only; a leftover's size is that of its files, unknown on object stores) "
        "and the metrics saved with each checkpoint, if any. "
        "When DIR holds none, the subdirectories that do are suggested.",
        "0 listed; 1 DIR holds no checkpoints and no leftovers; 2 DIR does not exist or is a checkpoint itself.",
    )
    p.add_argument("dir", metavar="DIR", help="a directory or gs:// / s3:// prefix")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_ls)


def _ls(args: argparse.Namespace) -> int:
    entries = listing.scan(args.dir)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2))
    if not entries:
        _nothing_in(args.dir, file=sys.stderr if args.json else sys.stdout)
        return 1
    if not args.json:
        now = time.time()
        rows = [
            [_or_dash(e.step), e.name, _state(e), _or_dash(e.nbytes, _size), str(e.files), _or_dash(e.mtime, lambda t: _age(now - t))]
            for e in entries
        ]
        header = ["STEP", "NAME", "STATE", "SIZE", "FILES", "AGE"]
        if any(e.metrics for e in entries):  # saved with metrics=...: the column best-k retention ranks by
            header.append("METRICS")
            for row, e in zip(rows, entries):
                row.append(" ".join(f"{k}={v if isinstance(v, int) else format(v, '.6g')}" for k, v in (e.metrics or {}).items()) or "-")
        print(_table([header, *rows], right={0, 3, 4, 5}))
        for e in entries:
            if e.error:
                print(f"{e.name}: {e.error}")
    return 0


def _nothing_in(directory: str, file: Any) -> None:
    """Says that ``directory`` holds no checkpoints, and which of its subdirectories do: the
    usual slip is naming the directory above a CheckpointManager's."""
    print(f"no checkpoints in {directory}", file=file)
    below = listing.nested(directory)
    if below:
        print("these subdirectories hold some:", file=file)
        location = storage.location(directory)
        rows = [[location.child(name), _plural(count, "checkpoint")] for name, count in below.items()]
        print(textwrap.indent(_table(rows), "  "), file=file)


def _state(entry: listing.Entry) -> str:
    if not entry.committed:
        return "uncommitted"
    return "unreadable" if entry.error else "committed"


# inspect


def _add_inspect(commands: Any) -> None:
    p = _command(
        commands, "inspect", "show a checkpoint's tree",
        "Show the tree saved in a checkpoint, from its manifest alone (no data is read): each leaf's key, "
        "shape, dtype, saved sharding, whether it is an optimizer slot, and its size. Given a directory of "
        "checkpoints (a CheckpointManager's), shows its latest step and says so on stderr.",
        "0 shown; 2 PATH holds no committed checkpoint.",
    )
    p.add_argument("path", metavar="PATH", help="a checkpoint, or a directory of them (directory or URL)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    loc = storage.location(args.path)
    try:
        manifest = read_manifest(loc)
    except CheckpointNotFoundError as e:
        steps = {step: name for name, step in _checkpoints_under(args.path, e).items() if step is not None}
        if not steps:
            raise
        loc = storage.Location(loc.child(steps[max(steps)]))
        print(f"{PROG}: {args.path} is a directory of checkpoints; showing the latest, {loc.url}", file=sys.stderr)
        manifest = read_manifest(loc)
    if args.json:
        print(json.dumps(_inspect_json(loc.url, manifest), indent=2))
        return 0
    rows = [_leaf_row(leaf) for leaf in manifest.leaves]
    print(_table([["KEY", "SHAPE", "DTYPE", "SHARDING", "SLOT", "BYTES"], *rows], right={5}))
    arrays = [leaf for leaf in manifest.leaves if leaf.kind == "array"]
    slots = [leaf for leaf in arrays if leaf.is_slot]
    print(
        f"\n{len(manifest.leaves)} leaves ({len(arrays)} arrays, {len(slots)} slots): "
        f"{_size(sum(leaf.nbytes for leaf in arrays))} in {len(manifest.files)} data files "
        f"({_size(sum(leaf.nbytes for leaf in slots))} of slots)"
    )
    print(
        f"format {manifest.version}, saved by {_plural(manifest.process_count, 'process')}, "
        f"sharding callback: {manifest.sharding_callback}"
    )
    if manifest.source is not None:
        print(f"linked: its data lives in {manifest.source['path']}")
    return 0


def _leaf_row(leaf: LeafEntry) -> list[str]:
    if leaf.kind == "value":
        return [leaf.key, "", type(leaf.value).__name__, f"= {leaf.value!r}", "", ""]
    slot = "yes" if leaf.is_slot else "no"
    return [leaf.key, str(list(leaf.shape)), leaf.dtype, _sharding(leaf.sharding), slot, _size(leaf.nbytes)]


def _sharding(description: dict[str, Any] | None) -> str:
    """The manifest's sharding description, short: ``data=4,model=2 P(data,model)``."""
    if description is None:
        return "host"
    if description.get("type") == "NamedSharding":
        mesh = ",".join(f"{axis}={n}" for axis, n in description["mesh"].items())
        spec = ",".join("+".join(p) if isinstance(p, list) else str(p) for p in description["spec"])
        return f"{mesh} P({spec})"
    kind, devices = description.get("type"), description.get("num_devices")
    return str(kind) if devices == 1 else f"{kind}({devices} devices)"


def _inspect_json(url: str, manifest: Manifest) -> dict[str, Any]:
    leaves = [
        {"key": leaf.key, "kind": "value", "value": leaf.value}
        if leaf.kind == "value"
        else {
            "key": leaf.key, "kind": "array", "shape": list(leaf.shape), "dtype": leaf.dtype,
            "sharding": leaf.sharding, "is_slot": leaf.is_slot, "nbytes": leaf.nbytes,
        }
        for leaf in manifest.leaves
    ]
    return {
        "path": url,
        "format_version": manifest.version,
        "process_count": manifest.process_count,
        "sharding_callback": manifest.sharding_callback,
        "files": len(manifest.files),
        "nbytes": sum(leaf["nbytes"] for leaf in leaves if leaf["kind"] == "array"),
        "source": manifest.source,
        "leaves": leaves,
    }


# verify


def _add_verify(commands: Any) -> None:
    p = _command(
        commands, "verify", "check every data file and every piece's crc32c",
        "Read every byte of a checkpoint, in parallel, and check that the manifest is committed and "
        "readable, that every data file exists and is long enough, and every piece's crc32c. Lists "
        "everything that is wrong, not only the first problem. Given a directory of checkpoints (a "
        "CheckpointManager's), verifies every checkpoint in it, one after the other (its uncommitted "
        "leftovers are not checkpoints: see ls and gc).",
        "0 sound; 1 something is wrong (uncommitted included); 2 PATH holds nothing at all.",
    )
    p.add_argument("path", metavar="PATH", help="a checkpoint, or a directory of them (directory or URL)")
    p.set_defaults(run=_verify)


def _verify(args: argparse.Namespace) -> int:
    try:
        return 0 if _verify_one(args.path) else 1
    except CheckpointNotFoundError as e:
        names = list(_checkpoints_under(args.path, e))
    location = storage.location(args.path)
    failed = [name for name in names if not _verify_one(location.child(name))]
    if failed:
        print(f"FAILED: {len(failed)} of {_plural(len(names), 'checkpoint')} in {args.path}: {', '.join(failed)}")
        return 1
    print(f"ok: all {_plural(len(names), 'checkpoint')} in {args.path}")
    return 0


def _verify_one(path: str) -> bool:
    """Verifies one checkpoint, printing its problems and a summary line; whether it is sound."""
    started = time.perf_counter()
    with Progress("verifying") as bar:
        report = verify(path, progress=bar)
    for problem in report.problems:
        print(problem)
    summary = f"{report.path}: {report.leaves} leaves, {report.pieces} pieces, {_size(report.nbytes)}"
    if report.ok:
        print(f"ok: {summary} checked in {time.perf_counter() - started:.1f}s")
    else:
        print(f"FAILED: {summary}: {_plural(len(report.problems), 'problem')}")
    return report.ok


# diff


def _add_diff(commands: Any) -> None:
    p = _command(
        commands, "diff", "compare two checkpoints",
        "Compare checkpoint B with checkpoint A: keys added (+) and removed (-), shape, dtype and saved "
        "value changes (~), and with --values the arrays whose data differ (bit for bit: NaN equals NaN), "
        "each with how many elements differ and the largest absolute difference among them. "
        "Data is compared a piece at a time, so memory stays bounded.",
        "0 no differences; 1 differences found; 2 A or B holds no committed checkpoint, or a piece read "
        "for --values is corrupt (run verify).",
    )
    p.add_argument("a", metavar="A", help="the checkpoint to compare from")
    p.add_argument("b", metavar="B", help="the checkpoint to compare to")
    p.add_argument("--values", action="store_true", help="also compare the arrays' data")
    p.set_defaults(run=_diff)


def _diff(args: argparse.Namespace) -> int:
    with Progress("comparing") as bar:
        changes = diff(args.a, args.b, values=args.values, progress=bar)
    if changes:
        print(_table([_change_row(c) for c in changes]))
    scope = "" if args.values else " in structure (add --values to compare the data)"
    print(f"{_plural(len(changes), 'difference')}{scope}" if changes else f"no differences{scope}")
    return 1 if changes else 0


def _change_row(change: Change) -> list[str]:
    sign = {"added": "+", "removed": "-"}.get(change.kind, "~")
    data = (
        f"data differs in {change.differing} of {_plural(change.elements, 'element')}, "
        f"max abs diff {change.max_abs_diff:.6g}"
    )
    described = {"added": change.after, "removed": change.before, "data": data}
    return [sign, change.key, described.get(change.kind, f"{change.kind} {change.before} -> {change.after}")]


# gc


def _add_gc(commands: Any) -> None:
    p = _command(
        commands, "gc", "remove the leftovers of interrupted saves",
        "Remove the uncommitted leftovers under DIR: step_<n> directories without a manifest and "
        "<name>.tmp-<hex> staging directories. Committed checkpoints and anything the library did not "
        "write are never touched. Do not run it while a save into DIR is in progress: that save's "
        "staging directory is a leftover until it commits.",
        "0 removed (or nothing to remove); 2 DIR does not exist or is a checkpoint itself.",
    )
    p.add_argument("dir", metavar="DIR", help="a directory or gs:// / s3:// prefix")
    p.add_argument("-n", "--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.set_defaults(run=_gc)


def _gc(args: argparse.Namespace) -> int:
    leftovers = [e for e in listing.scan(args.dir) if not e.committed]
    if not leftovers:
        print(f"no leftovers in {args.dir}")
        return 0
    if not args.dry_run:
        listing.remove_leftovers(args.dir, [e.name for e in leftovers])
    verb = "would remove" if args.dry_run else "removed"
    for e in leftovers:
        size = "" if e.nbytes is None else f", {_size(e.nbytes)}"
        print(f"{verb} {e.name} (uncommitted, {_plural(e.files, 'file')}{size})")
    return 0


# export


def _add_export(commands: Any) -> None:
    p = _command(
        commands, "export", "write a params-only serving checkpoint",
        "Write the SUBTREE of training checkpoint SRC (its params; optimizer slots are never read) as "
        "checkpoint DST, which restores without a target. --link writes only a manifest pointing at SRC's "
        "data files (local directories, DST beside SRC); a restore checks that SRC still exists unchanged.",
        "0 written; 2 SRC holds no committed checkpoint or no SUBTREE, DST exists, or the options conflict.",
    )
    export_arguments(p)
    p.set_defaults(run=export)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    """The export options, shared with scripts/export_for_serving.py."""
    parser.add_argument("src", metavar="SRC", help="the training checkpoint (directory or URL)")
    parser.add_argument("dst", metavar="DST", help="where to write the serving checkpoint (must not exist)")
    parser.add_argument("--subtree", default="params", help="key path of the params (default: params)")
    parser.add_argument("--dtype", default=None, help="cast float leaves, e.g. bfloat16")
    parser.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="bytes per data file")
    parser.add_argument("--link", action="store_true", help="reuse SRC's data files; copy nothing")


def export(args: argparse.Namespace) -> int:
    """Runs an export parsed by :func:`export_arguments`; errors propagate to the caller,
    which words them its own way."""
    from tpu_ckpt.export import export_for_serving  # JAX: paid by this command only

    started = time.perf_counter()
    with Progress("copying") as bar:
        path = export_for_serving(
            args.src, args.dst, subtree=args.subtree, dtype=_dtype(args.dtype),
            max_shard_size=args.max_shard_size, link=args.link, progress=bar,
        )
    if args.link:
        what = f"a link to {args.src}, no data copied"
    else:
        arrays = read_manifest(storage.location(path)).leaves  # the same answer on a disk and in a bucket
        what = f"{sum(leaf.nbytes for leaf in arrays if leaf.kind == 'array') / 1e6:.1f} MB"
    print(f"wrote {path}: {what} in {time.perf_counter() - started:.2f}s")
    return 0


def _dtype(name: str | None) -> np.dtype | None:
    """``--dtype`` as a numpy dtype (ml_dtypes, imported by format.py, adds bfloat16 and the
    float8 types): an unknown name is one line of error, not numpy's TypeError."""
    if name is None:
        return None
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"--dtype {name!r} is not a dtype; use a float type such as bfloat16 or float16") from None


# import-orbax, export-orbax


def _add_import_orbax(commands: Any) -> None:
    p = _command(
        commands, "import-orbax", "convert Orbax checkpoints into tpu_ckpt checkpoints",
        "Convert an Orbax PyTree/Standard checkpoint SRC into tpu_ckpt checkpoint DST, or an Orbax "
        "CheckpointManager directory SRC (steps 0/, 10/, ... holding an item such as default/) into a "
        "tpu_ckpt CheckpointManager directory DST (step_0/, step_10/, ...); steps already in DST are "
        "skipped. Leaves are read in batches of at most --max-batch-bytes of arrays (a larger leaf alone), "
        "each written before the next is read. Needs pip install tpu_ckpt[orbax].",
        "0 converted; 2 SRC holds no Orbax checkpoint, DST exists, or Orbax is not installed.",
    )
    p.add_argument("src", metavar="SRC", help="an Orbax checkpoint, step or CheckpointManager directory")
    p.add_argument("dst", metavar="DST", help="the tpu_ckpt checkpoint, or CheckpointManager directory, to write")
    p.add_argument("--item", default=None, help="the item to convert when a step holds several (e.g. state)")
    p.add_argument("--max-batch-bytes", type=int, default=1 << 30, metavar="BYTES", help="arrays held at once (default 1 GiB)")
    p.set_defaults(run=_import_orbax)


def _import_orbax(args: argparse.Namespace) -> int:
    from tpu_ckpt.orbax_interop import import_orbax  # JAX and Orbax: paid by this command only

    started = time.perf_counter()
    try:
        reports = import_orbax(args.src, args.dst, item=args.item, max_batch_bytes=args.max_batch_bytes)
    except ImportError as e:  # Orbax is not installed: the message says how to install it
        _error(str(e))
        return 2
    for r in reports:
        if r.skipped:
            print(f"skipped {r.src}: {r.dst} is already committed")
        else:
            print(f"wrote {r.dst}: {r.leaves} leaves, {_size(r.nbytes)} read in {len(r.batches)} "
                  f"batches of at most {_size(r.peak_batch_bytes)}")
    print(f"converted {_plural(sum(not r.skipped for r in reports), 'checkpoint')} in {time.perf_counter() - started:.2f}s")
    return 0


def _add_export_orbax(commands: Any) -> None:
    p = _command(
        commands, "export-orbax", "write tpu_ckpt checkpoints as Orbax checkpoints",
        "Write tpu_ckpt checkpoint SRC as an Orbax StandardCheckpointer checkpoint DST, or a tpu_ckpt "
        "CheckpointManager directory as an Orbax CheckpointManager directory (DST/<step>/default). Each "
        "checkpoint is restored whole into host memory first (Orbax saves whole trees). "
        "Needs pip install tpu_ckpt[orbax].",
        "0 written; 2 SRC holds no committed checkpoint, DST exists, or Orbax is not installed.",
    )
    p.add_argument("src", metavar="SRC", help="a tpu_ckpt checkpoint or CheckpointManager directory")
    p.add_argument("dst", metavar="DST", help="where to write the Orbax checkpoint(s) (must not exist)")
    p.set_defaults(run=_export_orbax)


def _export_orbax(args: argparse.Namespace) -> int:
    from tpu_ckpt.orbax_interop import export_orbax  # JAX and Orbax: paid by this command only

    started = time.perf_counter()
    try:
        written = export_orbax(args.src, args.dst)
    except ImportError as e:
        _error(str(e))
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"exported {_plural(len(written), 'checkpoint')} in {time.perf_counter() - started:.2f}s")
    return 0


# shared


def _checkpoints_under(path: str, error: CheckpointNotFoundError) -> dict[str, int | None]:
    """The checkpoints in ``path``, named as one checkpoint, which failed with ``error``:
    a directory of them is handled by the command; anything else re-raises ``error``."""
    try:
        found = listing.checkpoints_in(path) if type(error) is CheckpointNotFoundError else {}
    except (CheckpointError, OSError):
        found = {}
    if not found:
        raise error
    return found


def _table(rows: list[list[str]], right: Collection[int] = ()) -> str:
    """Aligned columns, two spaces apart: greppable and cut-able, unlike a boxed table."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def _or_dash(value: Any, fmt: Any = str) -> str:
    return "-" if value is None else fmt(value)


def _size(nbytes: float) -> str:
    if nbytes < 1000:
        return f"{nbytes} B"
    for unit in ("KB", "MB", "GB"):
        nbytes /= 1000
        if nbytes < 1000:
            return f"{nbytes:.1f} {unit}"
    return f"{nbytes / 1000:.1f} TB"


def _age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"
