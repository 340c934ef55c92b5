"""Checkpoint: TensorFlow's ``tf.train.Checkpoint``, for pytrees.

``Checkpoint(model=state, data=loader_state)`` holds named pytrees as attributes. ``save``
writes ``<prefix>-<n>`` and bumps ``save_counter``; ``write`` writes exactly the path given;
``restore``/``read`` load a checkpoint back into the attributes, using their current values
as targets (so arrays come back with the same shape, dtype and sharding).

Unlike TF's async path, which snapshots only the variables that existed at the first async
save, every save here flattens the attributes as they are at that moment: a tree assigned
after construction is saved too.
"""

from __future__ import annotations

import os
from typing import Any

from tpu_ckpt.options import CheckpointOptions
from tpu_ckpt.restoring import restore as restore_tree
from tpu_ckpt.saving import SaveResult
from tpu_ckpt.saving import save as save_tree

_COUNTER = "save_counter"


class Checkpoint:
    """Named pytrees saved and restored together, TF style.

    Example::

        ckpt = tc.Checkpoint(state=train_state, step=0)
        path = ckpt.save("/ckpts/run")        # "/ckpts/run-1"
        ckpt.restore(path)                    # loads back into ckpt.state and ckpt.step

    Args:
      **trees: the named pytrees, readable and assignable as attributes (``ckpt.state``).

    Raises:
      ValueError: a tree is named ``save_counter``, which the Checkpoint keeps itself.
    """

    save_counter: int
    _trees: dict[str, Any]
    _last_save: SaveResult | None

    def __init__(self, **trees: Any):
        if _COUNTER in trees:
            raise ValueError(f"{_COUNTER!r} is managed by the Checkpoint; pick another name")
        object.__setattr__(self, "_trees", dict(trees))
        object.__setattr__(self, "_last_save", None)
        object.__setattr__(self, _COUNTER, 0)

    def __getattr__(self, name: str) -> Any:
        trees = object.__getattribute__(self, "_trees")
        if name in trees:
            return trees[name]
        raise AttributeError(f"Checkpoint has no tree named {name!r} (it holds {sorted(trees)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == _COUNTER:
            if name == _COUNTER and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"save_counter must be a non-negative int, got {value!r}")
            object.__setattr__(self, name, value)
        else:
            self._trees[name] = value

    def __delattr__(self, name: str) -> None:
        if name not in self._trees:
            raise AttributeError(name)
        del self._trees[name]

    def save(self, file_prefix: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Saves to ``<file_prefix>-<save_counter + 1>`` and bumps ``save_counter`` (not when it fails).

        Args:
          file_prefix: the checkpoint path before ``-<number>``.
          options: :class:`CheckpointOptions` for this save.

        Returns:
          The path written.

        Raises:
          CheckpointExistsError: the path already holds something.
          CheckpointError: as :func:`tpu_ckpt.save` raises.
        """
        path = f"{os.fspath(file_prefix)}-{self.save_counter + 1}"
        self.save_counter += 1
        try:
            return self._save(path, options)
        except BaseException:
            self.save_counter -= 1  # nothing was saved under that number
            raise

    def write(self, file_prefix: str | os.PathLike[str], options: CheckpointOptions | None = None) -> str:
        """Saves to exactly ``file_prefix``; ``save_counter`` is unchanged.

        Args:
          file_prefix: the checkpoint path.
          options: :class:`CheckpointOptions` for this save.

        Returns:
          The path written.

        Raises:
          CheckpointExistsError: the path already holds something.
          CheckpointError: as :func:`tpu_ckpt.save` raises.
        """
        return self._save(os.fspath(file_prefix), options)

    def restore(self, save_path: str | os.PathLike[str], options: CheckpointOptions | None = None) -> Checkpoint:
        """Loads ``save_path`` into the attributes (and ``save_counter``).

        Args:
          save_path: a path ``save`` or ``write`` returned.
          options: :class:`CheckpointOptions` for this restore.

        Returns:
          This Checkpoint, its trees replaced by the restored ones.

        Raises:
          CheckpointNotFoundError: nothing is committed at ``save_path``.
          TargetMismatchError: a tree's structure, shapes or dtypes differ from the saved one.
          CheckpointError: as :func:`tpu_ckpt.restore` raises.
        """
        return self._load(save_path, options, with_counter=True)

    def read(self, save_path: str | os.PathLike[str], options: CheckpointOptions | None = None) -> Checkpoint:
        """:meth:`restore` (the same ``save_path``, ``options``, result and errors), leaving
        ``save_counter`` as it is."""
        return self._load(save_path, options, with_counter=False)

    def sync(self) -> None:
        """Waits for this object's in-flight asynchronous save.

        Raises:
          CheckpointError: the background write failed (its error, re-raised).
        """
        if self._last_save is not None:
            self._last_save.wait()

    def _save(self, path: str, options: CheckpointOptions | None) -> str:
        tree = {**self._trees, _COUNTER: self.save_counter}
        result: SaveResult = save_tree(path, tree, options=options)
        self._last_save = result
        return result.path

    def _load(
        self, save_path: str | os.PathLike[str], options: CheckpointOptions | None, *, with_counter: bool
    ) -> Checkpoint:
        target = dict(self._trees)
        if with_counter:
            target[_COUNTER] = self.save_counter
        restored = restore_tree(save_path, target, options=options)
        if with_counter:
            self.save_counter = int(restored.pop(_COUNTER))
        self._trees.update(restored)
        return self
