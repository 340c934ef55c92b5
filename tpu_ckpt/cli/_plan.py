"""The plan command: ``tc.check_restore`` from a shell, on a target described by another
checkpoint (``--like``) or by a JSON file (``--target``).

It imports JAX, to build the target's shardings, but needs no accelerator: unless JAX is
already imported it runs on CPU devices, as many as the target's meshes need (the
``--xla_force_host_platform_device_count`` flag), so a pod's restore is planned on a laptop.
Only the manifests and piece tables are read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
from typing import Any

from tpu_ckpt import settings
from tpu_ckpt.cli import _format as cli_format
from tpu_ckpt.format import LeafEntry, normalise_subtree, under, unflatten_nested

TARGET_SCHEMA = (
    '{"mesh": {"data": 2, "model": 4}, "leaves": {"params/w": {"shape": [512, 256], "dtype": "float32", '
    '"spec": [null, "model"]}, "step": 0}}: keys as in `inspect` (below --subtree when given); a leaf is '
    "a shape, a dtype and a partition spec over the mesh (no spec: replicated; no mesh: one device), or "
    "a JSON number for a Python scalar."
)
MAX_TARGET_BYTES = 64 << 20  # a --target file larger than this is refused, unread
# The most devices a target's meshes may ask for: plan makes that many CPU devices (about 1 GB
# and 20 s per 8,192), and XLA itself fails or aborts on far more.
MAX_PLAN_DEVICES = 16384


def add_plan(commands: Any) -> None:
    p = cli_format.command(
        commands, "plan", "check a restore before running it",
        "Check that checkpoint CKPT restores onto a target, from manifests alone (no data is read, no "
        "accelerator is used): the keys the target needs that CKPT lacks, shape and dtype mismatches "
        "(the errors tc.restore would raise), float casts, skipped slots and keys left unread, which "
        "arrays are resharded, and per process the bytes, requests and over-read the restore would "
        f"read, with a time estimate. --like takes the target from another checkpoint's shapes, dtypes "
        f"and saved shardings; --target from a JSON file: {TARGET_SCHEMA}",
        "0 the restore would succeed; 1 it would fail (the problems are listed); 2 a usage error, an "
        "unreadable target file, or no committed checkpoint at CKPT or OTHER.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="the checkpoint to restore (directory or URL)")
    p.add_argument("--subtree", default=None, metavar="KEY", help="restore only this part (the target describes it)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--like", metavar="OTHER_CKPT", help="a checkpoint saved as the target is laid out")
    target.add_argument("--target", metavar="FILE.json", help="the target's shapes, dtypes, mesh and specs")
    target.add_argument("--template", action="store_true", help="print CKPT's own layout as a --target file, to edit")
    p.add_argument("--skip-slot-variables", action="store_true", help="as CheckpointOptions(skip_slot_variables=True)")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="N",
                   help="count devices 0..N-1 as process 0, N..2N-1 as process 1, ...: a multi-host job's reads")
    p.add_argument("--throughput", type=float, default=1000.0, metavar="MB/S",
                   help="one process's read rate (default 1000)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    if args.throughput <= 0 or (args.devices_per_process is not None and args.devices_per_process <= 0):
        raise ValueError("--throughput and --devices-per-process must be positive")
    if args.template:
        print(json.dumps(_template(args.ckpt, args.subtree), indent=2))
        return 0
    target = _target_like(args.like, args.subtree) if args.like is not None else _target_from(args.target)
    from tpu_ckpt.options import CheckpointOptions
    from tpu_ckpt.restoring import check_restore

    report = check_restore(
        args.ckpt, target, subtree=args.subtree,
        options=CheckpointOptions(skip_slot_variables=args.skip_slot_variables),
        bytes_per_second=args.throughput * 1e6, devices_per_process=args.devices_per_process,
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else report.describe())
    return 0 if report.ok else 1


def _target_like(other: str, subtree: str | None) -> Any:
    """The target another checkpoint's leaves (below ``subtree``) describe."""
    prefix, depth = normalise_subtree(subtree)
    leaves = [leaf for leaf in cli_format.manifest_of(other).leaves if under(leaf.key, prefix)]
    _use_cpu_devices(max((_mesh_size(leaf.sharding) for leaf in leaves), default=1), other)
    return unflatten_nested((leaf.path[depth:], _like(leaf)) for leaf in leaves)


def _template(ckpt: str, subtree: str | None) -> dict[str, Any]:
    """The --target file of ``ckpt``'s own layout (below ``subtree``): its arrays with their
    saved shapes, dtypes and specs on the first saved mesh, and its numbers."""
    prefix, _ = normalise_subtree(subtree)
    leaves = [leaf for leaf in cli_format.manifest_of(ckpt).leaves if under(leaf.key, prefix)]
    shardings = [leaf.sharding or {} for leaf in leaves]
    meshes = [sharding["mesh"] for sharding in shardings if sharding.get("type") == "NamedSharding"]
    doc: dict[str, Any] = {"mesh": meshes[0] if meshes else {}, "leaves": {}}
    for leaf, sharding in zip(leaves, shardings):
        key = leaf.key[len(prefix) + 1:] if prefix else leaf.key
        if leaf.kind == "array":
            on_mesh = bool(meshes) and sharding.get("mesh") == meshes[0]
            spec = sharding["spec"] if on_mesh else []
            doc["leaves"][key] = {"shape": list(leaf.shape), "dtype": leaf.dtype, "spec": spec}
        elif leaf.kind == "value" and isinstance(leaf.value, _JSON_VALUES):
            doc["leaves"][key] = leaf.value
    return doc


