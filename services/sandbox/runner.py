"""One program against one problem's tests: a jail run per case, each compared outside the jail.

The expected outputs never enter the jail; the program sees only the case's stdin (or arguments).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

from services.sandbox.compare import stdout_matches, value_matches
from services.sandbox.harness import call_input, call_program, call_result
from services.sandbox.jail import Jail, Limits, Outcome
from services.sandbox.runtimes import Runtime
from services.sandbox.testcases import TestSuite

CASE_STATUSES = (
    "passed",
    "failed",
    "timeout",
    "memory",
    "output_limit",
    "runtime_error",
    "compile_error",
    "sandbox_error",
)


@dataclass
class CaseResult:
    """How one test case went."""

    status: str
    exit_code: int | None
    elapsed_s: float
    peak_memory_bytes: int
    stdout: str
    stderr: str

    def to_dict(self) -> dict:
        """The JSON form the service answers with."""
        return asdict(self)


@dataclass
class SuiteResult:
    """All cases run for one program; `cases` stops early when `stop_on_first_failure` is set."""

    cases: list[CaseResult]
    total: int

    @property
    def passed(self) -> int:
        """Cases that passed."""
        return sum(c.status == "passed" for c in self.cases)

    @property
    def pass_fraction(self) -> float:
        """Passed cases over all cases of the problem (cases not run count as not passed)."""
        return self.passed / self.total if self.total else 0.0


def _text(data: bytes, keep: int) -> str:
    return data[:keep].decode("utf-8", "replace")


def run_case(
    jail: Jail,
    runtime: Runtime,
    program: bytes,
    suite: TestSuite,
    index: int,
    limits: Limits,
    keep_bytes: int,
    float_tolerance: float | None,
) -> CaseResult:
    """Run case `index` of `suite` against `program` (already wrapped for call-based suites)."""
    case = suite.cases[index]
    stdin = call_input(case.args) if suite.fn_name is not None else case.stdin.encode()
    out: Outcome = jail.run(runtime, program, stdin, limits)
    stdout = out.stdout.decode("utf-8", "replace")
    status = out.status
    shown = stdout
    if status == "ok":
        if suite.fn_name is not None:
            found, value = call_result(stdout)
            shown = stdout.rpartition("\n" + "\x1e")[0] if found else stdout
            status = "passed" if found and value_matches(value, case.expected, float_tolerance) else "failed"
        else:
            status = "passed" if stdout_matches(stdout, case.expected, float_tolerance) else "failed"
    return CaseResult(
        status,
        out.exit_code,
        round(out.elapsed_s, 4),
        out.peak_memory_bytes,
        shown[:keep_bytes],
        _text(out.stderr, keep_bytes) or out.detail[:keep_bytes],
    )


def run_suite(
    jail: Jail,
    runtime: Runtime,
    source: str,
    suite: TestSuite,
    limits: Limits,
    *,
    stop_on_first_failure: bool = False,
    keep_bytes: int = 1024,
    float_tolerance: float | None = None,
    budget_s: float | None = None,
) -> SuiteResult:
    """Run every case (until the first that does not pass, with `stop_on_first_failure`).

    `budget_s` bounds the whole suite: a program that times out on every one of many cases would
    otherwise hold a worker for cases x timeout. The case running when it ends gets only what is left;
    cases not run count as not passed.
    """
    program = (call_program(source, suite.fn_name) if suite.fn_name is not None else source).encode()
    results: list[CaseResult] = []
    end = time.monotonic() + budget_s if budget_s is not None else None
    for i in range(len(suite.cases)):
        case_limits = limits
        if end is not None:
            left = end - time.monotonic()
            if left <= 0:
                break
            case_limits = replace(limits, timeout_s=min(limits.timeout_s, left))
        result = run_case(jail, runtime, program, suite, i, case_limits, keep_bytes, float_tolerance)
        results.append(result)
        # a program that does not compile fails every case the same way: no need to start it again
        if result.status == "compile_error" or (stop_on_first_failure and result.status != "passed"):
            break
    return SuiteResult(results, len(suite.cases))
