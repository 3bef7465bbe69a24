"""`bench/cuda_check.py` runs on a GPU machine only; here just its command line (no phase ever runs)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.cuda_check import PHASES, parse_args

REPO = Path(__file__).resolve().parents[3]


def test_help_is_instant_and_names_the_options():
    r = subprocess.run(
        [sys.executable, "-m", "bench.cuda_check", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    for flag in ("--deadline-s", "--phases", "--out", "--dry-run"):
        assert flag in r.stdout
    assert "--result" not in r.stdout  # internal flags stay hidden


def test_phases_parse_and_unknown_ones_are_refused(capsys):
    a = parse_args([])
    assert a.phases.split(",") == [name for name, _ in PHASES] and a.deadline_s == 540 and not a.dry_run
    assert parse_args(["--phases", "kernels,attention", "--deadline-s", "300"]).phases == "kernels,attention"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--phases", "kernels,nope"])
    assert exc.value.code == 2 and "unknown phase(s) nope" in capsys.readouterr().err
    assert sum(limit for name, limit in PHASES if name in ("env", "kernels", "decode", "attention")) < 540