def _target_from(path: str) -> Any:
    """The target a --target file describes (nested dicts: a key names a list entry of the
    checkpoint, ``opt_state/0/mu``, as well)."""
    doc = _target_file(path)
    _use_cpu_devices(math.prod(doc["mesh"].values()), path)
    return unflatten_nested(
        ([("dict", k) for k in key.split("/")], _leaf(path, key, value, doc["mesh"]))
        for key, value in doc["leaves"].items()
    )


def _use_cpu_devices(count: int, where: str) -> None:
    if count > MAX_PLAN_DEVICES:
        raise ValueError(
            f"{where}: a mesh of {count} devices is more than plan builds ({MAX_PLAN_DEVICES} CPU devices at most); "
            "plan the restore of a smaller mesh, or of a subtree whose leaves need fewer devices"
        )
    settings.use_cpu_devices(count)


def _mesh_size(description: dict[str, Any] | None) -> int:
    if not description or description.get("type") != "NamedSharding":
        return 1
    return math.prod(description["mesh"].values())


def _like(leaf: LeafEntry) -> Any:
    """The target leaf another checkpoint's leaf describes: its shape, dtype and sharding."""
    import jax

    from tpu_ckpt.format import dtype_from_name

    if leaf.kind != "array":
        return leaf.value  # a per-process leaf: None, read as a value
    description = leaf.sharding or {}
    sharding = None
    if description.get("type") == "NamedSharding":
        sharding = jax.sharding.NamedSharding(_mesh(description["mesh"]), _spec(description["spec"]))
    return jax.ShapeDtypeStruct(leaf.shape, dtype_from_name(leaf.dtype), sharding=sharding)


def _target_file(path: str) -> dict[str, Any]:
    """The --target file, its outer shape checked (a leaf's, when it is built)."""
    try:
        doc = json.loads(_regular_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path} is not a target: its JSON is nested too deeply to read") from None
    mesh = doc.get("mesh", {}) if isinstance(doc, dict) else None
    ok_mesh = isinstance(mesh, dict) and all(_natural(n) and n > 0 for n in mesh.values())
    if not ok_mesh or not isinstance(doc.get("leaves"), dict):
        raise ValueError(f"{path} must hold an object with \"leaves\" (and optionally \"mesh\"), as {TARGET_SCHEMA}")
    return {"mesh": mesh, "leaves": doc["leaves"]}


def _regular_file(path: str) -> bytes:
    """The bytes of ``path``, a regular file of at most MAX_TARGET_BYTES: a FIFO, a device
    (``/dev/zero``) or a directory, or a link to one, is refused without reading it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would wait for a writer
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file; give --target a JSON file")
        data = f.read(MAX_TARGET_BYTES + 1)
    if len(data) > MAX_TARGET_BYTES:
        raise ValueError(f"{path} is larger than a target file may be ({MAX_TARGET_BYTES >> 20} MiB)")
    return data


def _natural(n: Any) -> bool:
    """A JSON integer (not a bool, not 64.7) that is not negative."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


_JSON_VALUES = (bool, int, float, str, type(None))  # a saved Python value's target, as a --target file holds it


def _leaf(path: str, key: str, value: Any, mesh: dict[str, int]) -> Any:
    """One --target leaf: a ShapeDtypeStruct on the mesh, or a Python value (a saved one's target)."""
    import jax

    from tpu_ckpt.format import dtype_from_name

    if isinstance(value, _JSON_VALUES):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{path}: leaf {key!r} is a {type(value).__name__}; give {{\"shape\": [...], \"dtype\": ...}} "
                         "or a number, string, true/false or null")
    try:
        if not isinstance(value["shape"], list) or not all(_natural(n) for n in value["shape"]):
            raise ValueError(f"a shape is a list of whole numbers, got {value['shape']!r}")
        shape, dtype = tuple(value["shape"]), dtype_from_name(value["dtype"])
        spec = value.get("spec")
        sharding = None
        if mesh:
            sharding = jax.sharding.NamedSharding(_mesh(mesh), _spec(spec or []))
        elif spec:
            raise ValueError("a spec needs a mesh")
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    except Exception as e:  # JAX refuses a bad spec with errors of its own types
        raise ValueError(f"{path}: leaf {key!r}: {str(e) or type(e).__name__} (see tpu-ckpt plan --help)") from None


_MESHES: dict[tuple[tuple[str, int], ...], Any] = {}


def _mesh(axes: dict[str, int]) -> Any:
    """A mesh of this process's first devices, one per distinct shape."""
    import jax
    import numpy as np

    shape = tuple(axes.items())
    if shape not in _MESHES:
        devices = jax.devices()
        needed = math.prod(axes.values())
        if needed > len(devices):
            raise ValueError(
                f"the mesh {axes} needs {needed} devices and JAX has {len(devices)}; run with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} JAX_PLATFORMS=cpu"
            )
        _MESHES[shape] = jax.sharding.Mesh(np.array(devices[:needed]).reshape(list(axes.values())), list(axes))
    return _MESHES[shape]


def _spec(entries: list[Any]) -> Any:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))
