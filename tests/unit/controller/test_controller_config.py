"""The controller's config (the shipped TOML parses and matches the defaults) and the metric contract."""

import json
import tomllib
from pathlib import Path

import pytest

from services.controller.config import ControllerConfig
from services.controller.prometheus_source import queries
from sparrow import metrics_contract as mc
from sparrow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "services" / "controller" / "controller.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("SPARROW_RETUNE__TAU", "SPARROW_API__TOKEN", "SPARROW_SECURITY__TOKEN", "SPARROW_INTERVAL_S"):
        monkeypatch.delenv(key, raising=False)


def test_shipped_config_parses_and_spells_out_the_defaults():
    config = load_config(ControllerConfig, SHIPPED)
    assert config == ControllerConfig()
    written = tomllib.loads(SHIPPED.read_text())
    dumped = config.model_dump()
    for section, values in written.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert dumped[section][key] == value, f"{section}.{key}"


def test_environment_and_flags_override_and_the_token_is_masked(monkeypatch):
    monkeypatch.setenv("SPARROW_RETUNE__TAU", "0.9")
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "s3cret")
    config = load_config(ControllerConfig, SHIPPED, {"interval_s": 2.5})
    assert config.retune.tau == 0.9 and config.interval_s == 2.5
    assert config.security.token.get_secret_value() == "s3cret"
    assert "s3cret" not in config.dump() and json.loads(config.dump())["security"]["token"] == "**********"


def test_the_old_admin_token_variable_is_read_with_one_deprecation_line(monkeypatch, caplog):
    monkeypatch.setenv("SPARROW_API__TOKEN", "s3cret")
    with caplog.at_level("WARNING", logger="sparrow.config"):
        config = load_config(ControllerConfig, SHIPPED)
    assert config.security.token.get_secret_value() == "s3cret"
    [line] = [r.getMessage() for r in caplog.records]
    assert "SPARROW_API__TOKEN" in line and "SPARROW_SECURITY__TOKEN" in line and "s3cret" not in line


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"retune.budget_quantum": 100}, "page size"),
        ({"retune.min_budget": 8192, "retune.max_budget": 4096}, "above max_budget"),
        ({"retune.min_budget": 600}, "not on the budget grid"),
        ({"retune.max_budget": 4352}, "the next grid value is 4608"),
        ({"retune.tau": 0.99, "retune.margin": 0.02}, "below 1"),
        ({"retune.p5_source": "mean"}, "retune.p5_source"),
        ({"retune.taus": 0.8}, "unknown config key 'retune.taus'"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ControllerConfig, overrides=override)


def test_target_is_tau_plus_margin():
    config = load_config(ControllerConfig, overrides={"retune.tau": 0.86, "retune.margin": 0.03})
    assert config.retune.target == pytest.approx(0.89)


def test_metric_contract():
    assert list(mc.ALPHA_BUCKETS) == sorted(mc.ALPHA_BUCKETS) and mc.ALPHA_BUCKETS[-1] == 1.0
    assert 0.86 in mc.ALPHA_BUCKETS  # tau is a bucket edge, so the quantile is sharpest where it matters
    for name in (mc.ALPHA_HISTOGRAM, mc.ALPHA_P5_GAUGE, mc.ALPHA_TOKENS_GAUGE, mc.SCHEDULE_VERSION_GAUGE):
        assert name.startswith("sparrow_trainer_")
    q = queries(300, probes=False)
    assert q["p5_histogram"] == "histogram_quantile(0.05, sum by (le, bin) (rate(sparrow_trainer_alpha_bucket[300s])))"
    assert "probe_p5" not in q and "probe_p5" in queries(300, probes=True)


def test_tail_quantile_and_alpha_name_the_series_the_controller_reads():
    q = queries(300, probes=False, quantile=0.01, alpha="exact")
    assert q["p5_histogram"] == (
        "histogram_quantile(0.01, sum by (le, bin) (rate(sparrow_trainer_alpha_exact_bucket[300s])))"
    )
    assert q["p5_exact"] == "min by (bin) (sparrow_trainer_alpha_exact_p1)"
    assert q["tokens_exact"] == "sum by (bin) (sparrow_trainer_alpha_exact_tokens)"
    assert queries(300, probes=False, quantile=0.01)["p5_exact"] == "min by (bin) (sparrow_trainer_alpha_p1)"
    # A quantile with no gauge has only the histogram's reading.
    assert "p5_exact" not in queries(300, probes=False, quantile=0.02)
    config = load_config(ControllerConfig, overrides={"retune.tail_quantile": 0.01, "retune.alpha": "exact"})
    assert (config.retune.tail_quantile, config.retune.alpha) == (0.01, "exact")
    with pytest.raises(ValueError, match="no per-bin gauge"):
        load_config(ControllerConfig, overrides={"retune.tail_quantile": 0.02})
    assert (
        load_config(
            ControllerConfig, overrides={"retune.tail_quantile": 0.02, "retune.p5_source": "histogram"}
        ).retune.tail_quantile
        == 0.02
    )
    with pytest.raises(ValueError, match="probes read p5"):
        load_config(ControllerConfig, overrides={"retune.tail_quantile": 0.01, "probe.enabled": True})
    with pytest.raises(ValueError):
        load_config(ControllerConfig, overrides={"retune.alpha": "bound"})
