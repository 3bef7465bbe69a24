"""`sparrow bench trainer` end to end on short sequences: every case runs, the figures are consistent, the
chunked head's extra memory is far below the full head's. Never timed assertions (CI machines vary)."""

import json

import pytest

from tests.cli_runner import sparrow


@pytest.mark.slow
def test_a_short_run_reports_every_case_and_the_goals(tmp_path):
    out = tmp_path / "bench.json"
    r = sparrow("bench", "trainer", "--lengths", "512", "--chunk", "64", "--hidden", "64", "--json", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert json.loads(out.read_text()) == result
    assert result["vocab"] == 151_936 and result["chunk"] == 64
    assert [(row["op"], row["tokens"]) for row in result["rows"]] == [("score", 512), ("update", 512)]
    three = result["three_chunk_tensors_gib"]
    assert three == pytest.approx(3 * 64 * 151_936 * 4 / 2**30)
    for row in result["rows"]:
        assert {"none", "chunked", "full"} <= set(row)
        assert row["none"]["head_extra_gib"] == 0
        # The full head holds [512, vocab] float32 logits and more: 0.29 GiB each.
        assert row["full"]["head_extra_gib"] > 512 * 151_936 * 4 / 2**30
        assert row["chunked"]["head_extra_gib"] < row["full"]["head_extra_gib"] / 2
        assert row["chunked_extra_over_three_chunk_tensors"] == pytest.approx(
            row["chunked"]["head_extra_gib"] / three, rel=1e-6
        )
        assert row["chunked_time_over_full"] == pytest.approx(
            row["chunked"]["seconds"] / row["full"]["seconds"], rel=1e-6
        )
    assert set(result["goals"]) == {
        "chunked_extra_within_three_chunk_tensors",
        "chunked_time_within_1.15x_of_full_at_shortest",
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "100"], "above 256 tokens"),
        (["--lengths", "2k"], "comma-separated"),
        (["--chunk", "0"], "--chunk must be positive"),
        (["--hidden", "100"], "multiple of 64"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(args, message):
    r = sparrow("bench", "trainer", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
