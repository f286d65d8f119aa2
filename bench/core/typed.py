"""Frozen dataclasses to and from JSON: one generic pair for every suite's figures.

A suite's result is written to ``<stem>.json`` with :meth:`Record.to_json` and read back
(by the report, the plots, ``merge``) with :meth:`Record.from_json`, which checks every
field against the dataclass's annotations. A file written by another version of bench/
therefore fails in one place, with the field's path (``workloads[0].levels[1].cap:
missing``), instead of somewhere in the middle of rendering a table.

Supported annotations: dataclasses (nested), ``list[X]``, ``tuple[X, ...]`` and fixed
tuples (JSON arrays), ``dict[str, X]``, ``X | None``, ``str``, ``int``, ``float`` (an int
is accepted), ``bool`` and ``Json`` (any JSON value, kept as it is: raw per-run records the
report never reads). A key the record does not have is a mismatch too: writing the
record again would lose it. A field whose JSON key is not its name (``from``, ``class``) says
so with ``field(metadata=key("from"))``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, Self, TypeVar, Union

# Any JSON value: what a field holds when bench/ keeps it without reading it.
Json = Any
T = TypeVar("T")
_KEY = "json_key"


def key(name: str) -> dict[str, str]:
    """Field metadata: this field is *name* in JSON (a Python keyword, a dash)."""
    return {_KEY: name}


class ResultMismatch(ValueError):
    """A JSON document that does not have the shape of the record it should hold."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where or '(top)'}: {why}")
        self.where, self.why = where, why


class Record:
    """Base of every result dataclass: :meth:`to_json` and :meth:`from_json`."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> dict[str, Json]:
        out = to_json(self)
        assert isinstance(out, dict)
        return out

    @classmethod
    def from_json(cls, data: Json, where: str = "") -> Self:
        return from_json(cls, data, where)


def to_json(value: object) -> Json:
    """*value* as plain JSON data (dataclasses by their JSON keys, tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.metadata.get(_KEY, f.name): to_json(getattr(value, f.name))
                for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def from_json(cls: type[T], data: Json, where: str = "") -> T:
    """A *cls* (a dataclass) from JSON *data*; raises ResultMismatch naming the field."""
    out: T = _convert(cls, data, where)
    return out


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _convert(tp: Any, data: Json, where: str) -> Any:
    if tp is Json or tp is object:
        return data
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if data is None and type(None) in options:
            return None
        rest = [o for o in options if o is not type(None)]
        if len(rest) == 1:
            return _convert(rest[0], data, where)
        raise ResultMismatch(where, f"unsupported annotation {tp}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record(tp, data, where)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(_array(data, where))]
    if origin is tuple:
        args = typing.get_args(tp)
        items = _array(data, where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(items))
        if len(items) != len(args):
            raise ResultMismatch(where, f"expected {len(args)} items, found {len(items)}")
        return tuple(_convert(a, v, f"{where}[{i}]")
                     for i, (a, v) in enumerate(zip(args, items, strict=True)))
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(data, dict):
            raise ResultMismatch(where, f"expected an object, found {_kind(data)}")
        return {str(k): _convert(item, v, f"{where}.{k}") for k, v in data.items()}
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return float(data)
    elif tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
    elif tp in (str, bool):
        if isinstance(data, tp):
            return data
    else:
        raise ResultMismatch(where, f"unsupported annotation {tp}")
    raise ResultMismatch(where, f"expected {tp.__name__}, found {_kind(data)}")


def _record(cls: type, data: Json, where: str) -> Any:
    if not isinstance(data, dict):
        raise ResultMismatch(where, f"expected an object ({cls.__name__}), found "
                                    f"{_kind(data)}")
    hints = _hints(cls)
    kwargs = {}
    fields = dataclasses.fields(cls)
    known = {f.metadata.get(_KEY, f.name) for f in fields}
    for name in data:
        if name not in known:  # a figure this version would drop when it writes again
            raise ResultMismatch(f"{where}.{name}" if where else str(name),
                                 f"not a field of {cls.__name__}")
    for f in fields:
        name = f.metadata.get(_KEY, f.name)
        path = f"{where}.{name}" if where else name
        if name in data:
            kwargs[f.name] = _convert(hints[f.name], data[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ResultMismatch(path, "missing")
    return cls(**kwargs)


def _array(data: Json, where: str) -> list[Json]:
    if not isinstance(data, (list, tuple)):
        raise ResultMismatch(where, f"expected an array, found {_kind(data)}")
    return list(data)


def _kind(data: Json) -> str:
    return "null" if data is None else type(data).__name__
