"""The run model's JSON: frozen dataclasses to the summary file's dicts and back.

A field's JSON key is its name (``field(metadata={"key": ...})`` where the key is
no Python name). Three kinds of field:

- required (no default): a file without it is refused;
- with a default other than None: always written; a file without it reads the default;
- with the default None: written only when set (a section or key that appears only
  in some runs, or that earlier files lack), unless marked ``nullable``: then it is
  always written, as ``null`` when None.

Reading checks each value's type (an integer where a number is asked for is taken as
it is, so that a file is written back as it was read) and raises
:class:`SummaryError` naming the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")
_NONE = type(None)


class SummaryError(ValueError):
    """A summary file's key is missing or holds a value of the wrong type."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"key {key!r} {problem}")


def nullable(default: Any = None) -> Any:
    """A field always written, as ``null`` when None."""
    return dataclasses.field(default=default, metadata={"nullable": True})


def keyed(key: str, **kwargs: Any) -> Any:
    """A field whose JSON key is ``key``."""
    return dataclasses.field(metadata={"key": key, **kwargs.pop("metadata", {})}, **kwargs)


class _Field(typing.NamedTuple):
    name: str
    key: str
    hint: Any
    required: bool
    default: Any
    always: bool  # written when None (as null)


_CACHE: dict[type, tuple[_Field, ...]] = {}


def _fields(cls: type) -> tuple[_Field, ...]:
    known = _CACHE.get(cls)
    if known is not None:
        return known
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory
        always = bool(f.metadata.get("nullable")) or (f.default is not None)
        out.append(_Field(f.name, f.metadata.get("key", f.name), hints[f.name], required, default, always))
    known = _CACHE[cls] = tuple(out)
    return known


def to_dict(obj: Any) -> dict:
    """A dataclass as the summary file's dict, keys in field order."""
    out = {}
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None and not f.always:
            continue
        out[f.key] = _encode(value)
    return out


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_dict() if hasattr(value, "to_dict") else to_dict(value)
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """``cls`` from a summary file's dict (``path``: where it lies, for errors)."""
    if not isinstance(data, dict):
        raise SummaryError(path or "(top level)", f"must be an object (got {_show(data)})")
    kwargs = {}
    for f in _fields(cls):
        where = f"{path}.{f.key}" if path else f.key
        if f.key not in data:
            if f.required:
                raise SummaryError(where, "is missing")
            kwargs[f.name] = f.default() if callable(f.default) else f.default
            continue
        kwargs[f.name] = _decode(data[f.key], f.hint, where)
    return cls(**kwargs)


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _decode(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not _NONE]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        (hint,) = args
        origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)  # type: ignore[arg-type]
    if origin is tuple:
        if not isinstance(value, list):
            raise SummaryError(path, f"must be a list (got {_show(value)})")
        (item, _) = typing.get_args(hint)
        return tuple(_decode(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is Mapping or origin is dict:
        if not isinstance(value, dict):
            raise SummaryError(path, f"must be an object (got {_show(value)})")
        _, item = typing.get_args(hint)
        return {k: _decode(v, item, f"{path}.{k}") for k, v in value.items()}
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise SummaryError(path, f"must be {_KINDS.get(hint, hint.__name__)} (got {_show(value)})")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return "null" if value is None else (text if len(text) <= 40 else text[:37] + "...")


def json_schema(root: type, const: Mapping[str, str], **head: Any) -> dict:
    """A JSON Schema (draft 2020-12) of what ``from_dict(root, ...)`` reads: each
    dataclass under ``$defs``; ``const``: keys of ``root`` with one allowed value."""
    defs: dict[str, dict] = {}

    def kind(hint: Any) -> dict:
        origin = typing.get_origin(hint)
        if origin is typing.Union or origin is types.UnionType:
            (inner,) = [a for a in typing.get_args(hint) if a is not _NONE]
            one = kind(inner)
            return {"type": [one["type"], "null"]} if list(one) == ["type"] else {"anyOf": [one, {"type": "null"}]}
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            define(hint)
            return {"$ref": f"#/$defs/{hint.__name__}"}
        if origin is tuple:
            return {"type": "array", "items": kind(typing.get_args(hint)[0])}
        if origin is Mapping or origin is dict:
            return {"type": "object", "additionalProperties": kind(typing.get_args(hint)[1])}
        return {"type": {int: "integer", float: "number", str: "string", bool: "boolean"}[hint]}

    def define(cls: type) -> dict:
        if cls.__name__ in defs:
            return defs[cls.__name__]
        out: dict[str, Any] = {"type": "object"}
        defs[cls.__name__] = out
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        if doc and not doc.startswith(f"{cls.__name__}("):
            out["description"] = " ".join(doc.split())
        props = {}
        for f in _fields(cls):
            props[f.key] = {"const": const[f.key]} if cls is root and f.key in const else kind(f.hint)
        out["properties"] = props
        required = [f.key for f in _fields(cls) if f.required or (cls is root and f.key in const)]
        if required:
            out["required"] = required
        return out

    top = define(root)
    del defs[root.__name__]
    return {**head, **top, "$defs": dict(sorted(defs.items()))}
