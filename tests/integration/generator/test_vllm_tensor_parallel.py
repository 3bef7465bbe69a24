"""A tensor-parallel generator (engine.tensor_parallel_size = 2, vLLM's multiprocess executor, CPU
backend: one worker process and one thread each), for real, against the one-worker engine.

Each engine runs in its own process (tests.fixtures.vllm_phases: vLLM reads its environment once per
process) through the same phases: dense, a sparse schedule, a schedule swapped between two steps, a
probe, a streamed policy load in buckets, a policy load from disk, a LoRA adapter. At two workers every
phase's greedy tokens equal one worker's and the logprobs agree within 1e-4 (fp32; the workers' all-reduce
sums in another order). Each phase's logprobs differ from the previous one's: every swap really reached
the engine, and a swap that reached only one of the two workers (each holds half the heads) would decode
another model and break the agreement. The one-worker engine itself matches the trainer's teacher-forced
scoring in every such phase (test_vllm_engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SMALL = REPO / "models" / "small"
TOLERANCE = 1e-4
PHASES = ("dense", "sched-a", "sched-b", "probe", "streamed", "disk", "lora")


def _phases(tmp: Path, tp: int, policy: Path, adapter: Path) -> dict:
    out = tmp / f"tp{tp}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_HOST_IP": "127.0.0.1"}
    env.pop("SPARROW_ATTENTION", None)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # the engine binds its workers to this machine's CPUs itself
    cmd = [sys.executable, "-m", "tests.fixtures.vllm_phases", "--model", str(SMALL), "--out", str(out)]
    cmd += ["--policy", str(policy), "--adapter", str(adapter), "--tp", str(tp)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from trainer.model_io import load_model

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two CPU workers need two CPUs")
    tmp = tmp_path_factory.mktemp("tp")
    policy = load_model(SMALL)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.save_pretrained(tmp / "policy")
    lora = get_peft_model(
        load_model(SMALL),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    lora.save_pretrained(tmp / "adapter")
    return {tp: _phases(tmp, tp, tmp / "policy", tmp / "adapter") for tp in (1, 2)}


def test_two_workers_run_the_plugin_and_take_streamed_loads(runs):
    one, two = runs[1], runs[2]
    assert one["layers"] == two["layers"] == 4  # the block-sparse attention runs in every layer of both workers
    assert two["layout"]  # streamed loads: the engine takes a policy from host tensors at two workers too
    assert two["buckets"] > 1  # and the version went to the workers in several calls


@pytest.mark.parametrize("phase", PHASES)
def test_two_workers_decode_as_one_in_every_phase(runs, phase):
    one, two = runs[1]["phases"][phase], runs[2]["phases"][phase]
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["budgets"] == b["budgets"] and a["probe"] == b["probe"] and a["versions"] == b["versions"]
        diff = float((torch.tensor(a["logprobs"]) - torch.tensor(b["logprobs"])).abs().max())
        assert diff <= TOLERANCE, f"{phase}: max |tp1 - tp2| sampled logprob = {diff:.2e}"
        top = float((torch.tensor(a["top_logprobs"]) - torch.tensor(b["top_logprobs"])).abs().max())
        assert top <= TOLERANCE, f"{phase}: max |tp1 - tp2| top-20 logprob = {top:.2e}"


def test_every_swap_changed_what_the_engine_decodes(runs):
    phases = runs[2]["phases"]
    sparse = [s for name in ("sched-a", "sched-b", "probe") for s in phases[name]]
    assert all(0 < b < 240 for s in sparse for b in s["budgets"][1:])  # selection really happened
    # The swap between two steps: budgets of the first schedule, then of the second.
    assert {48, 64} & set(phases["sched-b"][0]["budgets"]) and {96, 112} & set(phases["sched-b"][0]["budgets"])
    assert [s["probe"] for s in phases["probe"]].count(True) == 1
    assert [s["versions"] for s in phases["lora"]] == [[3, 1, 2]] * 2
    for before, after in zip(PHASES, PHASES[1:], strict=False):
        if (before, after) == ("sched-a", "sched-b"):
            continue  # same first steps (the swap came at step 6); compared by budgets above
        diffs = [
            float((torch.tensor(x["logprobs"]) - torch.tensor(y["logprobs"])).abs().max())
            for x, y in zip(phases[before], phases[after], strict=True)
            if x["tokens"][:4] == y["tokens"][:4]
        ]
        changed = [x["tokens"] != y["tokens"] for x, y in zip(phases[before], phases[after], strict=True)]
        assert any(changed) or max(diffs, default=0.0) > 1e-3, f"{before} -> {after} changed nothing"
