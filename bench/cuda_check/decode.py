"""Phase `decode`: the plugin's decode-path tests (test_cuda_backend.py, test_static_decode.py) on the device."""

from __future__ import annotations

from bench.cuda_check.common import DRY, Record


def phase_decode(rec: Record) -> None:
    import pytest

    outcomes: dict[str, str] = {}

    class Collect:
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.outcome != "passed":
                outcomes[report.nodeid.split("::")[-1]] = report.outcome
                if report.outcome == "failed":
                    outcomes[report.nodeid.split("::")[-1] + ":error"] = str(report.longrepr)[-1500:]
            rec["tests"] = outcomes

    class FirstOfEachFile:
        # The dry run rehearses this harness on one test per file: the suite runs both files itself on
        # CPU, so running all of them again here only doubled their time (and timed out under load).
        def pytest_collection_modifyitems(self, items):
            seen: set[str] = set()
            items[:] = [i for i in items if i.path not in seen and not seen.add(i.path)]

    tests = ["tests/unit/generator/test_cuda_backend.py", "tests/unit/generator/test_static_decode.py"]
    plugins = [Collect(), *([FirstOfEachFile()] if DRY else [])]
    code = pytest.main(["-q", "-p", "no:cacheprovider", *tests], plugins=plugins)
    rec.check("failed_tests", float(sum(o == "failed" for o in outcomes.values())), 0.0)
    rec.check("pytest_exit_code", float(code), 0.0)  # collection errors and the like fail too
