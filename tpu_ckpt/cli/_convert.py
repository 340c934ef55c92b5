"""The commands that convert: export (the serving export), import-orbax and export-orbax.
Only these import JAX (and Orbax), inside their functions, so the other commands stay fast."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from tpu_ckpt.cli import _format as cli_format
from tpu_ckpt.runtime import Progress

# export


def add_export(commands: Any) -> None:
    p = cli_format.command(
        commands, "export", "write a params-only serving checkpoint",
        "Write the SUBTREE of training checkpoint SRC (its params; optimizer slots are never read) as "
        "checkpoint DST, which restores without a target. --link writes only a manifest pointing at SRC's "
        "data files (local directories, DST beside SRC); a restore checks that SRC still exists unchanged. "
        "--layout huggingface writes model.safetensors (or model-0000k-of-0000N.safetensors and "
        "model.safetensors.index.json) for serving stacks, named by --names.",
        "0 written; 2 SRC holds no committed checkpoint or no SUBTREE, DST exists, or the options conflict.",
    )
    export_arguments(p)
    p.set_defaults(run=export)


def export_arguments(parser: argparse.ArgumentParser) -> None:
    """The export options of ``tpu-ckpt export``."""
    parser.add_argument("src", metavar="SRC", help="the training checkpoint (directory or URL)")
    parser.add_argument("dst", metavar="DST", help="where to write the serving checkpoint (must not exist)")
    parser.add_argument("--subtree", default="params", help="key path of the params (default: params)")
    parser.add_argument("--dtype", default=None, help="cast float leaves, e.g. bfloat16")
    parser.add_argument(
        "--max-shard-size", default=None, metavar="SIZE", help="bytes per data file: a number or e.g. 5GB, 500MiB"
    )
    parser.add_argument(
        "--layout", choices=("tpu_ckpt", "huggingface"), default="tpu_ckpt",
        help="tpu_ckpt (a checkpoint; the default) or huggingface (model.safetensors files for serving stacks)",
    )
    parser.add_argument(
        "--names", default=None, metavar="MAP.json",
        help="huggingface layout: a JSON object from key path to tensor name, null, or {name, transpose}",
    )
    parser.add_argument("--link", action="store_true", help="reuse SRC's data files; copy nothing")


def export(args: argparse.Namespace) -> int:
    """Runs an export parsed by :func:`export_arguments`; errors propagate to the caller,
    which words them its own way."""
    from tpu_ckpt.interop import export_for_serving  # JAX: paid by this command only

    started = time.perf_counter()
    with Progress("copying") as bar:
        path = export_for_serving(
            args.src, args.dst, subtree=args.subtree, dtype=_dtype(args.dtype),
            max_shard_size=args.max_shard_size, link=args.link, progress=bar,
            layout=args.layout, names=_names(args.names),
        )
    if args.layout == "huggingface":
        what = "the Hugging Face layout"
    elif args.link:
        what = f"a link to {args.src}, no data copied"
    else:
        arrays = cli_format.manifest_of(path).leaves  # the same answer on a disk and in a bucket
        what = cli_format.size(sum(leaf.nbytes for leaf in arrays if leaf.kind == 'array'))
    print(f"wrote {path}: {what} in {time.perf_counter() - started:.2f}s")
    return 0


def _names(path: str | None) -> dict[str, Any] | None:
    """``--names``: one JSON object (at most 64 MiB) from key path to a tensor name spec."""
    if path is None:
        return None
    with open(path, "rb") as f:
        raw = f.read((64 << 20) + 1)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"--names {path} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--names {path} must hold one JSON object from key path to tensor name")
    return doc


def _dtype(name: str | None) -> np.dtype | None:
    """``--dtype`` as a numpy dtype (ml_dtypes, imported by format/_manifest.py, adds bfloat16 and the
    float8 types): an unknown name is one line of error, not numpy's TypeError."""
    if name is None:
        return None
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"--dtype {name!r} is not a dtype; use a float type such as bfloat16 or float16") from None


# import-orbax, export-orbax


