"""`sparrow model build --size tiny` on a short budget, in a subprocess: the folder loads with transformers
and generates; `sparrow model eval --json` reads it back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _sparrow(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sparrow_cli.main", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    proc = _sparrow("model", "build", "--size", "tiny", "--out", str(out), "--steps", "20", "--eval-samples", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_build_saves_a_loadable_hf_folder(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "build.json"):
        assert (tiny_dir / name).is_file(), name
    info = json.loads((tiny_dir / "build.json").read_text())
    assert info["command"][:3] == ["sparrow", "model", "build"]
    assert info["config"]["seed"] == 0 and info["steps_done"] == 20
    assert {"greedy_accuracy", "sampled_accuracy", "sampled_kv_max"} <= set(info["heldout"][0])

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers >= 4
    ids = tok("kab dop ; dop kab ; ? kab 1 :", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1] :]), str)


def test_build_is_deterministic(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    proc = _sparrow("model", "build", "--size", "tiny", "--out", str(tmp_path), "--steps", "20", "--eval-samples", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = load_file(tiny_dir / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_eval_json(tiny_dir):
    proc = _sparrow("model", "eval", "--model", str(tiny_dir), "--difficulty", "4:2", "--samples", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["results"]
    assert rows[0]["pairs"] == 4 and rows[0]["hops"] == 2 and 0.0 <= rows[0]["sampled_accuracy"] <= 1.0
    assert rows[0]["greedy_kv_max"] >= 1 + 3 * 4 + 4


def test_user_errors_are_one_line(tmp_path):
    proc = _sparrow("model", "eval", "--model", str(tmp_path), "--difficulty", "4:2")
    assert proc.returncode == 2 and "missing config.json" in proc.stderr
    proc = _sparrow("model", "eval", "--model", str(tmp_path), "--difficulty", "4:300")
    assert proc.returncode == 2 and "hops" in proc.stderr
    proc = _sparrow("model", "build", "--size", "tiny", "--out", str(tmp_path), "--steps", "0")
    assert proc.returncode == 2 and "--steps" in proc.stderr


def test_a_build_continues_from_its_own_weights_at_the_last_stage(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "more"
    proc = _sparrow("model", "build", "--size", "tiny", "--out", str(out), "--steps", "3", "--eval-samples", "1",
                    "--init-from", str(tiny_dir), "--min-hops", "12", "--lr", "1e-3", "--fp32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((out / "build.json").read_text())
    assert info["config"]["init_from"] == str(tiny_dir) and info["config"]["bf16"] is False
    assert info["final_stage"] == "p16-h12..16" and info["stages"] == []  # straight to the last stage, hops 12..16
    assert info["init_from_build"]["steps_done"] == 20  # the record of what it started from
    before, after = load_file(tiny_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and not all(before[k].equal(after[k]) for k in before)
    # Trained on, not from scratch: the weights moved little.
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved < 0.05, moved

