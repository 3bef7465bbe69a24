"""`sparrow calibrate` end to end on a random tiny model with tiny settings, and its bad inputs."""

import json

import pytest
import torch

from sparrow.schedule import Schedule
from sparrow_cli.main import main

TINY_RUN = ["--budgets", "48,64,128", "--bin-width", "32", "--num-prompts", "3", "--num-heldout", "2"]
TINY_TASK = ["--task-pairs", "6", "--task-hops", "10", "--min-bin-tokens", "5"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from offline.tokenizer import save_tokenizer, vocab_size

    torch.set_num_threads(1)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_random_with_tokenizer")
    config = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab_size(),
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def _outputs(tmp_path):
    return ["--plot", str(tmp_path / "p5.png"), "--out", str(tmp_path / "schedule.json")]


def test_calibrate_on_task_prompts_writes_a_schedule_and_a_plot(model_dir, tmp_path, capsys):
    code = main(["calibrate", "--model", str(model_dir), *TINY_RUN, *TINY_TASK, *_outputs(tmp_path), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    schedule = Schedule.load(tmp_path / "schedule.json")
    assert report["schedule"] == schedule.to_dict()
    assert schedule.bin_width == 32 and set(schedule.budgets) <= {48, 64, 128}
    assert schedule.dense_layers == (0, 1)  # the paper's choice unless --dense-layers says otherwise
    assert (tmp_path / "p5.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [run["budget"] for run in report["fixed_budgets"]] == [48, 64, 128]
    for run in report["fixed_budgets"]:
        assert run["tokens"] > 0
        # whole sequences: prod_t alpha_t, which a failure in under 5% of the tokens still moves
        seq = run["sequences"]
        assert seq["sequences"] == 3 and seq["mean_tokens"] * 3 == pytest.approx(run["tokens"])
        assert 0.0 <= seq["acceptance_mean"] <= 1.0 and 0.0 <= seq["acceptance_per_1k"] <= 1.0
        for row in run["bins"]:
            assert 0.0 <= row["p5_topk"] <= row["p5"] + 1e-6 <= 1.0 + 1e-6
            assert {"index", "kv_start", "tokens", "trusted", "mean", "mean_topk"} <= set(row)
            # The tail beyond p5, exact beside the bound: the bound is never above the exact value.
            assert 0.0 <= row["p1_topk"] <= row["p1"] + 1e-6 and row["p1"] <= row["p5"] + 1e-9
            assert 0.0 <= row["under_half"] <= row["under_half_topk"] <= 1.0
    assert len(report["fit"]) == schedule.num_bins
    assert report["validation"]["tokens"] > 0 and all("in_band" in r for r in report["validation"]["bins"])
    assert report["prompts"] == {"calibration": 3, "heldout": 2, "source": "chain task p6-h1..10"}
    assert "budget 48:" in out.err  # progress goes to stderr under --json


def test_calibrate_on_a_prompt_file_skipping_bad_rows(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": f"kab dop ; dop kab ; ? kab {i} :"}) for i in range(1, 5)]
    prompts.write_text("\n".join([rows[0], "{broken", *rows[1:]]) + "\n")
    args = ["calibrate", "--model", str(model_dir), *TINY_RUN, "--max-new-tokens", "40", "--min-bin-tokens", "5"]
    args += ["--prompts", str(prompts), *_outputs(tmp_path)]
    assert main([*args, "--on-bad-row", "stop"]) == 2
    assert "prompts.jsonl line 2: not valid JSON" in capsys.readouterr().err
    assert main([*args, "--on-bad-row", "skip"]) == 0
    out = capsys.readouterr()
    assert "skipped" in out.err and "line 2: not valid JSON" in out.err
    assert "fitted schedule, bin width 32" in out.out and "held-out prompts with the fitted schedule" in out.out
    assert "held-out tail, exact / top-20 bound:" in out.out and "share alpha < 0.5" in out.out
    assert "whole sequences, prod_t alpha_t" in out.out
    Schedule.load(tmp_path / "schedule.json")


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (["--budgets", "64,100"], "not a multiple of the page size 16"),
        (["--budgets", "32"], "below the 48 tokens"),
        (["--tau", "1.5"], "--tau must be in (0, 1)"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--plot", "out.svg"], "--plot must name a .png file"),
        (["--dense-layers", "1,7"], "the model has 4 layers"),
        (["--local-blocks", "3"], "below the 64 tokens"),
    ],
)
def test_bad_flags_are_one_line_errors(model_dir, tmp_path, capsys, change, fragment):
    args = ["calibrate", "--model", str(model_dir), *TINY_RUN, *_outputs(tmp_path), *change]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_bad_model_folders_and_prompt_files(model_dir, tmp_path, capsys):
    base = ["calibrate", *TINY_RUN, *_outputs(tmp_path)]
    assert main([*base, "--model", str(tmp_path)]) == 2
    assert "missing config.json" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([*base, "--model", str(model_dir), "--prompts", str(empty)]) == 2
    assert "no prompts in the file" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_an_output_that_is_a_folder_is_refused_before_calibrating(model_dir, tmp_path, capsys, flag):
    folder = tmp_path / "folder.png"
    folder.mkdir()
    args = ["calibrate", "--model", str(model_dir), *TINY_RUN, *TINY_TASK, *_outputs(tmp_path), flag, str(folder)]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert f"{flag} {folder}: is a folder" in captured.err and captured.err.count("\n") == 1
    assert captured.out == "" and not any(p.suffix in (".json", ".png") and p.is_file() for p in tmp_path.iterdir())
