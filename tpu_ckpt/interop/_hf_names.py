"""Tensor names for the Hugging Face layout: from key paths, a map or a function, with the
one transform a name may ask for.

``names`` is ``None`` (the key path below the exported subtree, or of the target, joined by
``.``: ``Dense_0.kernel``), a dict from key path (``params/Dense_0/kernel``, as
``tpu-ckpt inspect`` shows it) to a *spec*, or a function from key path to a spec. A spec
is a tensor name, ``None`` (the leaf is left out), or ``{"name": ..., "transpose": True}``:
the tensor is stored with its axes reversed (a Flax ``Dense`` kernel ``(in, out)`` becomes a
PyTorch ``Linear`` weight ``(out, in)``), and reversed back on load. A dict must name every
array leaf (``None`` to leave one out), so that a typo does not silently drop a weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tpu_ckpt.errors import TargetMismatchError

Spec = str | Mapping[str, Any] | None
Names = Mapping[str, Spec] | Callable[[str], Spec] | None


@dataclasses.dataclass(frozen=True)
class Named:
    """A leaf's tensor: its name, and whether its axes are reversed in the file."""

    key: str  # the key path
    name: str
    transpose: bool = False


METADATA = "__metadata__"  # the header's own entry: no tensor may take its name


def resolve(names: Names, keys: Sequence[tuple[str, str]], *, shared: bool = False) -> list[Named | None]:
    """Per ``(key path, default name)``: its tensor, or None when the spec drops it. Keys a
    dict does not name are reported together; two keys given one name too, unless ``shared``
    (a load may read one tensor into several leaves: a tied embedding and its head; an
    export would write two tensors under one name)."""
    out = [_named(names, key, default) for key, default in keys]
    reserved = [n.key for n in out if isinstance(n, Named) and n.name == METADATA]
    if reserved:
        raise ValueError(
            f"{reserved[0]!r} would be the tensor {METADATA!r}, a name the safetensors header keeps for its "
            "metadata; give it another through names"
        )
    unmapped = [key for (key, _), named in zip(keys, out) if named is _UNMAPPED]
    if unmapped:
        raise TargetMismatchError(
            f"names has no entry for {len(unmapped)} key(s): {unmapped[:20]}; map each to a tensor name, "
            "or to null to leave it out",
            key=unmapped[0],
        )
    taken: dict[str, str] = {}
    for named in out:
        if not shared and isinstance(named, Named) and taken.setdefault(named.name, named.key) != named.key:
            raise TargetMismatchError(
                f"names gives {taken[named.name]!r} and {named.key!r} the same tensor name {named.name!r}",
                key=named.key,
            )
    return [n if isinstance(n, Named) else None for n in out]


_UNMAPPED = object()


def _named(names: Names, key: str, default: str) -> Any:
    if names is None:
        return Named(key, default)
    if callable(names):
        spec = names(key)
    elif key in names:
        spec = names[key]
    else:
        return _UNMAPPED
    if spec is None:
        return None
    if isinstance(spec, str):
        return Named(key, spec)
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str) and set(spec) <= {"name", "transpose"}:
        return Named(key, spec["name"], bool(spec.get("transpose", False)))
    raise ValueError(
        f"names gives {key!r} {spec!r}; give a tensor name, None, or {{'name': ..., 'transpose': True}}"
    )
