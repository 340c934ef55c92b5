"""Key paths: how a leaf of a pytree is named in a checkpoint.

A leaf's checkpoint key is its JAX key path with entries joined by ``/`` (dict key ->
``str(key)``, attribute -> its name, sequence index -> the number). Keys are the only link
between a checkpoint and a restore target, so restoring into a differently built but
equally named tree (a ``TrainState`` from a dict, NNX state from Linen) just works.

Besides the joined string we keep each entry's kind (``dict``/``attr``/``seq``), so a
checkpoint restored without a target comes back as nested dicts and lists.

JAX is imported inside the functions that walk a pytree, not at module level: the manifest
decoder needs ``join``, and the command line reads manifests without paying JAX's import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

PathEntry = tuple[str, Any]  # ("dict", key) | ("attr", name) | ("seq", index)


def path_entries(path: tuple[Any, ...]) -> list[PathEntry]:
    """Turns a ``jax.tree_util`` key path into ``(kind, name)`` entries."""
    import jax

    entries: list[PathEntry] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            entries.append(("dict", k.key if isinstance(k.key, (int, str)) else str(k.key)))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            entries.append(("attr", k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            entries.append(("seq", k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            entries.append(("seq", k.key))
        else:
            entries.append(("dict", str(k)))
    return entries


def join(entries: Iterable[PathEntry]) -> str:
    """``[("attr", "params"), ("dict", "w")]`` -> ``"params/w"``."""
    return "/".join(str(name) for _, name in entries)


def flatten(tree: Any, *, keep_none: bool = False) -> tuple[list[tuple[str, list[PathEntry], Any]], Any]:
    """Flattens ``tree`` into ``(key, entries, leaf)`` triples in tree-flatten order.

    ``keep_none`` treats ``None`` as a leaf (saving records it); otherwise ``None`` is an
    empty subtree as everywhere in JAX (a target's ``None`` reads nothing).

    Raises ValueError when a name contains ``/``, or when two different key paths, of leaves
    or of the subtrees above them, get the same key (see :class:`_Keys`).
    """
    import jax

    is_leaf: Callable[[Any], bool] | None = (lambda x: x is None) if keep_none else None
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    out = []
    given = _Keys()
    for path, leaf in with_path:
        entries = path_entries(path)
        for _, name in entries:
            if "/" in str(name):
                raise ValueError(
                    f"Tree key {name!r} (in {jax.tree_util.keystr(path)}) contains '/', which "
                    "tpu_ckpt uses to join key paths; rename it."
                )
        out.append((given.add(path, entries), entries, leaf))
    return out, treedef


class _Keys:
    """The checkpoint keys given so far, of leaves and of the subtrees above them, each with
    the key path it stands for.

    Keys are strings, so two different key paths can join into one: ``{1: a, "1": b}``,
    ``{0.1: a, np.float32(0.1): b}``, a node with an attribute ``params`` and a dict key
    ``'params'``. Of two such leaves one would be saved over the other; of two such subtrees
    (``params/w`` and ``params/b``) both would be saved, but a restore without a target
    rebuilds one ``params`` and loses a leaf. Leaves come in tree-flatten order, where a
    subtree's leaves are consecutive, so a subtree's key is given once, with its first leaf:
    a key given again stands for another path.
    """

    def __init__(self) -> None:
        self._paths: dict[str, tuple[Any, ...]] = {}
        self._last: tuple[Any, ...] = ()
        self._keys: list[str] = []  # the keys of the last leaf's path prefixes, outermost first

    def add(self, path: tuple[Any, ...], entries: list[PathEntry]) -> str:
        """The leaf's key; raises ValueError if it, or a subtree's above it, was given before."""
        last, self._last = self._last, path
        most, shared = min(len(last), len(path)), 0
        while shared < most and (last[shared] is path[shared] or _same(last[shared], path[shared])):
            shared += 1  # JAX hands a parent's keys to each of its leaves as the same objects
        if shared and shared in (len(last), len(path)):  # a node that names two children alike
            shared -= 1
        given = self._keys
        del given[shared:]
        key = given[-1] if given else ""
        for depth in range(shared, len(path)):
            name = str(entries[depth][1])
            key = f"{key}/{name}" if depth else name
            if key in self._paths:
                raise ValueError(
                    f"Tree paths {_describe_path(self._paths[key])} and {_describe_path(path[: depth + 1])} both "
                    f"become checkpoint key {key!r}, so one would overwrite the other in the checkpoint; "
                    "rename one of them."
                )
            self._paths[key] = path[: depth + 1]
            given.append(key)
        return key


def _same(one: Any, other: Any) -> bool:
    """Whether two JAX path keys name the same child (dict keys ``0`` and ``False`` are
    equal, not the same)."""
    return one == other and type(getattr(one, "key", None)) is type(getattr(other, "key", None))


def _describe_path(path: tuple[Any, ...]) -> str:
    """A JAX key path with each dict key's type, since keys that differ only in type
    (``1`` and ``'1'``, ``0.1`` and ``np.float32(0.1)``) are what make keys collide."""
    import jax

    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(f"[{k.key!r} ({type(k.key).__name__})]")
        else:
            parts.append(jax.tree_util.keystr((k,)))
    return "".join(parts)


def normalise_subtree(prefix: str | None) -> tuple[str, int]:
    """A subtree argument normalised (``"/params/"`` -> ``"params"``) and how many path
    entries it spans, which its leaves' paths lose when it is restored or exported alone."""
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(
            f"subtree must be a key path string as `tpu-ckpt inspect` shows it ('params', 'opt_state/0'), or None; "
            f"got {prefix!r}"
        )
    prefix = (prefix or "").strip("/")
    return prefix, len(prefix.split("/")) if prefix else 0


def under(key: str, prefix: str) -> bool:
    """Whether ``key`` is ``prefix`` itself or lies below it."""
    return not prefix or key == prefix or key.startswith(prefix + "/")


def node_clash(paths: Iterable[list[PathEntry]]) -> str | None:
    """The key of a node that two paths reach by different entries (``params`` as an attribute
    and as a dict entry, or a dict's ``0`` and a list's), so that a tree rebuilt from them
    would hold one and lose the other's leaves; None when all agree."""
    nodes: dict[str, tuple[int, str, Any]] = {}
    for path in paths:
        key = ""
        for depth, (kind, name) in enumerate(path[:-1]):
            key = f"{key}/{name}" if depth else str(name)
            if nodes.setdefault(key, (depth, kind, name)) != (depth, kind, name):
                return key
    return None


def unflatten_nested(items: Iterable[tuple[list[PathEntry], Any]]) -> Any:
    """Rebuilds nested dicts (from dict/attr entries) and lists (from seq entries).

    Raises ValueError when the paths do not form a tree: a key both a leaf and a subtree
    (``params`` and ``params/w``), or one node's two children of one name (an attribute and
    a dict entry ``params``), of which one would be lost."""
    root = _Node()
    for entries, value in items:
        if not entries:
            return value
        node = root
        for depth, entry in enumerate(entries[:-1]):
            node = node.setdefault(entry, _Node())
            if not isinstance(node, _Node):
                raise ValueError(
                    f"key {join(entries[: depth + 1])!r} is both a leaf and a subtree (of {join(entries)!r})"
                )
        if isinstance(node.get(entries[-1]), _Node):
            raise ValueError(f"key {join(entries)!r} is both a leaf and a subtree")
        node[entries[-1]] = value
    return _materialize(root)


class _Node(dict):
    """An inner node while rebuilding; distinguishes containers from leaf values."""


def _materialize(node: Any) -> Any:
    if not isinstance(node, _Node):
        return node
    if node and all(kind == "seq" for kind, _ in node):
        out: list[Any] = [None] * (max(i for _, i in node) + 1)
        for (_, i), child in node.items():
            out[i] = _materialize(child)
        return out
    named = {name: _materialize(child) for (_, name), child in node.items()}
    if len(named) < len(node):
        names = [name for _, name in node]
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"two children of one node are both named {twice!r} (an attribute and a dict entry, say)")
    return named
