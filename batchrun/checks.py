"""Value checks attached to configuration fields, and byte sizes ("4GiB").

A dataclass field carries its check as `field(metadata={"check": fn})`, where `fn(value)` returns None when
the value is fine and otherwise what was expected ("a number >= 1"). The job-file parser runs these checks to
name the offending key; the same dataclasses run them in `__post_init__` (`check_fields`), so the Python API
rejects the same mistakes with the same words.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

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
    """Run every field's check on a dataclass instance; ValueError naming the first field that fails."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        expected = field_error(f, value)
        if expected:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be {expected}, got {value!r}")
