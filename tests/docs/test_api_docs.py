"""The API reference (issue #27): every name ``tpu_ckpt`` exports has a Google-style docstring
that says its arguments, what it returns and what it raises, and docs/api.md renders it.

The docstrings are read with griffe, the parser mkdocstrings uses for `make docs`, so a section
this test accepts is one the HTML reference shows as such. `make test` also builds the docs with
``mkdocs build --strict``, which fails on a documented parameter the signature lacks.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from pathlib import Path

import griffe
import pytest

import tpu_ckpt as tc

ROOT = Path(__file__).resolve().parents[2]
API_MD = ROOT / "docs" / "api.md"


@pytest.fixture(scope="module")
def package() -> griffe.Module:
    return griffe.load("tpu_ckpt", search_paths=[str(ROOT)], docstring_parser="google")


def _path(name: str) -> str:
    """The defining module's path, as docs/api.md's ``:::`` directives name it."""
    return f"tpu_ckpt.{tc._MODULE_OF[name]}.{name}"


def _sections(obj: griffe.Object, name: str) -> dict[str, list]:
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{name} has no docstring"
    return {section.kind.value: section.value for section in obj.docstring.parsed}


def _documented_names(obj: griffe.Object, sections: dict[str, list]) -> set[str]:
    """Entries of Args and Attributes, and names the text quotes (``experimental_io_device``:
    aliases described together rather than one entry each)."""
    items = [*sections.get("parameters", []), *sections.get("attributes", [])]
    return {item.name.lstrip("*") for item in items} | set(re.findall(r"``\**(\w+)``", obj.docstring.value))


def _parameters(value: object) -> list[str]:
    if not callable(value):
        return []
    params = inspect.signature(value).parameters.values()
    return [p.name for p in params if p.name not in ("self", "cls")]


def _is_plain_record(value: object) -> bool:
    """Exceptions and dataclasses without validation: constructing one raises nothing."""
    if isinstance(value, type) and issubclass(value, BaseException):
        return True
    return dataclasses.is_dataclass(value) and not hasattr(value, "__post_init__")


def _own_init_parameters(value: type) -> list[str]:
    """An exception's constructor arguments, when it defines its own (else its base documents them)."""
    return _parameters(value) if "__init__" in vars(value) else []


def test_api_md_renders_every_public_name():
    text = API_MD.read_text()
    missing = [name for name in tc.__all__ if f"::: {_path(name)}\n" not in text]
    assert not missing, f"docs/api.md has no ::: directive for {missing}"


@pytest.mark.parametrize("name", tc.__all__)
def test_public_name_documents_arguments_returns_and_raises(package, name, caplog):
    value = getattr(tc, name)
    obj = package[_path(name).removeprefix("tpu_ckpt.")]
    with caplog.at_level(logging.WARNING, logger="griffe"):
        sections = _sections(obj, name)
    assert not caplog.records, f"{name}'s docstring does not parse as Google style: {caplog.messages}"
    if not callable(value):
        return  # FORMAT_VERSION: a constant; its docstring is all there is to say
    is_exception = isinstance(value, type) and issubclass(value, BaseException)
    params = _own_init_parameters(value) if is_exception else _parameters(value)
    undocumented = set(params) - _documented_names(obj, sections)
    assert not undocumented, f"{name}'s docstring has no Args/Attributes entry for {sorted(undocumented)}"
    if inspect.isfunction(value) and inspect.signature(value).return_annotation not in ("None", None):
        assert sections.get("returns"), f"{name}'s docstring has no Returns section"
    if not _is_plain_record(value) and params:
        assert sections.get("raises"), f"{name}'s docstring has no Raises section"


def _public_members(name: str) -> list[str]:
    """The methods and properties a class exported by ``tpu_ckpt`` defines (not inherited)."""
    value = getattr(tc, name)
    if not isinstance(value, type) or issubclass(value, BaseException):
        return []
    return [f"{name}.{m}" for m, v in vars(value).items() if (m == "__call__" or not m.startswith("_"))
            and (callable(v) or isinstance(v, property))]


@pytest.mark.parametrize("member", [m for name in tc.__all__ for m in _public_members(name)])
def test_public_methods_say_why_and_name_their_arguments(package, member, caplog):
    """The reference lists each class's methods too; a property needs only its one line."""
    name, attr = member.split(".")
    obj = package[_path(name).removeprefix("tpu_ckpt.")][attr]
    with caplog.at_level(logging.WARNING, logger="griffe"):
        sections = _sections(obj, member)
    assert not caplog.records, f"{member}'s docstring does not parse as Google style: {caplog.messages}"
    undocumented = set(_parameters(getattr(getattr(tc, name), attr))) - _documented_names(obj, sections)
    assert not undocumented, f"{member}'s docstring does not name {sorted(undocumented)}"
