"""When a CheckpointManager's ``save`` writes: every rule set must say a save is due.

- ``save_interval_steps``: by default TensorFlow's ``checkpoint_interval`` (a step at least
  that many steps past the last one saved or restored; a manager's first save is always
  due). With ``save_on_multiples``, Orbax's rule: steps that are multiples of the interval
  (0, 10, 20, ...), and only steps past the last one saved or restored.
- ``save_interval_seconds``: Orbax's continuous checkpointing: only when this manager has
  no save in flight (an asynchronous one still writing), and at least that many seconds
  after the last save started (or the last restore).

The rules are combined with "and", so no rule can silently switch another off (the v0
Orbax flags could). A forced save ignores them all. With ``local_directory`` the manager keeps a
second one for the local tier (``local_interval_steps``, the step rule alone).
"""

from __future__ import annotations

import math
import time
from typing import Any


class Cadence:
    """The save rules, and the last step saved or restored (and when) that they count from."""

    def __init__(
        self, every_steps: Any, on_multiples: Any, every_seconds: Any, steps_name: str = "save_interval_steps"
    ):
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"{steps_name} must be a positive integer, got {every_steps!r}")
        if type(on_multiples) is not bool:
            raise ValueError(f"save_on_multiples must be True or False, got {on_multiples!r}")
        if every_seconds is not None and (
            isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float))
            or not 0 <= every_seconds < math.inf
        ):
            raise ValueError(f"save_interval_seconds must be a number of seconds >= 0 or None, got {every_seconds!r}")
        self.every_steps = every_steps
        self.on_multiples = on_multiples
        self.every_seconds = every_seconds
        self.last_step: int | None = None  # saved or restored; None: no step rule holds a save back
        self._last_time = -math.inf  # time.monotonic() of that save or restore

    def steps_due(self, step: int) -> bool:
        """The step rule. Every process of a job has saved and restored the same steps, so
        this agrees everywhere without asking anyone."""
        if self.on_multiples:
            return step % self.every_steps == 0 and (self.last_step is None or step > self.last_step)
        return self.last_step is None or step >= self.last_step + self.every_steps

    def time_due(self, in_flight: bool) -> bool:
        """The continuous rule, given whether this manager's last save is still in flight."""
        if self.every_seconds is None:
            return True
        return not in_flight and time.monotonic() - self._last_time >= self.every_seconds

    def counts_from(self, step: int) -> None:
        """Records a save or a restore of ``step``: the intervals count from here."""
        self.last_step = step
        self._last_time = time.monotonic()

