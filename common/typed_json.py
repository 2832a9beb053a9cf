"""Decoded JSON checked against a dataclass type, so a damaged file is named by the key that is wrong.

``load_typed(StatusSnapshot, json.load(f), "")`` builds the dataclasses field by field and raises
:class:`Damaged` with one sentence (``gpus[0].index is missing``) instead of a TypeError deep inside.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Mapping


class Damaged(ValueError):
    """The JSON does not match the type; the message names the key."""


def load_typed(tp: Any, value: Any, where: str) -> Any:
    """``value`` (decoded JSON) checked against the type ``tp``; raises Damaged naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return load_typed(inner, value, where)
    if tp is Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise Damaged(f"{where or 'the top level'} is not an object")
        hints = typing.get_type_hints(tp)
        kw = {}
        for f in fields(tp):
            key = f"{where}.{f.name}" if where else f.name
            if f.name in value:
                kw[f.name] = load_typed(hints[f.name], value[f.name], key)
            elif type(None) not in typing.get_args(hints[f.name]):
                raise Damaged(f"{key} is missing")
        return tp(**kw)
    if origin is list:
        if not isinstance(value, list):
            raise Damaged(f"{where} is not a list")
        (inner,) = typing.get_args(tp)
        return [load_typed(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise Damaged(f"{where} is not an object")
        _, inner = typing.get_args(tp)
        return {str(k): load_typed(inner, v, f"{where}.{k}") for k, v in value.items()}
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[tp](value)
    if not ok:
        raise Damaged(f"{where} is {value!r}, expected {tp.__name__}")
    return value
