"""`sparrow bench distill`: bad flags are one line and exit 2; a tiny run prints its report, writes JSON and a PNG."""

import json

import pytest

from tests.cli_runner import sparrow

# Prompts of about 28 tokens and 12 hops: past 64 tokens the budget of 4 pages selects one of the others.
TINY_RUN = ("--model", "models/tiny", "--pairs", "8", "--hops", "12", "--budgets", "64", "--bin-width", "32")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--budgets", "64,abc"), "--budgets 64,abc"),
        (("--budgets", "40"), "--budgets 40"),
        (("--steps", "0"), "--steps must be positive"),
        (("--group-size", "1"), "--group-size must be at least 2"),
        (("--model", "no/such/model"), "no config.json"),
        (("--kl-coef", "-1"), "kl_coef"),
        (("--selection-coef", "-1"), "selection_coef"),
        (("--pairs", "500"), "pairs"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    short = () if "--steps" in args else ("--steps", "1")
    r = sparrow("bench", "distill", *args, *short, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--out", "--plot"])
@pytest.mark.parametrize("where", ["folder", "missing_folder"])
def test_an_output_that_cannot_be_written_is_one_line_before_the_run(tmp_path, flag, where):
    path = tmp_path if where == "folder" else tmp_path / "no" / "such.png"
    run = ("--steps", "1", "--groups", "1", "--group-size", "2", "--heldout", "1", flag, path)
    r = sparrow("bench", "distill", *TINY_RUN, *run, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag} {path}" in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_a_tiny_run_reports_bins_before_and_after_and_writes_json_and_a_plot(tmp_path):
    out, png = tmp_path / "report.json", tmp_path / "distill.png"
    run = ("--steps", "2", "--groups", "1", "--group-size", "2", "--heldout", "2", "--out", out, "--plot", png)
    r = sparrow("bench", "distill", *TINY_RUN, *run, "--selection-coef", "1", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report == json.loads(out.read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2] and all(s["tokens"] > 0 for s in report["steps"])
    assert report["before"] and {b["bin"] for b in report["after"]} == {b["bin"] for b in report["before"]}
    assert all(0 <= b["p5"] <= 1 and "p5_without" in b for b in report["after"])
    assert all(s["selection"] > 0 for s in report["steps"])  # the budget selects: the selection loss is on
    for b in report["before"] + report["after"]:
        assert b["lookups"] >= 0 and (b["lookups_failed"] is None or 0 <= b["lookups_failed"] <= 1)
    assert sum(b["lookups"] for b in report["after"]) > 0
    settings = report["settings"]
    assert settings["budgets"] == [64] and settings["distill"]["kl_estimator"] == "k3"
    assert settings["distill"]["selection_coef"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 2:" in r.stderr  # progress goes to stderr when stdout carries JSON


def test_the_names_two_tokens_after_a_hop_number_count_as_lookups():
    from bench.distill import lookup_mask
    from sparrow.tasks.vocab import NAMES, encode_words
    from trainer.batch import Rollout

    a, b = NAMES[:2]
    ids = encode_words(f"3 {a} {b} ; 2 {b} {a} ; 1 {a} {b} ; \\boxed{{ {b} }}")
    n = len(ids)
    r = Rollout("g", 0, (1,), tuple(ids), (0.0,) * n, ((0,),) * n, ((0.0,),) * n, (0,) * n)
    assert lookup_mask([r, r]).tolist() == [t in (2, 6, 10) for t in range(n)] * 2
