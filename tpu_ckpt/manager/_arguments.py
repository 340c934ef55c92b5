"""A CheckpointManager's arguments checked as its users write them: steps that must be
integers, and Orbax's keywords (``args=``) and options answered with the call to write instead."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping
from typing import Any

from tpu_ckpt.options import CheckpointOptions


def check_step(step: Any, usage: str) -> int:
    """``step`` as an int, or a TypeError saying how ``usage`` is called (a pytree passed
    where a step goes would otherwise fill the message with its repr)."""
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer, got {step!r}: call {usage}")
    try:
        value = operator.index(step)  # int, numpy and jax integer scalars
    except TypeError:
        text = repr(step)
        shown = text if len(text) <= 60 else f"{text[:40]}..."  # a TrainState's repr runs to kilobytes
        raise TypeError(f"step must be an integer, got {shown} of type {type(step).__name__}: call {usage}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    return value


def names_a_step(arg: Any) -> bool:
    """Whether ``restore``'s first argument is meant as a step (possibly a wrong one, which
    is then refused) rather than as a target pytree."""
    if isinstance(arg, (str, bytes, numbers.Number)):
        return True
    try:
        operator.index(arg)
    except TypeError:
        return False
    return True


def restore_arguments(step: Any, target: Any, orbax: Mapping[str, Any]) -> tuple[int | None, Any]:
    """``CheckpointManager.restore``'s step (checked) and target: ``restore(target)``, Orbax's
    habit, is ``restore(None, target)``; a non-integer step with a target is a TypeError."""
    refuse_orbax_keywords("restore(step, abstract_state)", orbax)
    if step is not None and not names_a_step(step):
        if target is not None:
            raise TypeError(
                f"restore() got a {type(step).__name__} as its step, and a target: call "
                "restore(target) for the latest step, or restore(step, target) with an integer step."
            )
        step, target = None, step
    return (None if step is None else check_step(step, "restore(step, target)")), target


NO_TREE = object()  # CheckpointManager.save's tree when none is given (Orbax passes it as args=)


def refuse_orbax_keywords(call: str, keywords: Mapping[str, Any], missing: bool = False) -> None:
    """Keywords a manager method does not take, as Orbax's ``args=ocp.args.StandardSave(state)``,
    or (``missing``) no tree at all: a TypeError naming the call to write here instead
    (``call``, e.g. ``save(step, state)``)."""
    if not keywords:
        if missing:
            raise TypeError(f"CheckpointManager.{call.split('(')[0]}() needs the tree to save: manager.{call}.")
        return
    hint = ""
    if "args" in keywords:
        hint = f" Orbax's args=ocp.args.Standard...(x) is a plain argument here: manager.{call}."
    names = ", ".join(sorted(keywords))
    raise TypeError(f"CheckpointManager.{call.split('(')[0]}() got unexpected keyword arguments: {names}.{hint}")


def manager_options(options: Any) -> CheckpointOptions:
    """A CheckpointManager's options: ``None`` is the defaults. Orbax's habit,
    ``options=ocp.CheckpointManagerOptions(...)``, is refused naming the keywords that say
    the same here (it would otherwise fail later, on a missing ``io_device``)."""
    if options is None:
        return CheckpointOptions()
    if isinstance(options, CheckpointOptions):
        return options
    hint = ""
    if type(options).__name__ == "CheckpointManagerOptions":
        hint = (
            " Orbax's CheckpointManagerOptions fields are CheckpointManager's own keywords here: "
            "CheckpointManager(directory, max_to_keep=..., save_interval_steps=..., save_on_multiples=True, "
            "keep_checkpoint_every_n_hours=..., best_fn=..., best_mode=...); asynchronous saves are "
            "options=tpu_ckpt.CheckpointOptions(enable_async=True)."
        )
    raise TypeError(
        f"CheckpointManager(options=...) takes a tpu_ckpt.CheckpointOptions, not {type(options).__name__}.{hint}"
    )
