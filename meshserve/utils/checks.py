"""One range check for every setting and request field, with the message a user can act on:
the name as the user wrote it (a flag, a field), the valid range, and the value given."""
from __future__ import annotations

import math


def check_range(name: str, value: object, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False, integer: bool = False, hint: str = "") -> None:
    """ValueError unless `value` is a number (an int with `integer`; never a bool) within the range.
    `lo`/`hi` None: unbounded on that side; `*_open`: that end excluded."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        bad = True
    else:
        bad = ((lo is not None and (value <= lo if lo_open else value < lo))
               or (hi is not None and (value >= hi if hi_open else value > hi)))
    if bad:
        raise ValueError(f"{name} must be {describe_range(lo, hi, lo_open, hi_open)}{hint}, got {value!r}")


def describe_range(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """'>= 1', '> 0', '<= 5', 'in [0, 65535]', 'in (0, 1]'."""
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def check_positive_int(name: str, value: object) -> None:
    """An integer >= 1."""
    check_range(name, value, 1, integer=True)
