"""The commands that only read checkpoints (gc also deletes leftovers): ls, inspect,
verify, diff, gc. They never import JAX, so they start in a fraction of a second."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from typing import Any

from tpu_ckpt import catalog, storage
from tpu_ckpt.catalog import Change, diff, verify
from tpu_ckpt.cli import _format as cli_format
from tpu_ckpt.errors import CheckpointNotFoundError
from tpu_ckpt.format import LeafEntry, Manifest, sharding_text
from tpu_ckpt.runtime import Progress

# ls


def add_ls(commands: Any) -> None:
    p = cli_format.command(
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
    entries = catalog.scan(args.dir)
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2))
    if not entries:
        _nothing_in(args.dir, file=sys.stderr if args.json else sys.stdout)
        return 1
    if not args.json:
        now = time.time()
        rows = [
            [
                cli_format.or_dash(e.step), e.name, _state(e), cli_format.or_dash(e.nbytes, cli_format.size),
                str(e.files), cli_format.or_dash(e.mtime, lambda t: cli_format.age(now - t)),
            ]
            for e in entries
        ]
        header = ["STEP", "NAME", "STATE", "SIZE", "FILES", "AGE"]
        if any(e.metrics for e in entries):  # saved with metrics=...: the column best-k retention ranks by
            header.append("METRICS")
            for row, e in zip(rows, entries):
                metrics = (e.metrics or {}).items()
                row.append(" ".join(f"{k}={v if isinstance(v, int) else format(v, '.6g')}" for k, v in metrics) or "-")
        print(cli_format.table([header, *rows], right={0, 3, 4, 5}))
        for e in entries:
            if e.error:
                print(f"{e.name}: {e.error}")
    return 0


def _nothing_in(directory: str, file: Any) -> None:
    """Says that ``directory`` holds no checkpoints, and which of its subdirectories do: the
    usual slip is naming the directory above a CheckpointManager's."""
    print(f"no checkpoints in {directory}", file=file)
    below = catalog.nested(directory)
    if below:
        print("these subdirectories hold some:", file=file)
        location = storage.location(directory)
        rows = [[location.child(name), cli_format.plural(count, "checkpoint")] for name, count in below.items()]
        print(textwrap.indent(cli_format.table(rows), "  "), file=file)


def _state(entry: catalog.Entry) -> str:
    if not entry.committed:
        return "saving" if catalog.busy(entry) else "uncommitted"
    return "unreadable" if entry.error else "committed"


# inspect


