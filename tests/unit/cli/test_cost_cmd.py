import json

import pytest

from tests.cli_runner import sparrow

BASE = ["cost", "--model", "qwen3-4b", "--schedule", "qwen3-4b-0.86", "--prompt-len", "512", "--gen-len", "32768"]


def test_cost_text():
    r = sparrow(*BASE, "--samples", "8", "--hardware", "h200")
    assert r.returncode == 0, r.stderr
    assert "dense" in r.stdout and "sparse" in r.stdout
    assert "predicted speedup" in r.stdout and "I 206.0 FLOP/byte" in r.stdout


def test_cost_json_matches_the_core():
    from sparrow.cost import predict
    from sparrow.hardware import get_hardware
    from sparrow.models import get_model
    from sparrow.presets import get_preset

    data = json.loads(sparrow(*BASE, "--json").stdout)
    expected = predict(get_model("qwen3-4b"), get_preset("qwen3-4b-0.86"), get_hardware("h200"), 512, 32768, 8)
    assert data["speedup"] == pytest.approx(expected.speedup)
    assert data["dense"]["total"] == pytest.approx(data["dense"]["compute"] + data["dense"]["memory"])
    assert data["samples"] == 8 and data["hardware"] == "h200" and data["dense_layers_priced"] == 0


def test_cost_with_a_schedule_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"budgets": [64000]}))
    data = json.loads(sparrow(*BASE[:3], "--schedule", path, "--json").stdout)
    assert data["speedup"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("swap", "fragment"),
    [
        (("--model", "qwen3-5b"), "unknown model 'qwen3-5b'"),
        (("--schedule", "qwen3-4b-0.99"), "unknown schedule preset"),
        (("--hardware", "tpu"), "unknown hardware 'tpu'"),
        (("--gen-len", "0"), "--gen-len must be >= 1"),
    ],
)
def test_cost_bad_input(swap, fragment):
    args = list(BASE)
    flag, value = swap
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    r = sparrow(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], r.stderr


def test_cost_with_a_misaligned_schedule_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"budgets": [500]}))
    r = sparrow(*BASE[:3], "--schedule", path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not a multiple of the page size" in r.stderr


def test_cost_with_a_model_config_that_is_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{}")
    r = sparrow("cost", "--model", path, "--schedule", "qwen3-4b-0.86")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "cannot read model config" in r.stderr


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("num_attention_heads", "8", "num_heads must be a positive integer, got '8'"),
        ("vocab_size", "many", "vocab_size must be a positive integer, got 'many'"),
        ("vocab_size", -5, "vocab_size must be a positive integer, got -5"),
    ],
)
def test_cost_with_a_mistyped_model_config(tmp_path, field, value, fragment):
    config = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8}
    config |= {"intermediate_size": 3072, "vocab_size": 1000, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = sparrow("cost", "--model", path, "--schedule", "qwen3-4b-0.86")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and fragment in r.stderr


def test_cost_with_a_model_config_nested_too_deeply(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    r = sparrow("cost", "--model", path, "--schedule", "qwen3-4b-0.86")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "malformed JSON" in r.stderr


def test_cost_predicts_speculative_decoding_from_k_and_alpha():
    from sparrow.cost import predict, predict_speculative
    from sparrow.hardware import get_hardware
    from sparrow.models import get_model
    from sparrow.presets import get_preset

    r = sparrow(*BASE, "--speculative-tokens", "6", "--alpha", "0.97")
    assert r.returncode == 0, r.stderr
    assert "6.40 tokens per cycle of 6 sparse steps + 1 dense verify" in r.stdout
    data = json.loads(sparrow(*BASE, "--speculative-tokens", "6", "--alpha", "0.97", "--json").stdout)
    base = predict(get_model("qwen3-4b"), get_preset("qwen3-4b-0.86"), get_hardware("h200"), 512, 32768, 8)
    assert data["speculative"]["speedup"] == pytest.approx(predict_speculative(base, 6, 0.97).speedup)
    assert "speculative" not in json.loads(sparrow(*BASE, "--json").stdout)
    for bad, fragment in (
        (["--alpha", "0.9"], "go together"),
        (["--speculative-tokens", "17", "--alpha", "0.9"], "--speculative-tokens must be in [1, 16]"),
        (["--speculative-tokens", "4", "--alpha", "1.5"], "--alpha must be in [0, 1]"),
    ):
        r = sparrow(*BASE, *bad)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and fragment in lines[0], r.stderr


def test_cost_with_a_measured_step_overhead():
    from sparrow.cost import predict, predict_speculative
    from sparrow.hardware import get_hardware
    from sparrow.models import get_model
    from sparrow.presets import get_preset

    args = [*BASE, "--step-overhead", "2.5", "--speculative-tokens", "6", "--alpha", "0.97"]
    data = json.loads(sparrow(*args, "--json").stdout)
    priced = predict(get_model("qwen3-4b"), get_preset("qwen3-4b-0.86"), get_hardware("h200"), 512, 32768, 8,
                     step_overhead=2.5)  # fmt: skip
    assert data["step_overhead"] == 2.5 and data["speedup"] == pytest.approx(priced.speedup)
    assert data["speculative"]["speedup"] == pytest.approx(predict_speculative(priced, 6, 0.97).speedup)
    assert "step overhead 2.5 x 2P per forward" in sparrow(*args).stdout
    for bad in ("-1", "nan", "inf"):
        r = sparrow(*BASE, "--step-overhead", bad)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "--step-overhead must be a finite number >= 0" in lines[0]
