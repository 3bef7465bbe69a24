"""Verifiable rewards on `\\boxed{...}` answers. They never raise on model output: anything malformed,
missing, unbalanced or absurdly long scores 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction

BOX = "\\boxed"
MAX_ANSWER_CHARS = 512
"""a boxed answer longer than this is not an answer; also bounds the work on huge outputs"""
MAX_BOXES_TRIED = 8
"""how many `\\boxed` occurrences, from the last one back, may be tried for a well-formed one"""
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
_FRAC_HEAD = re.compile(r"^([+-]?)\\[dt]?frac(?=\{)")
_FRAC_SHORT = re.compile(r"^([+-]?)\\[dt]?frac(\d)(\d)$")  # \frac12


def last_boxed(text: object) -> str | None:
    """The content of the last balanced `\\boxed{...}` in `text`, stripped, or None."""
    if not isinstance(text, str):
        return None
    start = text.rfind(BOX)
    for _ in range(MAX_BOXES_TRIED):
        if start == -1:
            break
        i = start + len(BOX)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            limit = min(len(text), i + MAX_ANSWER_CHARS + 2)
            while j < limit:
                ch = text[j]
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
                j += 1
        # unbalanced or too long: an earlier box may still be a well-formed answer
        start = text.rfind(BOX, 0, start)
    return None


def chain_reward(output: object, answer: str) -> float:
    """1.0 when the last boxed answer of `output` is exactly `answer` (whitespace-trimmed), else 0.0."""
    try:
        got = last_boxed(output)
        return 1.0 if got is not None and got == answer.strip() else 0.0
    except Exception:  # a reward must never take down a rollout
        return 0.0


def _strip_wrappers(s: str) -> str:
    s = s.strip().strip("$").strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", "")):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)  # degrees
    s = s.replace("\\%", "").rstrip("%").replace(" ", "")
    while len(s) >= 2 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1]
    while len(s) >= 2 and s[0] == "(" and s[-1] == ")" and "," not in s:
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += ch == "{"
        depth -= ch == "}"
        if depth < 0:
            return False
    return depth == 0


def _frac_parts(s: str) -> tuple[str, str, str] | None:
    """(sign, numerator, denominator) of `\\frac{a}{b}` with balanced, possibly nested, groups."""
    m = _FRAC_HEAD.match(s)
    if not m:
        return None
    groups, i = [], m.end()
    while len(groups) < 2 and i < len(s) and s[i] == "{":
        depth, j = 0, i
        while j < len(s):
            depth += s[j] == "{"
            depth -= s[j] == "}"
            if depth == 0:
                break
            j += 1
        if depth:
            return None
        groups.append(s[i + 1 : j])
        i = j + 1
    if len(groups) != 2 or i != len(s):
        return None
    return m.group(1), groups[0], groups[1]


def _to_number(s: str) -> Fraction | None:
    """A rational value of a plain number, a thousands-separated number, a/b or \\frac{a}{b}, else None."""
    if len(s) > 64:
        return None
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _FRAC_SHORT.match(s)
    parts = m.groups() if m else _frac_parts(s)
    if parts:
        num, den = _to_number(_strip_wrappers(parts[1])), _to_number(_strip_wrappers(parts[2]))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if parts[0] == "-" else value
    if s.count("/") == 1:
        a, b = s.split("/")
        num, den = _to_number(a), _to_number(b)
        if num is None or den is None or den == 0:
            return None
        return num / den
    if _NUMBER.fullmatch(s):
        return Fraction(s)
    return None


def normalize_math(answer: str) -> str | Fraction:
    """A comparable form: a Fraction for numbers in any supported notation, else a whitespace-free string."""
    s = _strip_wrappers(answer)
    value = _to_number(s)
    return value if value is not None else s


def math_reward(output: object, reference: object) -> float:
    """1.0 when the last boxed answer of `output` equals `reference` as a number (`0.5`, `1/2`,
    `\\frac{1}{2}`, `1,000`, signs) or, for non-numbers, as whitespace-free text; else 0.0.
    `reference` may itself contain `\\boxed{}` or be a number."""
    try:
        got = last_boxed(output)
        if got is None or not got:
            return 0.0
        if isinstance(reference, bool) or reference is None:
            return 0.0
        if isinstance(reference, int | float | Fraction):
            ref = str(reference)
        elif isinstance(reference, str):
            ref = last_boxed(reference) if BOX in reference else reference
            if ref is None:
                return 0.0
        else:
            return 0.0
        a, b = normalize_math(got), normalize_math(ref)
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return 1.0 if a == b else 0.0
        if isinstance(a, Fraction) or isinstance(b, Fraction):
            return 0.0
        return 1.0 if a and a == b else 0.0
    except Exception:  # a reward must never take down a rollout
        return 0.0


# -- the registry's entry points: (response text, ground truth, row extras) -> score ---------------------------


def chain_score(response: str, ground_truth: str | None, extras: dict) -> float:
    """`chain`: the last `\\boxed{}` is exactly the ground truth (the built-in chain task)."""
    return chain_reward(response, ground_truth or "") if ground_truth is not None else 0.0


def boxed_score(response: str, ground_truth: str | None, extras: dict) -> float:
    """`boxed`: the last `\\boxed{}` equals the ground truth after normalisation (numbers, fractions, text)."""
    return math_reward(response, ground_truth) if ground_truth is not None else 0.0