def add_inspect(commands: Any) -> None:
    p = cli_format.command(
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
        manifest = cli_format.manifest_of(loc)
    except CheckpointNotFoundError as e:
        steps = {step: name for name, step in cli_format.checkpoints_under(args.path, e).items() if step is not None}
        if not steps:
            raise
        loc = storage.Location(loc.child(steps[max(steps)]))
        print(f"{cli_format.PROG}: {args.path} is a directory of checkpoints; showing the latest, {loc.url}",
              file=sys.stderr)
        manifest = cli_format.manifest_of(loc)
    if args.json:
        print(json.dumps(_inspect_json(loc.url, manifest), indent=2))
        return 0
    rows = [_leaf_row(leaf) for leaf in manifest.leaves]
    print(cli_format.table([["KEY", "SHAPE", "DTYPE", "SHARDING", "SLOT", "BYTES"], *rows], right={5}))
    arrays = [leaf for leaf in manifest.leaves if leaf.kind == "array"]
    slots = [leaf for leaf in arrays if leaf.is_slot]
    print(
        f"\n{len(manifest.leaves)} leaves ({len(arrays)} arrays, {len(slots)} slots): "
        f"{cli_format.size(sum(leaf.nbytes for leaf in arrays))} in {len(manifest.files)} data files "
        f"({cli_format.size(sum(leaf.nbytes for leaf in slots))} of slots)"
    )
    print(
        f"format {manifest.version}, saved by {cli_format.plural(manifest.process_count, 'process')}, "
        f"sharding callback: {manifest.sharding_callback}"
    )
    if manifest.source is not None:
        print(f"linked: its data lives in {manifest.source['path']}")
    return 0


def _leaf_row(leaf: LeafEntry) -> list[str]:
    if leaf.kind == "value":
        return [leaf.key, "", type(leaf.value).__name__, f"= {leaf.value!r}", "", ""]
    if leaf.kind != "array":  # per-process: a value of each process
        sizes = [p.length for p in leaf.pieces]
        largest = cli_format.size(max(sizes, default=0))
        described = f"{cli_format.plural(len(sizes), 'process')}, largest {largest}"
        return [leaf.key, "", "per-process", described, "", cli_format.size(sum(sizes))]
    slot = "yes" if leaf.is_slot else "no"
    dtype = f"{leaf.dtype} ({leaf.logical})" if leaf.logical else leaf.dtype
    return [leaf.key, str(list(leaf.shape)), dtype, sharding_text(leaf.sharding), slot, cli_format.size(leaf.nbytes)]


def _inspect_json(url: str, manifest: Manifest) -> dict[str, Any]:
    leaves = [
        _leaf_json(leaf) for leaf in manifest.leaves
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


def _leaf_json(leaf: LeafEntry) -> dict[str, Any]:
    if leaf.kind == "value":
        return {"key": leaf.key, "kind": "value", "value": leaf.value}
    if leaf.kind != "array":
        sizes = [p.length for p in leaf.pieces]
        return {"key": leaf.key, "kind": leaf.kind, "process_count": len(leaf.pieces), "sizes": sizes}
    doc = {
        "key": leaf.key, "kind": "array", "shape": list(leaf.shape), "dtype": leaf.dtype,
        "sharding": leaf.sharding, "is_slot": leaf.is_slot, "nbytes": leaf.nbytes,
    }
    return {**doc, "logical": leaf.logical} if leaf.logical else doc


# verify


def add_verify(commands: Any) -> None:
    p = cli_format.command(
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
        names = list(cli_format.checkpoints_under(args.path, e))
    location = storage.location(args.path)
    failed = [name for name in names if not _verify_one(location.child(name))]
    if failed:
        checked = cli_format.plural(len(names), "checkpoint")
        print(f"FAILED: {len(failed)} of {checked} in {args.path}: {', '.join(failed)}")
        return 1
    print(f"ok: all {cli_format.plural(len(names), 'checkpoint')} in {args.path}")
    return 0


def _verify_one(path: str) -> bool:
    """Verifies one checkpoint, printing its problems and a summary line; whether it is sound."""
    started = time.perf_counter()
    with Progress("verifying") as bar:
        report = verify(path, progress=bar)
    for problem in report.problems:
        print(problem)
    summary = f"{report.path}: {report.leaves} leaves, {report.pieces} pieces, {cli_format.size(report.nbytes)}"
    if report.ok:
        print(f"ok: {summary} checked in {time.perf_counter() - started:.1f}s")
    else:
        print(f"FAILED: {summary}: {cli_format.plural(len(report.problems), 'problem')}")
    return report.ok


# diff


def add_diff(commands: Any) -> None:
    p = cli_format.command(
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
        print(cli_format.table([_change_row(c) for c in changes]))
    scope = "" if args.values else " in structure (add --values to compare the data)"
    print(f"{cli_format.plural(len(changes), 'difference')}{scope}" if changes else f"no differences{scope}")
    return 1 if changes else 0


def _change_row(change: Change) -> list[str]:
    sign = {"added": "+", "removed": "-"}.get(change.kind, "~")
    data = (
        f"data differs in {change.differing} of {cli_format.plural(change.elements, 'element')}, "
        f"max abs diff {change.max_abs_diff:.6g}"
    )
    described = {"added": change.after, "removed": change.before, "data": data}
    return [sign, change.key, described.get(change.kind, f"{change.kind} {change.before} -> {change.after}")]


# gc


def add_gc(commands: Any) -> None:
    p = cli_format.command(
        commands, "gc", "remove the leftovers of interrupted saves",
        "Remove the uncommitted leftovers of interrupted saves under DIR: directories holding a save's "
        "staging marker, step_<n> directories without a manifest and <name>.tmp-<hex> staging directories "
        "without one. A directory with a manifest is a checkpoint, whatever its name, and is never removed, "
        "nor is anything else the library did not write. On gs:// and s3:// it also removes, from each "
        "checkpoint, the stray objects of a save that never committed it (a stalled writer's: named with "
        "its token, named by no manifest of DIR). A leftover whose save started less than its grace period "
        "(an hour; --grace shortens it) ago may still be running: it is kept, and said so; so are the strays "
        "of a checkpoint holding such a save's staging marker. A save whose writing process is provably dead "
        "(its marker names this host, this boot and a process that is gone) is removed at once.",
        "0 removed (or nothing to remove); 2 DIR does not exist or is a checkpoint itself.",
    )
    p.add_argument("dir", metavar="DIR", help="a directory or gs:// / s3:// prefix")
    p.add_argument("-n", "--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument(
        "--grace", type=_seconds, metavar="SECONDS",
        help="count a save as possibly running for at most SECONDS after it started (default: its marker's hour); "
        "for a job you know is dead",
    )
    p.set_defaults(run=_gc)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--grace takes a number of seconds, 0 or more, not {text!r}")
    return value


def _gc(args: argparse.Namespace) -> int:
    with storage.shorter_grace(args.grace):
        return _gc_within_grace(args)


def _gc_within_grace(args: argparse.Namespace) -> int:
    now = time.time()
    leftovers = [e for e in catalog.scan(args.dir) if not e.committed]
    strays = catalog.strays(args.dir)
    if not leftovers and not strays:
        print(f"no leftovers in {args.dir}")
        return 0
    removable = [e.name for e in leftovers if not catalog.busy(e, now)]
    removed = removable if args.dry_run else catalog.remove_leftovers(args.dir, removable)
    verb = "would remove" if args.dry_run else "removed"
    for e in leftovers:
        if e.name in removed:
            size = "" if e.nbytes is None else f", {cli_format.size(e.nbytes)}"
            print(f"{verb} {e.name} (uncommitted, {cli_format.plural(e.files, 'file')}{size})")
        elif e.name in removable:
            print(f"kept {e.name} (a save started or committed it since it was listed)")
        else:
            wait = cli_format.age((e.held_until or now) - now)
            print(f"kept {e.name} (a save that may still be running; removable in {wait})")
    _gc_strays(args, strays, now)
    return 0


def _gc_strays(args: argparse.Namespace, strays: list[catalog.Strays], now: float) -> None:
    """Removes (or lists) the stray objects of the checkpoints, as ``_gc`` does the leftovers."""
    removable = [s for s in strays if s.held_until is None or now >= s.held_until]
    removed = removable if args.dry_run else catalog.remove_strays(args.dir, removable)
    verb = "would remove" if args.dry_run else "removed"
    for s in strays:
        what = f"{cli_format.plural(len(s.files), 'stray object')} in {s.name}"
        if s in removed:
            saves = "saves" if len(s.tokens) > 1 else "a save"
            print(f"{verb} {what} (written by {saves} {', '.join(s.tokens)} that never committed it)")
        elif s in removable:
            print(f"kept {what} (the checkpoint changed since it was listed)")
        else:
            wait = cli_format.age((s.held_until or now) - now)
            print(f"kept {what} (a save that may still be running; removable in {wait})")
