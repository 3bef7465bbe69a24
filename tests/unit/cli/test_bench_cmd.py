"""`sparrow bench attention` and `sparrow selfcheck` end to end, on small shapes. The figures are
checked for consistency, never for speed (timed assertions make CI flaky)."""

import json

import pytest

from tests.cli_runner import sparrow

SMALL = ["--context", "1024", "--budget", "256", "--batch", "2", "--kv-heads", "2", "--q-heads", "4"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bench_attention_json(backend):
    r = sparrow("bench", "attention", *SMALL, "--head-dim", "64", "--iters", "2", "--backend", backend, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backend"] == backend
    assert out["dense_ms"] == min(out["dense_sdpa_ms"], out["dense_paged_ms"])
    assert out["speedup"] == pytest.approx(out["dense_ms"] / out["sparse_ms"], rel=1e-2)
    # KV bytes: dense 2 x 1024 x 64 x 4 per head; sparse 2 x 256 x 64 x 4 plus 64 centroids of 64 floats.
    assert out["kv_bytes_dense"] == 4 * 2 * 1024 * 64 * 4
    assert out["kv_bytes_sparse"] == 4 * (2 * 256 * 64 * 4 + 64 * 64 * 4)
    assert out["bound"] == pytest.approx(out["kv_bytes_dense"] / out["kv_bytes_sparse"], rel=1e-3)
    assert out["max_abs_diff_full_budget"] < 1e-5


def test_bench_attention_verify_json_and_a_verify_longer_than_the_context_is_one_line():
    r = sparrow("bench", "attention", *SMALL, "--head-dim", "32", "--iters", "1", "--verify-tokens", "7", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["batch"], out["query_tokens"], out["context"], out["kv_heads"]) == (2, 7, 1024, 2)
    assert out["speedup"] == pytest.approx(out["copy_sdpa_ms"] / out["in_place_ms"], rel=1e-6)
    assert out["max_abs_diff"] < 1e-5  # the two ways compute the same attention
    r = sparrow("bench", "attention", "--context", "4", "--verify-tokens", "7")
    assert r.returncode == 2 and "query tokens must be in [1, context = 4], got 7" in r.stderr


def test_bench_attention_text():
    r = sparrow("bench", "attention", *SMALL, "--iters", "1")
    assert r.returncode == 0, r.stderr
    assert "speedup" in r.stdout and "KV-bytes bound" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "100"], "multiple of 16"),
        (["--context", "0"], "--context must be positive"),
        (["--q-heads", "3"], "cannot share"),
        (["--block-size", "0"], "--block-size must be positive"),
        (["--block-size", "-16"], "--block-size must be positive"),
    ],
)
def test_bench_attention_bad_input(args, message):
    r = sparrow("bench", "attention", *SMALL, *args)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_selfcheck_json():
    r = sparrow("selfcheck", "--context", "2048", "--budget", "256", "--batch", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True
    assert out["schedule"]["name"] == "qwen3-1.7b-0.86" and len(out["schedule"]["budgets"]) == 20
    assert out["cost"]["speedup"] > 1
    assert out["bench"]["context"] == 2048


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget", "100"], "multiple of 16"),
        (["--context", "0"], "--context must be positive"),
        (["--batch", "-1"], "--batch must be positive"),
    ],
)
def test_selfcheck_bad_input(args, message):
    r = sparrow("selfcheck", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_selfcheck_takes_a_schedule_file_named_after_no_model(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "budgets": [256, 512]}))
    r = sparrow("selfcheck", "--preset", path, "--context", "1024", "--budget", "256", "--batch", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["schedule"]["name"] == "mine" and out["cost"]["model"] == "qwen3-1.7b"
