"""The user's job end to end: an HF-format Qwen3 checkpoint laid out as on the hub (tests/fixtures), a math
dataset in verl's Parquet shape, `sparrow up --model DIR --data train.parquet --eval-data test.parquet
--reward math --steps 2` on vLLM, then `sparrow export`.

The checkpoint has Qwen3's vocabulary layout and size (151,643 BPE tokens, the added tokens from 151643
on, an embedding of 151,936 rows) at a tiny hidden size; the other tests use the fixture's small
vocabulary (this one costs about 50 s more with it). The weights are random (no hub here): what is
checked is the plumbing the issue lists, the chat-templated prompts token for token, stops at the eos
ids or the length limit, the math reward on every group, evaluation before step 1 and after step 2,
and an export that transformers loads in bf16.
"""

import json
import re
import urllib.parse
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from report.history import read_eval_history, read_history
from tests.cli_runner import sparrow_process as sparrow
from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint
from tests.integration.launcher.helpers import UpProcess
from tests.servers import prometheus_server
from tests.tracking_readers import tensorboard_scalars

pytestmark = pytest.mark.slow


def _math_rows(count, split):
    return [
        {
            "data_source": "toy/arith",
            "prompt": [{"role": "user", "content": f"What is {i} + {i + 1}? Put the answer in \\boxed{{}}."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": split, "index": i},
        }
        for i in range(count)
    ]


def _samples(prometheus: str, selector: str) -> list[float]:
    """Every value Prometheus holds for `selector` over the last hour (raw samples of a range vector)."""
    query = urllib.parse.urlencode({"query": f"{selector}[1h]"})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?{query}", timeout=10) as resp:
        result = json.loads(resp.read())["data"]["result"]
    return [float(v) for series in result for _, v in series["values"]]


def test_user_model_data_reward_eval_and_export(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_qwen3_checkpoint(tmp_path / "Qwen3-test", qwen3_vocab=True)
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(_math_rows(8, "train")), train)
    pq.write_table(pa.Table.from_pylist(_math_rows(3, "test")), test)
    config = tmp_path / "up.toml"
    config.write_text(
        "[timeouts]\nstart_s = 400\nstep_s = 400\nstop_grace_s = 15\n"
        "[trainer]\ngroups_per_step = 2\n"
        # A checkpoint after every step: the last one comes before the last eval round, whose groups then stay
        # in groups.log for the checks below (a checkpoint compacts the evaluated groups out of it).
        "[trainer.checkpoint]\nevery = 1\n"
        "[trainer.data]\nchat_template_kwargs = { enable_thinking = false }\n"
        "[trainer.sampling]\nn = 4\nmax_new_tokens = 16\n"
        '[trainer.eval]\nevery = 2\nk = 2\nmodes = ["dense", "schedule"]\n'
        "[trainer.reward]\nworkers = 2\n"
        '[tracking]\nbackends = ["tensorboard"]\n'
        # float32 as the trainer scores (the checkpoint is bf16; vLLM would serve it in bf16 on "auto")
        '[generator.engine]\ndevice = "cpu"\nkernel_backend = "torch"\ndtype = "float32"\n'
    )
    run_dir = tmp_path / "run"
    up = UpProcess(
        "--config", str(config), "--model", str(model_dir), "--data", str(train), "--eval-data", str(test),
        "--reward", "math", "--steps", "2", "--no-controller", "--run-dir", str(run_dir), "--json",
    )  # fmt: skip
    try:
        code = up.wait(900)
    finally:
        up.kill()
    assert code == 0, up.proc.stderr.read()[-3000:]
    summary = up.lines[-1]
    assert summary["outcome"] == "completed" and summary["steps_done"] == 2
    assert summary["work"]["lost"] == []

    # The prompts the generators got are the chat-templated ones, token for token.
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 151_669 and json.loads((model_dir / "config.json").read_text())["vocab_size"] == 151_936
    rows = {r["extra_info"]["index"]: r for r in _math_rows(8, "train")}
    groups = [json.loads(line) for line in (run_dir / "trainer" / "groups.log").read_text().splitlines()]
    train_groups = [g["group"] for g in groups if g.get("kind") == "enqueued" and g["group"]["purpose"] == "train"]
    assert train_groups
    for g in train_groups:
        messages = rows[g["extras"]["index"]]["prompt"]
        want = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=False)
        assert g["prompt_token_ids"] == tok(want, add_special_tokens=False)["input_ids"]
        assert g["prompt_text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert (g["reward"], g["data_source"]) == ("math", "toy/arith")

    # Every trajectory ended at one of the eos ids or at the length limit; the math reward scored every one.
    steps = [json.loads(line) for line in (run_dir / "trainer" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["finished_other"] == 0 and s["finished_stop"] + s["finished_length"] == s["samples"] == 8
        assert s["reward_errors"] == 0 and set(s["reward_by_source"]) == {"toy/arith"}
    assert [r["step"] for r in read_history(run_dir)] == [1, 2]

    # Evaluation before step 1 and after step 2, dense and under the run's schedule in the same rounds, in the
    # trainer's history, the summary and the report.
    evals = summary["evals"]
    assert [(e["step"], e["mode"]) for e in evals] == [(0, "dense"), (0, "schedule"), (2, "dense"), (2, "schedule")]
    assert all(e["complete"] for e in evals)
    for e in evals:
        figures = e["sources"]["toy/arith"]
        assert figures["prompts"] == 3 and {"avg@2", "pass@1", "pass@2"} <= set(figures)
    for dense, scheduled in zip(evals[::2], evals[1::2], strict=True):
        gap = dense["sources"]["toy/arith"]["avg@2"] - scheduled["sources"]["toy/arith"]["avg@2"]
        assert scheduled["dense_gap"]["toy/arith"]["avg@2"] == pytest.approx(gap)
    # The eval groups went to vLLM as evaluation groups, dense ones asking for dense attention.
    eval_groups = [g["group"] for g in groups if g.get("kind") == "enqueued" and g["group"]["purpose"] == "eval"]
    modes = [(re.search(r"-eval\d{4}-([ds])-", g["group_id"]).group(1), g["dense"]) for g in eval_groups]
    assert set(modes) == {("d", True), ("s", False)}
    # ... in the run's metrics history, a row per round and mode, as the trainer reported them ...
    eval_rows = read_eval_history(run_dir)
    assert [(r["round"], r["step"], r["mode"]) for r in eval_rows] == [
        (0, 0, "dense"), (0, 0, "schedule"), (1, 2, "dense"), (1, 2, "schedule"),
    ]  # fmt: skip
    assert [r["sources"] for r in eval_rows] == [e["sources"] for e in evals]
    # ... and in Prometheus per mode: what the run's own Prometheus scraped, read back from its storage.
    with prometheus_server({"none": ["127.0.0.1:1"]}, data_dir=run_dir / "prometheus" / "data") as prom:
        seen = {
            (mode, key): _samples(prom.url, f'{metric}{{source="toy/arith",mode="{mode}"{extra}}}')
            for mode in ("dense", "schedule")
            for key, metric, extra in (
                ("avg@2", "sparrow_trainer_eval_avg_reward", ""),
                ("pass@2", "sparrow_trainer_eval_pass_ratio", ',k="2"'),
            )
        }
    for (mode, key), values in seen.items():
        figures = [e["sources"]["toy/arith"][key] for e in evals if e["mode"] == mode]
        assert values and set(values) <= set(figures) and figures[0] in values  # round 0's, scraped during the steps
    report = (run_dir / "report" / "report.md").read_text()
    assert "## Held-out evaluation" in report and (run_dir / "report" / "eval.png").is_file()
    assert "| 0 | 0 | v1 | schedule | toy/arith | 3 |" in report
    # ... and in the experiment tracker, per mode and source at the step each round ran after, with the gap.
    assert summary["tracking"] == {"tensorboard": "ok"}
    tb = tensorboard_scalars(run_dir / "tensorboard")
    for e in evals:
        name = f"eval/{e['mode']}/toy/arith/avg@2"
        assert tb[name][e["step"]] == pytest.approx(e["sources"]["toy/arith"]["avg@2"]), name
    assert sorted(tb["eval/dense_gap/toy/arith/avg@2"]) == [0, 2]

    out = tmp_path / "exported"
    result = sparrow("export", run_dir, "--out", out, timeout=300)
    assert result.returncode == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert str(model.dtype) == "torch.bfloat16"
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
