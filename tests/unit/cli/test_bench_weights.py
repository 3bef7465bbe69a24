"""`sparrow bench weights` end to end on a tiny shape (2 generator processes), and its flag checks.
The figures are checked for consistency (bytes, identical digests), never for speed."""

import json

import pytest

from tests.cli_runner import sparrow

TINY = ["--layers", "1", "--vocab", "512", "--generators", "3", "--versions", "2"]


@pytest.mark.slow
def test_bench_weights_json_every_mode_identical_and_the_relay_delta_mode_sends_least():
    r = sparrow("bench", "weights", *TINY, "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    modes = {m["mode"]: m for m in out["modes"]}
    assert list(modes) == ["fp32-trainer", "bf16-trainer", "bf16-streamed", "bf16-relay", "bf16-relay-delta"]
    assert all(m["all_identical"] for m in modes.values())
    copy = out["bf16_copy_bytes"]
    # Today: 3 generators x one fp32 copy (two bf16 copies) each; bf16 halves it; the relay sends 2 (the fanout).
    assert modes["fp32-trainer"]["steady_bytes_per_bf16_copy"] == pytest.approx(6.0, rel=0.01)
    assert modes["bf16-trainer"]["steady_bytes_per_bf16_copy"] == pytest.approx(3.0, rel=0.01)
    assert modes["bf16-streamed"]["steady_bytes_per_bf16_copy"] == pytest.approx(3.0, rel=0.01)
    assert modes["bf16-streamed"]["streamed"] and not modes["bf16-trainer"]["streamed"]
    assert modes["bf16-relay"]["steady_bytes_per_bf16_copy"] == pytest.approx(2.0, rel=0.01)
    delta = modes["bf16-relay-delta"]
    assert delta["versions"][1]["full_bytes_left_trainer"] == 0
    assert delta["versions"][1]["delta_bytes_left_trainer"] == 2 * delta["versions"][1]["delta_bytes"] < copy
    assert "stand-in" in out["engine"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--generators", "0"], "--generators must be"),
        (["--modes", "bf16-trainer,warp"], "--modes: unknown ['warp']"),
        (["--modes", ""], "--modes: unknown none given"),
        (["--lr", "0"], "--lr must be positive"),
        (["--real-steps", "1", "--model", "no/such/model"], "--model no/such/model: no config.json"),
    ],
)
def test_bad_flags_are_one_line(argv, fragment):
    r = sparrow("bench", "weights", *argv, timeout=60)
    assert r.returncode == 2 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
