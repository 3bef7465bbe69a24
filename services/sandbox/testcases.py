"""The test formats datasets carry, read into one shape: a list of cases, stdin/stdout or call-based.

- TACO / APPS `input_output`: `{"inputs": [...], "outputs": [...], "fn_name"?: str}` (a dict or its JSON
  text). Without `fn_name` each input is a program's stdin (a string, or a list of lines) and each output
  its expected stdout; with it each input is the list of arguments of `fn_name` and each output the value
  it returns (APPS also accepts the value wrapped in a one-element list).
- LiveCodeBench: a list of `{"input", "output", "testtype": "stdin" | "functional"}`, or a dict with
  `public_test_cases` and/or `private_test_cases` holding such lists (or their JSON text) and the function's
  name in `fn_name` or `metadata.func_name`; a functional case's input is one JSON value per line.
  (LiveCodeBench ships its private cases pickled; unpickling is code execution, so they are read only
  once a user has turned them into JSON.)

Anything else is a `TestFormatError` naming what is wrong; nothing is run for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CASES = 1000
"""cases one request may carry"""


class TestFormatError(ValueError):
    """A test list that is not one of the documented shapes; one line."""

    __test__ = False  # not a pytest class


@dataclass(frozen=True)
class TestCase:
    """One case: stdin and expected stdout, or call arguments and the expected return value."""

    __test__ = False  # not a pytest class

    stdin: str = ""
    expected: Any = ""
    args: list[Any] | None = None


@dataclass(frozen=True)
class TestSuite:
    """The cases of one problem; `fn_name` set for call-based problems."""

    __test__ = False  # not a pytest class

    cases: tuple[TestCase, ...]
    fn_name: str | None = None


def parse_tests(tests: Any) -> TestSuite:
    """The suite in `tests` (TACO/APPS `input_output` or LiveCodeBench lists, as objects or JSON text)."""
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise TestFormatError(f"tests are not valid JSON: {exc}") from None
    if isinstance(tests, dict) and ("inputs" in tests or "outputs" in tests):
        suite = _taco(tests)
    elif isinstance(tests, dict) and ("public_test_cases" in tests or "private_test_cases" in tests):
        fn = tests.get("fn_name") or _metadata(tests).get("func_name")
        cases = [*_json_list(tests, "public_test_cases"), *_json_list(tests, "private_test_cases")]
        suite = _lcb(cases, fn)
    elif isinstance(tests, list):
        suite = _lcb(tests, None)
    else:
        raise TestFormatError(
            "tests must be TACO/APPS input_output ({inputs, outputs, fn_name?}) or LiveCodeBench cases "
            f"(a list of {{input, output, testtype}} or {{public_test_cases, private_test_cases}}), got {_kind(tests)}"
        )
    if not suite.cases:
        raise TestFormatError("tests hold no case")
    if len(suite.cases) > MAX_CASES:
        raise TestFormatError(f"tests hold {len(suite.cases)} cases, over the limit of {MAX_CASES}")
    return suite


def _kind(value: Any) -> str:
    return f"a {type(value).__name__}" + (f" with keys {sorted(value)[:6]}" if isinstance(value, dict) else "")


def _metadata(tests: dict) -> dict:
    meta = tests.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            raise TestFormatError("metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise TestFormatError("metadata must be an object")
    return meta


def _json_list(tests: dict, key: str) -> list:
    value = tests.get(key, [])
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise TestFormatError(
                f"{key} is neither a list nor JSON text (pickled cases must be decoded first)"
            ) from None
    if not isinstance(value, list):
        raise TestFormatError(f"{key} must be a list of cases, got {_kind(value)}")
    return value


def _lines(value: Any, what: str, i: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise TestFormatError(f"{what}[{i}] must be a string or a list of strings, got {_kind(value)}")


def _fn_name(fn: Any) -> str | None:
    if fn is None or fn == "":
        return None
    if not isinstance(fn, str) or not fn.isidentifier():
        raise TestFormatError(f"fn_name must be a Python identifier, got {fn!r}")
    return fn


def _taco(tests: dict) -> TestSuite:
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise TestFormatError("input_output needs 'inputs' and 'outputs' lists")
    if len(inputs) != len(outputs):
        raise TestFormatError(f"input_output has {len(inputs)} inputs but {len(outputs)} outputs")
    fn = _fn_name(tests.get("fn_name"))
    if fn is None:
        cases = [
            TestCase(stdin=_lines(i, "inputs", k), expected=_lines(o, "outputs", k))
            for k, (i, o) in _pairs(inputs, outputs)
        ]
    else:
        cases = []
        for k, (args, out) in _pairs(inputs, outputs):
            if not isinstance(args, list):
                raise TestFormatError(f"inputs[{k}] of a call-based problem must be the list of arguments")
            cases.append(TestCase(args=args, expected=out))
    return TestSuite(tuple(cases), fn)


def _pairs(a: list, b: list):
    return enumerate(zip(a, b, strict=True))


def _lcb(cases: list, fn: Any) -> TestSuite:
    fn = _fn_name(fn)
    out = []
    for k, case in enumerate(cases):
        if (
            not isinstance(case, dict)
            or not isinstance(case.get("input"), str)
            or not isinstance(case.get("output"), str)
        ):
            raise TestFormatError(f"case {k} must be an object with string 'input' and 'output'")
        kind = case.get("testtype", "functional" if fn else "stdin")
        if kind == "stdin":
            if fn is not None:
                raise TestFormatError(f"case {k} is a stdin case in a call-based problem (fn_name {fn!r})")
            out.append(TestCase(stdin=case["input"], expected=case["output"]))
        elif kind == "functional":
            if fn is None:
                raise TestFormatError(f"case {k} is functional but no fn_name (or metadata.func_name) is given")
            try:
                args = [json.loads(line) for line in case["input"].splitlines() if line.strip()]
                expected = json.loads(case["output"])
            except ValueError:
                raise TestFormatError(f"case {k}: a functional case's input and output are JSON lines") from None
            out.append(TestCase(args=args, expected=expected))
        else:
            raise TestFormatError(f"case {k}: testtype must be 'stdin' or 'functional', got {kind!r}")
    return TestSuite(tuple(out), fn)
