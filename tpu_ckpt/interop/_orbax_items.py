"""The JSON items of an Orbax step (``ocp.args.JsonSave``: a data iterator's state, a config),
brought into the tree an import writes.

An Orbax ``CheckpointManager`` step saved with ``ocp.args.Composite`` holds one directory per
item. Which items are JSON the step's metadata tells (``item_handlers``, read through Orbax's
``CompositeCheckpointHandler``), and each is read through Orbax's ``JsonCheckpointHandler``;
no file is parsed here. When a step has JSON items the imported tree is the step's items by
name, as Orbax's ``Composite`` restore gives them: ``{"state": <the PyTree item>, "config":
{...}, "iterator": {...}}``, the JSON values as saved Python values. A step without any
keeps the PyTree item's tree at the root, as before.

A tpu_ckpt tree keeps no empty list or dict (a container without leaves): one inside a JSON
item is left out, with a warning naming where.

Orbax trusts its files, so each is checked before Orbax reads it, as ``_orbax_checks``
does for arrays: a regular file inside the step (no FIFO, no link out), of a bounded size.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tpu_ckpt import storage
from tpu_ckpt.errors import CorruptCheckpointError
from tpu_ckpt.format import flatten
from tpu_ckpt.interop import _orbax_checks as orbax_checks

logger = logging.getLogger(__name__)

MAX_JSON_ITEM_BYTES = 64 << 20
"""The largest file of a JSON item (or step metadata) handed to Orbax, which reads it whole."""
_STEP_METADATA = "_CHECKPOINT_METADATA"


def json_items(ocp: Any, step: Any) -> dict[str, Any]:
    """The JSON items of Orbax step directory ``step`` (an ``epath.Path``), by name, as
    Orbax restores them; none where the step records no item handlers."""
    root = os.fspath(step)
    if not _checked(root, _STEP_METADATA):
        return {}
    with orbax_checks.orbax_errors(root):
        handlers = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).metadata(step).item_handlers
    handlers = handlers if isinstance(handlers, dict) else {}  # none recorded (or a damaged record): no JSON items
    names = sorted(str(name) for name, handler in handlers.items() if str(handler).endswith(".JsonCheckpointHandler"))
    items = {}
    for name in names:
        item = os.path.join(root, name)
        if name in ("", ".", "..") or "/" in name or os.sep in name or os.path.islink(item) or not os.path.isdir(item):
            raise CorruptCheckpointError(
                f"Orbax step {root} names JSON item {name!r}, which is no directory of the step: its "
                f"{_STEP_METADATA} is damaged. Copy the step again, or import another one.",
                file=os.path.join(root, _STEP_METADATA),
            )
        for directory, _, files in os.walk(item):
            for file in files:
                _checked(item, os.path.relpath(os.path.join(directory, file), item))
        with orbax_checks.orbax_errors(item):
            items[name] = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step / name)
        _warn_of_empty_containers(name, items[name])
    return items


def composite(tree: Any, name: str, items: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The tree an import writes (see module docstring): ``tree``, PyTree item ``name``'s,
    alone when there are no JSON ``items``; and, by each of ``tree``'s leaves' key in it,
    its key in ``tree`` (Orbax's, which the reads name)."""
    own = [key for key, _, _ in flatten(tree, keep_none=True)[0]]
    if not items:
        return tree, {key: key for key in own}
    whole = {name: tree, **items}
    placed = [key for key, _, _ in flatten({name: tree}, keep_none=True)[0]]
    return whole, dict(zip(placed, own))


def _checked(root: str, name: str) -> bool:
    """Whether regular file ``name`` of ``root`` is there (refusing a link out, a FIFO, a
    device, or a file over ``MAX_JSON_ITEM_BYTES``)."""
    try:
        fd = storage.open_confined(root, name)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size > MAX_JSON_ITEM_BYTES:
        path = os.path.join(root, name)
        raise CorruptCheckpointError(
            f"Orbax checkpoint file {path} is {size} bytes, more than the {MAX_JSON_ITEM_BYTES} a JSON item or step "
            "metadata may be; it is damaged or not Orbax's. Copy the step again, or import another one.",
            file=path,
        )
    return True


def _warn_of_empty_containers(name: str, value: Any) -> None:
    stack = [("", value)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict | list) and not node:
            logger.warning(
                "tpu_ckpt: Orbax JSON item %r holds an empty %s at %r, which a tpu_ckpt tree does not keep: it is "
                "left out", name, type(node).__name__, where or "/",
            )
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((f"{where}/{key}", child) for key, child in children)
