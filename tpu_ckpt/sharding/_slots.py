"""Which leaves are optimizer slot variables, decided at save time and kept in the manifest.

A slot is per-parameter optimizer state: Adam's ``mu``/``nu``, momentum ``trace``,
RMSProp's ``nu``, Adafactor's factored moments, gradient accumulators. A serving job
restoring with ``skip_slot_variables`` never reads them, and because the decision is stored
in the checkpoint it needs neither optax nor the optimizer's structure to do so.

The rule: a leaf is a slot when it is not a scalar and it lies
  * under a key path entry named ``opt_state`` (Flax Linen ``TrainState``, NNX
    ``nnx.Optimizer`` state, and the usual name for a plain optax state), or
  * inside an optax state object (a NamedTuple defined by optax), under any name.
Scalars in optimizer state (step ``count``s, injected hyperparameters) are not slots: they
are tiny, and a restored optimizer needs them. Params and every other leaf are not slots.
A custom optimizer that this misses can be described with ``save(..., is_slot=predicate)``,
where ``predicate(key, leaf) -> bool`` replaces the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from tpu_ckpt.format import PathEntry, join, path_entries, under

SlotPredicate = Callable[[str, Any], bool]
OPT_STATE = "opt_state"


def slot_keys(tree: Any, leaves: list[tuple[str, list[PathEntry], Any]], predicate: SlotPredicate | None) -> set[str]:
    """The checkpoint keys of ``leaves`` (flattened from ``tree``) that are slots."""
    if predicate is not None:
        return {key for key, _, leaf in leaves if _is_array(leaf) and predicate(key, leaf)}
    optax_roots = _optax_state_prefixes(tree)
    slots = set()
    for key, entries, leaf in leaves:
        if not _is_array(leaf) or not getattr(leaf, "shape", ()):
            continue
        under_opt_state = any(name == OPT_STATE for _, name in entries)
        if under_opt_state or any(under(key, root) for root in optax_roots):
            slots.add(key)
    return slots


def _is_array(leaf: Any) -> bool:
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


def _is_optax_state(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields") and type(node).__module__.startswith("optax")


def _optax_state_prefixes(tree: Any) -> list[str]:
    """Key paths of every optax state object in ``tree`` (without importing optax)."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_optax_state)
    return [join(path_entries(path)) for path, node in with_path if _is_optax_state(node)]
