"""`bench/cuda_check`: its command line, and its dry run on CPU (Triton interpreted, tiny shapes).

The dry run proves every phase's code runs and its checks pass on CPU, not any GPU figure; the
engine phases ("parity", "throughput") skip in it by design.
"""

import json
import os
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
    # The phases a GPU machine without vLLM runs fit the default deadline together.
    assert sum(limit for name, limit in PHASES if name not in ("parity", "throughput")) < 540


@pytest.mark.slow
def test_dry_run_passes_every_phase_that_runs_without_a_gpu(tmp_path):
    out = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the phases' result files go
    (tmp_path / "tmp").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "bench.cuda_check", "--dry-run", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(r.stdout) == report
    phases = report["phases"]
    failures = {n: p.get("error", p.get("checks")) for n, p in phases.items() if p["status"] not in ("ok", "skipped")}
    assert not failures, str(failures)[-3000:]
    ok = [n for n, p in phases.items() if p["status"] == "ok"]
    assert ok == ["env", "kernels", "decode", "attention", "model", "trainer_memory"]
    assert {phases[n]["reason"] for n in ("parity", "throughput")} == {"dry run"}
    # The phases' checks ran (a phase with no checks would read "ok" too).
    assert len(phases["kernels"]["checks"]) >= 10 and phases["decode"]["checks"]["failed_tests"]["value"] == 0
    assert len(phases["trainer_memory"]["checks"]) >= 8  # gradients and losses of both steps, two ways
    head = phases["trainer_memory"]["head_16k"]  # the 16K step, chunked vs full LM head (a short one here)
    assert head["chunked"]["tokens_per_s"] > 0 and head["full"]["tokens_per_s"] > 0
    assert {"head_16k_loss_chunked_vs_full", "head_16k_logprobs_chunked_vs_full_max_abs"} <= set(
        phases["trainer_memory"]["checks"]
    )
    published = {f"{case}_published_equals_cpu" for case in ("resident", "offload")}
    assert published <= set(phases["trainer_memory"]["checks"])  # the sharded publishes were compared
    attention = phases["attention"]["checks"]
    assert {"dense_ours_vs_sdpa_max_rel", "full_budget_vs_dense_max_rel"} <= set(attention)
    assert phases["decode"]["tests"], "the decode tests were not collected"
    model = phases["model"]
    assert "full_budget_logits_vs_dense_max_rel" in model["checks"]
    assert {"dense", "sparse_64"} <= set(model) and model["sparse_64"]["eager_ms"] > 0
    # Its output sits beside the report, and no phase left its result file behind.
    assert "===== --phase attention" in (tmp_path / "check.log").read_text()
    assert not list((tmp_path / "tmp").glob("cuda_check-*.json"))
