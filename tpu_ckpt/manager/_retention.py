"""Which committed steps a CheckpointManager keeps, and which it lets go.

Two families of rules meet here. TensorFlow's keeps the newest ``max_to_keep`` and one
every ``keep_checkpoint_every_n_hours``. Orbax's ``best_fn``/``best_mode`` keeps the
checkpoints a metric ranks best. Each rule only ever keeps, so none can silently undo
another: a step is removed only when every rule lets it go. Orbax's ``max_to_keep`` with a
``best_fn`` keeps the best ones *instead of* the newest, and so may delete the step a
restart resumes from. Here the best are kept in addition to the newest, and the step just
saved always counts as the newest (``max_to_keep`` is at least 1).

Everything is decided from the directory alone (step numbers, manifest mtimes, the metrics
in manifests), so a manager created after a restart keeps exactly what the last one would.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from tpu_ckpt import storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.errors import CheckpointError

logger = logging.getLogger(__name__)

BestFn = Callable[[Mapping[str, float]], float]
_MODES = ("max", "min")


@dataclasses.dataclass(frozen=True)
class Retention:
    """The manager's retention rules, checked once when the manager is created."""

    max_to_keep: int | None
    every_n_hours: float | None
    keep_best: int | None = None
    best_fn: BestFn | None = None
    best_mode: str = "max"

    @classmethod
    def checked(
        cls,
        loc: storage.Location,
        max_to_keep: Any,
        every_n_hours: Any,
        keep_best: Any,
        best_fn: Any,
        best_mode: Any,
    ) -> Retention:
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep <= 0
        ):
            raise ValueError(f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep!r}.")
        _check_best(max_to_keep, keep_best, best_fn, best_mode)
        return cls(max_to_keep, _check_hours(every_n_hours, loc), keep_best, best_fn, best_mode)

    @property
    def rules(self) -> str:
        """The rules, as removals' log lines name them."""
        return (
            f"max_to_keep={self.max_to_keep}, keep_checkpoint_every_n_hours={self.every_n_hours}, "
            f"keep_best={self.keep_best}"
        )

    @property
    def ranks(self) -> bool:
        """Whether steps are ranked by their metrics (so their manifests must be read)."""
        return self.keep_best is not None

    def expired(
        self,
        committed: list[int],
        just_saved: int,
        *,
        commit_time: Callable[[int], float],
        preserved_since: float,
        score: Callable[[int], float | None],
    ) -> list[int]:
        """The steps to remove after ``just_saved`` was committed.

        ``commit_time(step)`` is asked only with ``every_n_hours``; ``score(step)`` only with
        ``keep_best``, and gives None for a step without a usable score.
        """
        if self.max_to_keep is None:
            return []
        order = [s for s in sorted(committed) if s != just_saved] + [just_saved]
        old = order[: -self.max_to_keep]
        if self.every_n_hours is not None:
            old = self._not_preserved(old, self.every_n_hours, commit_time, preserved_since)
        best = self._best(committed, score) if self.ranks else set()
        return [s for s in old if s not in best]

    def _not_preserved(
        self, old: list[int], hours: float, commit_time: Callable[[int], float], preserved_since: float
    ) -> list[int]:
        """TF's ``_sweep``: walking the steps older than the newest ``max_to_keep``, keeps one
        whenever ``hours`` (``every_n_hours``) have passed since the last one kept. Those kept stay older
        than the newest, so every sweep walks them again and keeps them again."""
        expired, last_kept = [], preserved_since
        for s in old:
            committed_at = commit_time(s)
            if committed_at - hours * 3600 >= last_kept:
                last_kept = committed_at
            else:
                expired.append(s)
        return expired

    def _best(self, committed: list[int], score: Callable[[int], float | None]) -> set[int]:
        """The ``keep_best`` steps with the best scores; of equal scores, the newer step wins."""
        scored = [(value, s) for s in committed if (value := score(s)) is not None]
        sign = -1 if self.best_mode == "max" else 1
        scored.sort(key=lambda item: (sign * item[0], -item[1]))
        return {s for _, s in scored[: self.keep_best]}

    def score(self, metrics: Mapping[str, float], step: int) -> float | None:
        """``best_fn(metrics)`` as a number; None for NaN, which ranks no step best, and
        without a ``best_fn``.

        Raises TypeError naming the step when ``best_fn`` fails or returns no number: the
        manager asks at ``save``, so a broken ``best_fn`` fails there, not in the background.
        """
        if self.best_fn is None:
            return None
        try:
            value = self.best_fn(metrics)
        except Exception as error:
            raise TypeError(f"best_fn failed on the metrics of step {step} ({sorted(metrics)}): {error!r}") from error
        wrong = f"best_fn must return a number; on the metrics of step {step} it returned {type(value).__name__}"
        if isinstance(value, bool) or not (isinstance(value, numbers.Real) or getattr(value, "shape", None) == ()):
            raise TypeError(wrong)
        try:
            value = float(value)  # a 0-d numpy or JAX array too
        except (TypeError, ValueError):
            raise TypeError(wrong) from None
        return None if math.isnan(value) else value


def _check_best(max_to_keep: Any, keep_best: Any, best_fn: Any, best_mode: Any) -> None:
    if best_mode not in _MODES:
        raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
    if keep_best is None:
        if best_fn is not None:
            raise ValueError(
                "best_fn needs keep_best: how many of the best steps to keep besides the newest max_to_keep "
                "(Orbax's max_to_keep=3 with best_fn is keep_best=3, max_to_keep=1 here)."
            )
        return
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best <= 0:
        raise ValueError(f"keep_best must be a positive integer or None, got {keep_best!r}")
    if not callable(best_fn):
        raise ValueError(f"keep_best needs best_fn, a function from a step's metrics to a number, got {best_fn!r}")
    if max_to_keep is None:
        raise ValueError("keep_best has no effect with max_to_keep=None, which keeps every step; set max_to_keep too.")


def _check_hours(value: Any, loc: storage.Location) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"keep_checkpoint_every_n_hours must be a positive number of hours or None, got {value!r}")
    if not loc.is_local:
        raise ValueError(
            f"keep_checkpoint_every_n_hours needs commit times, read from manifest mtimes on a local "
            f"disk; {loc.url} is not local, and object stores (through tensorstore) report no "
            "modification times. Use max_to_keep alone there."
        )
    return float(value)


def saved_score(rules: Retention, loc: storage.Location, step: int) -> float | None:
    """The ``best_fn`` score of the step saved at ``loc``, from its manifest. A step whose
    manifest or score cannot be had is kept by the other rules only, and a warning says why."""
    try:
        with open_checkpoint(loc, threads=1) as checkpoint:
            metrics = checkpoint.manifest.metrics
        return None if metrics is None else rules.score(metrics, step)
    except (CheckpointError, TypeError) as error:
        logger.warning("tpu_ckpt: step %d is not ranked by best_fn, so keep_best cannot keep it: %s", step, error)
        return None
