"""Test formats (TACO/APPS, LiveCodeBench), output comparison, and programs scored against them in the jail."""

from __future__ import annotations

import json

import pytest

from services.sandbox.compare import stdout_matches, value_matches
from services.sandbox.jail import Jail, Limits
from services.sandbox.runner import run_suite
from services.sandbox.runtimes import PYTHON3
from services.sandbox.testcases import TestFormatError, parse_tests
from tests.servers import require_binary

LIMITS = Limits(timeout_s=3, memory_mb=512)
ADD_STDIN = {"inputs": ["1 2\n", ["3 4"], "10 -10\n"], "outputs": ["3\n", "7", ["0"]]}
ADD_CALL = json.dumps({"inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [[3], 7, [0]], "fn_name": "add"})


@pytest.fixture(scope="module")
def jail() -> Jail:
    require_binary("bwrap")
    return Jail()


def test_taco_stdin_and_call_based_read_into_cases():
    suite = parse_tests(ADD_STDIN)
    assert suite.fn_name is None and [c.stdin for c in suite.cases] == ["1 2\n", "3 4", "10 -10\n"]
    assert suite.cases[2].expected == "0"
    suite = parse_tests(ADD_CALL)
    assert suite.fn_name == "add" and suite.cases[1].args == [3, 4] and suite.cases[0].expected == [3]


def test_livecodebench_public_and_private_lists_read_into_cases():
    public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    suite = parse_tests({"public_test_cases": json.dumps(public), "private_test_cases": public * 2})
    assert len(suite.cases) == 3 and suite.fn_name is None
    functional = [{"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional"}]
    suite = parse_tests({"public_test_cases": functional, "metadata": json.dumps({"func_name": "join"})})
    assert suite.fn_name == "join" and suite.cases[0].args == [[1, 2], 3] and suite.cases[0].expected == [1, 2, 3]


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ({"inputs": ["1"]}, "needs 'inputs' and 'outputs' lists"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
        ({"inputs": [1], "outputs": ["1"]}, r"inputs\[0\] must be a string"),
        ({"inputs": ["1"], "outputs": ["1"], "fn_name": "a b"}, "fn_name must be a Python identifier"),
        ({"inputs": [], "outputs": []}, "no case"),
        ({"inputs": ["x"] * 1001, "outputs": ["x"] * 1001}, "over the limit"),
        ([{"input": "1"}], "string 'input' and 'output'"),
        ([{"input": "1", "output": "1", "testtype": "functional"}], "no fn_name"),
        ({"private_test_cases": "eJzLSM3JyVcozy/KSQEAGgQEXQ=="}, "pickled cases must be decoded"),
        ("{not json", "not valid JSON"),
        (42, "must be TACO/APPS input_output"),
    ],
)
def test_a_test_list_of_another_shape_is_refused_with_a_message(tests, message):
    with pytest.raises(TestFormatError, match=message):
        parse_tests(tests)


def test_stdout_comparison_ignores_trailing_whitespace_and_takes_a_float_tolerance():
    assert stdout_matches("1 2  \n3\n\n\n", "1 2\n3")
    assert not stdout_matches("1 2\n3", "1  2\n3")
    assert not stdout_matches("0.3333", "0.333333")
    assert stdout_matches("0.3333 x", "0.333333 x", float_tolerance=1e-3)
    assert not stdout_matches("0.34 x", "0.333333 x", float_tolerance=1e-3)
    assert not stdout_matches("nan", "nan 1", float_tolerance=1e-3)


def test_return_values_compare_as_json_with_apps_wrapping():
    assert value_matches([1, 2], [1, 2]) and value_matches(3, [3]) and not value_matches(3, [3, 3])
    assert not value_matches(True, 1) and not value_matches(0.1 + 0.2, 0.3)
    assert value_matches(0.1 + 0.2, 0.3, float_tolerance=1e-9)


GOOD_STDIN = "a, b = map(int, input().split())\nprint(a + b)\n"
BAD_STDIN = "a, b = map(int, input().split())\nprint(a - b)\n"
PARTIAL_STDIN = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 1)\n"  # passes 1 2 and 3 4 only
GOOD_CALL = "class Solution:\n    def add(self, a, b):\n        print('debug')\n        return a + b\n"
PARTIAL_CALL = "def add(a, b):\n    return 7 if a == 3 else a * b\n"  # passes 3 4 and 0 0


@pytest.mark.parametrize(
    ("source", "tests", "fraction"),
    [
        (GOOD_STDIN, ADD_STDIN, 1.0),
        (BAD_STDIN, ADD_STDIN, 0.0),
        (PARTIAL_STDIN, ADD_STDIN, 2 / 3),
        (GOOD_CALL, ADD_CALL, 1.0),
        ("def add(a, b):\n    return (a + b,) if a == 1 else a + b\n", ADD_CALL, 1.0),  # a tuple is a list
        ("def add(a, b):\n    return str(a + b)\n", ADD_CALL, 0.0),
        (PARTIAL_CALL, ADD_CALL, 2 / 3),
        ("def add(a, b:\n", ADD_CALL, 0.0),
    ],
)
def test_taco_problems_score_their_pass_fraction(jail, source, tests, fraction):
    result = run_suite(jail, PYTHON3, source, parse_tests(tests), LIMITS)
    assert result.pass_fraction == pytest.approx(fraction)


def test_a_program_that_does_not_compile_runs_once_and_says_so(jail):
    result = run_suite(jail, PYTHON3, "print(1\n", parse_tests(ADD_STDIN), LIMITS)
    assert [c.status for c in result.cases] == ["compile_error"] and result.total == 3
    result = run_suite(jail, PYTHON3, "def add(a, b:\n", parse_tests(ADD_CALL), LIMITS)
    assert [c.status for c in result.cases] == ["compile_error"]


def test_stop_on_first_failure_stops_and_call_output_is_kept_apart(jail):
    result = run_suite(jail, PYTHON3, BAD_STDIN, parse_tests(ADD_STDIN), LIMITS, stop_on_first_failure=True)
    assert [c.status for c in result.cases] == ["failed"] and result.pass_fraction == 0.0
    result = run_suite(jail, PYTHON3, GOOD_CALL, parse_tests(ADD_CALL), LIMITS)
    assert result.cases[0].stdout == "debug\n"


def test_a_budget_bounds_the_whole_suite(jail):
    suite = parse_tests({"inputs": [""] * 10, "outputs": ["x"] * 10})
    result = run_suite(jail, PYTHON3, "import time; time.sleep(100)", suite, Limits(timeout_s=1), budget_s=1.5)
    assert [c.status for c in result.cases] == ["timeout", "timeout"] and result.total == 10
    assert result.cases[1].elapsed_s < 0.8 and result.pass_fraction == 0.0
