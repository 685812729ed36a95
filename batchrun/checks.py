"""Value checks attached to configuration fields, and byte sizes ("4GiB").

A dataclass field carries its check as `field(metadata={"check": fn})`, where `fn(value)` returns None when
the value is fine and otherwise what was expected ("a number >= 1"). The job-file parser runs these checks to
name the offending key; the same dataclasses run them in `__post_init__` (`check_fields`), so the Python API
rejects the same mistakes with the same words.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Union

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """'4GiB' -> 4294967296; an int is taken as bytes. Raises ValueError on anything else."""
    if isinstance(text, bool):
        raise ValueError(text)
    if isinstance(text, int):
        if text < 0:
            raise ValueError(text)
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def one_of(*choices: str):
    def check(v: Any) -> str | None:
        return None if v in choices else f"one of {', '.join(choices)}"

    return check


def at_least(lo: float, strict: bool = False):
    def check(v: Any) -> str | None:
        ok = v > lo if strict else v >= lo
        return None if ok else f"a number {'>' if strict else '>='} {lo}"

    return check


def in_range(lo: float, hi: float, open_low: bool = False):
    def check(v: Any) -> str | None:
        ok = (lo < v if open_low else lo <= v) and v <= hi
        return None if ok else f"a number in {'(' if open_low else '['}{lo}, {hi}]"

    return check


def power_of_two(v: int) -> str | None:
    return None if v >= 1 and v & (v - 1) == 0 else "a power of two (8, 16, 32, ...)"


def size_or_fraction(v: Any) -> str | None:
    if isinstance(v, float | int) and not isinstance(v, bool):
        return None if 0 < v <= 1 else 'a fraction in (0, 1] or a size such as "2GiB"'
    try:
        parse_size(v)
        return None
    except ValueError:
        return 'a fraction in (0, 1] or a size such as "2GiB"'


def size(v: Any) -> str | None:
    try:
        parse_size(v)
        return None
    except ValueError:
        return 'a size such as "4GiB" or a number of bytes'


class FieldError(ValueError):
    """A value a dataclass refuses, naming the field (a check across fields, made in `__post_init__`)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def field_error(f: dataclasses.Field, value: Any) -> str | None:
    """What field `f` expected, when `value` fails its check; None when it passes (or has no check)."""
    check = f.metadata.get("check")
    return check(value) if check is not None and value is not None else None


def check_fields(obj: Any) -> None:
    """Type-check every field of a (frozen or not) dataclass instance against its annotation, as the job file's
    parser does (an int where a float is wanted becomes a float, a list where a tuple is wanted a tuple), then
    run every field's check; ValueError naming the first field that fails."""
    name = type(obj).__name__
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        try:
            coerced = coerce(value, hints[f.name], f.name)
        except TypeMismatch as e:
            raise ValueError(f"{name}.{e.key} must be {e.expected}, got {e.value!r}") from None
        if coerced is not value:
            object.__setattr__(obj, f.name, coerced)
        expected = field_error(f, coerced)
        if expected:
            raise ValueError(f"{name}.{f.name} must be {expected}, got {coerced!r}")


class TypeMismatch(ValueError):
    """A value that is not of its field's type: the key (`a.b[2]`), what was expected, the value."""

    def __init__(self, key: str, expected: str, value: Any):
        super().__init__(f"{key} must be {expected}, got {value!r}")
        self.key, self.expected, self.value = key, expected, value


def type_name(tp: Any) -> str:
    """How an annotation reads in an error: "an integer", "a list of strings", "a number or null"."""
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {type_name(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, key: str, build=None) -> Any:
    """`value` checked against the annotation `tp` and returned (an int as a float where a number is wanted, a
    list as the tuple an annotation asks for, a single string as a one-item list of strings); `build(cls, raw,
    key)` makes a nested dataclass (the job file's sections). Raises TypeMismatch naming the key."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key, build)
            except TypeMismatch:
                continue
        raise TypeMismatch(key, type_name(tp), value)
    if dataclasses.is_dataclass(tp):
        if build is None:
            if not isinstance(value, tp):
                raise TypeMismatch(key, type_name(tp), value)
            return value
        return build(tp, value, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeMismatch(key, type_name(tp), value)
        k_tp, v_tp = typing.get_args(tp)
        return {
            coerce(k, k_tp, key, build): (v if v_tp is Any else coerce(v, v_tp, f"{key}.{k}", build))
            for k, v in value.items()
        }
    if origin in (list, tuple):
        elem = typing.get_args(tp)[0]
        if isinstance(value, str) and elem is str:
            value = [value]  # a single stop string / passthrough column is accepted as a one-item list
        if not isinstance(value, list | tuple):
            raise TypeMismatch(key, type_name(tp), value)
        items = [coerce(v, elem, f"{key}[{i}]", build) for i, v in enumerate(value)]
        return value if list(value) == items and isinstance(value, origin) else origin(items)
    check = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp)
    if check is None:
        return value
    if not check(value):
        raise TypeMismatch(key, type_name(tp), value)
    return float(value) if tp is float and not isinstance(value, float) else value