def add_import_orbax(commands: Any) -> None:
    p = cli_format.command(
        commands, "import-orbax", "convert Orbax checkpoints into tpu_ckpt checkpoints",
        "Convert an Orbax PyTree/Standard checkpoint SRC into tpu_ckpt checkpoint DST, or an Orbax "
        "CheckpointManager directory SRC (steps 0/, 10/, ... holding an item such as default/) into a "
        "tpu_ckpt CheckpointManager directory DST (step_0/, step_10/, ...); steps already in DST are "
        "skipped. A step's JSON items (ocp.args.JsonSave: a data iterator's state, a config) come too: the tree "
        "is then the step's items by name ({'state': ..., 'config': ...}). Leaves are read in batches of at most "
        "--max-batch-bytes of arrays (a larger leaf alone), each written before the next is read. Needs "
        "orbax-checkpoint: pip install orbax-checkpoint (tpu_ckpt's [flax] and [orbax] extras bring it).",
        "0 converted; 2 SRC holds no Orbax checkpoint or a damaged one, DST exists, or Orbax is not installed.",
    )
    p.add_argument("src", metavar="SRC", help="an Orbax checkpoint, step or CheckpointManager directory")
    p.add_argument("dst", metavar="DST", help="the tpu_ckpt checkpoint, or CheckpointManager directory, to write")
    p.add_argument("--item", default=None, help="the item to convert when a step holds several (e.g. state)")
    p.add_argument("--max-batch-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="arrays held at once (default 1 GiB)")
    p.set_defaults(run=_import_orbax)


def _import_orbax(args: argparse.Namespace) -> int:
    from tpu_ckpt.interop import import_orbax  # JAX and Orbax: paid by this command only

    _quiet_closed_loop_callbacks()
    started = time.perf_counter()
    try:
        reports = import_orbax(args.src, args.dst, item=args.item, max_batch_bytes=args.max_batch_bytes)
    except ImportError as e:  # Orbax is not installed: the message says how to install it
        cli_format.error(str(e))
        return 2
    for r in reports:
        if r.skipped:
            print(f"skipped {r.src}: {r.dst} is already committed")
        else:
            print(f"wrote {r.dst}: {r.leaves} leaves, {cli_format.size(r.nbytes)} read in {len(r.batches)} "
                  f"batches of at most {cli_format.size(r.peak_batch_bytes)}")
    converted = cli_format.plural(sum(not r.skipped for r in reports), "checkpoint")
    print(f"converted {converted} in {time.perf_counter() - started:.2f}s")
    return 0


def _quiet_closed_loop_callbacks() -> None:
    """When Orbax fails on one array of a damaged checkpoint, it closes its event loop while
    tensorstore still completes the others; their callbacks then fail, and Python prints
    each as a traceback ("Event loop is closed") beside our one-line error, even after the
    command returned. Those alone are dropped; a hook someone else set is left alone."""
    if sys.unraisablehook is sys.__unraisablehook__:
        sys.unraisablehook = _drop_closed_loop


def _drop_closed_loop(unraisable: Any) -> None:
    error = unraisable.exc_value
    if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
        sys.__unraisablehook__(unraisable)


def add_export_orbax(commands: Any) -> None:
    p = cli_format.command(
        commands, "export-orbax", "write tpu_ckpt checkpoints as Orbax checkpoints",
        "Write tpu_ckpt checkpoint SRC as an Orbax StandardCheckpointer checkpoint DST, or a tpu_ckpt "
        "CheckpointManager directory as an Orbax CheckpointManager directory (DST/<step>/default). Each "
        "checkpoint is restored whole into host memory first (Orbax saves whole trees). "
        "Needs orbax-checkpoint: pip install orbax-checkpoint (tpu_ckpt's [flax] and [orbax] extras bring it).",
        "0 written; 2 SRC holds no committed checkpoint, DST exists, or Orbax is not installed.",
    )
    p.add_argument("src", metavar="SRC", help="a tpu_ckpt checkpoint or CheckpointManager directory")
    p.add_argument("dst", metavar="DST", help="where to write the Orbax checkpoint(s) (must not exist)")
    p.set_defaults(run=_export_orbax)


def _export_orbax(args: argparse.Namespace) -> int:
    from tpu_ckpt.interop import export_orbax  # JAX and Orbax: paid by this command only

    started = time.perf_counter()
    try:
        written = export_orbax(args.src, args.dst)
    except ImportError as e:
        cli_format.error(str(e))
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"exported {cli_format.plural(len(written), 'checkpoint')} in {time.perf_counter() - started:.2f}s")
    return 0
