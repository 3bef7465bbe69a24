"""`sparrow bench sandbox`, run small: every program ends ok and the figures have their shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.servers import require_binary


def _bench(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sparrow_cli.main", "bench", "sandbox", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_small_run_reports_throughput_per_worker_count_and_the_overhead():
    require_binary("bwrap")
    r = _bench("--workers", "1,2", "--trivial", "2", "--cpu", "1", "--repeats", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for name, programs in (("trivial", 2), ("cpu_0.5s", 2)):
        rows = out["throughput"][name]
        assert [row["workers"] for row in rows] == [1, 2]
        assert all(row["ok"] == programs and row["programs_per_s"] > 0 for row in rows)
    assert out["startup"]["jailed_median_s"] > 0 and out["startup"]["unjailed_median_s"] > 0


@pytest.mark.parametrize(
    ("flags", "message"), [(("--workers", "1,x"), "comma-separated"), (("--workers", "0"), "positive")]
)
def test_bad_flags_are_one_line(flags, message):
    r = _bench(*flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1
