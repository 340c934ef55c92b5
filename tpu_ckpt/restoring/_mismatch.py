"""Every way a target does not fit a checkpoint, listed at once (``tc.restore`` raises them
together, ``tc.check_restore`` reports them), from the planner's own leaf check."""

from __future__ import annotations

from typing import Any

from tpu_ckpt.errors import TargetMismatchError
from tpu_ckpt.format import Manifest, flatten, normalise_subtree, under
from tpu_ckpt.restoring._plan import plan_leaf


def mismatches(
    manifest: Manifest, target: Any, subtree: str | None, skip_slots: bool, url: str
) -> list[TargetMismatchError]:
    """Every error the planner raises on, leaf by leaf, in the target's flatten order (so
    the first is the one ``plan_restore`` raises)."""
    prefix, _ = normalise_subtree(subtree)
    leaves = {leaf.key: leaf for leaf in manifest.leaves if under(leaf.key, prefix)}
    if target is None or not leaves:
        return []  # the planner's own error (an unknown subtree) is the only one
    found = []
    for key, _, leaf_target in flatten(target)[0]:
        try:
            plan_leaf(leaves, f"{prefix}/{key}" if prefix and key else prefix or key, leaf_target, skip_slots, url)
        except TargetMismatchError as error:
            found.append(error)
    return found


def all_mismatches(
    first: TargetMismatchError, manifest: Manifest, target: Any, subtree: str | None, skip_slots: bool, url: str
) -> TargetMismatchError:
    """What ``tc.restore`` raises when the planner raised ``first``: ``first`` itself when it
    is the only mismatch, else one error listing them all, as ``check_restore`` reports them."""
    found = mismatches(manifest, target, subtree, skip_slots, url)
    if len(found) <= 1:
        return first
    lines = "\n".join(f"  {e}" for e in found)
    return TargetMismatchError(
        f"{len(found)} target leaves do not fit checkpoint {url}:\n{lines}", key=first.key, file=first.file
    )
