"""The runner: the phases in order, each in a child process under its time limit cut to the deadline, and the report."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.cuda_check.common import Record, result_file, run_child

# (phase, time limit in seconds), cheapest and most telling first.
PHASES = [
    ("env", 45),
    ("kernels", 110),
    ("decode", 130),
    ("attention", 75),
    ("model", 120),
    ("trainer_memory", 59),  # the steps, two publishes and a CPU one to compare, the 16K step with either head
    ("parity", 240),
    ("throughput", 330),
]
DESCRIPTION = "The GPU check of the CUDA path, in one run on a machine with one H200 (about 9 minutes at most)."
# The module of each phase (and of `engine_rollout`, the engine child `parity` starts).
MODULES = {"env": "env", "kernels": "kernel_checks", "decode": "decode", "attention": "attention", "model": "model",
           "trainer_memory": "trainer_memory", "parity": "parity", "throughput": "throughput",
           "engine_rollout": "engines"}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=DESCRIPTION)
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop starting phases after this (default 540)")
    p.add_argument("--phases", default=",".join(n for n, _ in PHASES), help="comma-separated phases to run")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--dry-run", action="store_true", help="rehearse on CPU: tiny shapes, interpreted Triton")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # internal: run one phase in this process
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    unknown = set(a.phases.split(",")) - {n for n, _ in PHASES}
    if unknown:
        p.error(f"unknown phase(s) {', '.join(sorted(unknown))}; known: {', '.join(n for n, _ in PHASES)}")
    return a


def run_phase(a: argparse.Namespace) -> int:
    rec = Record(a.result)
    run = getattr(importlib.import_module(f"bench.cuda_check.{MODULES[a.phase]}"), f"phase_{a.phase}")
    run(rec, a) if a.phase == "engine_rollout" else run(rec)
    rec.save()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--phase" in argv:  # internal: a phase (or an engine child of one) in this process
        p = argparse.ArgumentParser()
        for flag in ("--phase", "--result", "--model", "--schedules"):
            p.add_argument(flag)
        p.add_argument("--stock", action="store_true")
        return run_phase(p.parse_args(argv))
    a = parse_args(argv)
    if a.dry_run:
        os.environ["CUDA_CHECK_DRY"] = "1"  # for the phase processes (and the engine children they start)
    wanted = a.phases.split(",")
    began = time.monotonic()
    report = {"script": "bench/cuda_check", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "phases": {}}
    out_dir = os.environ.get("OUT")
    if out_dir:
        log_path = Path(out_dir) / "cuda_check.log"
    elif a.out:
        log_path = Path(a.out).with_suffix(".log")
        log_path = log_path if log_path != Path(a.out) else Path(a.out + ".log")
    else:
        log_path = Path(tempfile.gettempdir()) / "cuda_check.log"
    with open(log_path, "w") as log:
        for name, limit in PHASES:
            left = a.deadline_s - (time.monotonic() - began)
            if name not in wanted:
                continue
            if left < 20:
                report["phases"][name] = {"status": "skipped", "reason": "deadline reached"}
                continue
            print(f"[cuda_check] {name} (limit {min(limit, left):.0f} s)", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            data = run_child(["--phase", name], result_file(), min(limit, left), log)
            data["seconds"] = round(time.monotonic() - t0, 1)
            report["phases"][name] = data
            print(f"[cuda_check] {name}: {data.get('status')} in {data['seconds']} s", file=sys.stderr, flush=True)
    report["seconds"] = round(time.monotonic() - began, 1)
    report["summary"] = {name: p.get("status") for name, p in report["phases"].items()}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    for target in filter(None, [a.out, out_dir and str(Path(out_dir) / "cuda_check.json")]):
        Path(target).write_text(text)
    return 0
