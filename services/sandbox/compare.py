"""Whether a program's answer is the expected one, with the normalisation graders use.

Standard output: trailing whitespace of each line and trailing blank lines never count; with a float
tolerance, outputs that differ only in numbers within it (absolute or relative) match token by token.
Return values (call-based problems): equal as JSON values (tuples are lists), numbers within the
tolerance; APPS also writes the expected value wrapped in a one-element list.
"""

from __future__ import annotations

import math
from typing import Any


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _close(a: float, b: float, tol: float) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _token_match(got: str, expected: str, tol: float) -> bool:
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not (math.isfinite(fx) and math.isfinite(fy) and _close(fx, fy, tol)):
            return False
    return True


def stdout_matches(got: str, expected: str, float_tolerance: float | None = None) -> bool:
    """`got` is `expected` but for trailing whitespace (and numbers within `float_tolerance`, if given)."""
    if _lines(got) == _lines(expected):
        return True
    return float_tolerance is not None and _token_match(got, expected, float_tolerance)


def _value_match(got: Any, expected: Any, tol: float | None) -> bool:
    if isinstance(got, bool) or isinstance(expected, bool):
        return got is expected or got == expected and type(got) is type(expected)
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if tol is None or isinstance(got, int) and isinstance(expected, int):
            return got == expected
        return math.isfinite(got) and math.isfinite(expected) and _close(float(got), float(expected), tol)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(_value_match(g, e, tol) for g, e in zip(got, expected, strict=True))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_value_match(got[k], expected[k], tol) for k in got)
    return got == expected


def value_matches(got: Any, expected: Any, float_tolerance: float | None = None) -> bool:
    """A call's return value `got` (decoded from JSON) equals `expected`, APPS's one-element wrapping allowed."""
    if _value_match(got, expected, float_tolerance):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _value_match(got, expected[0], float_tolerance)
