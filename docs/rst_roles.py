"""A griffe extension for `make docs`: the Sphinx roles our docstrings use (``:class:`X```,
``:func:`x```, ``:meth:`x```) become links to the reference entry they name, so the HTML shows
links rather than role markup, and ``mkdocs build --strict`` fails on a role naming nothing.

Public names resolve to the module defining them (``tpu_ckpt.save`` is ``tpu_ckpt.save.save``);
a bare method name resolves to the class whose docstring uses it.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

import tpu_ckpt

_ROLE = re.compile(r":(?:class|func|meth|attr|exc):`~?([\w.]+)`")


def _target(name: str, obj: griffe.Object) -> str:
    head, _, rest = name.removeprefix("tpu_ckpt.").partition(".")
    module = tpu_ckpt._MODULE_OF.get(head)
    if module is not None:
        return ".".join(filter(None, (f"tpu_ckpt.{module}.{head}", rest)))
    owner = obj if obj.is_class else obj.parent
    return f"{owner.path}.{name}" if owner is not None and owner.is_class else name


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(
                lambda m: f"[`{m.group(1)}`][{_target(m.group(1), obj)}]", obj.docstring.value
            )
