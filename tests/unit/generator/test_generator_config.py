"""The generator's config: the shipped TOML parses to the defaults, overrides apply, bad values are one line."""

import json
import tomllib
from pathlib import Path

import pytest

from services.generator.config import GeneratorConfig
from sparrow.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "services" / "generator" / "generator.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("SPARROW_SECURITY__TOKEN", "SPARROW_QUEUE__URL", "SPARROW_REDIS__URL", "SPARROW_GENERATOR_ID"):
        monkeypatch.delenv(key, raising=False)


def test_shipped_config_parses_and_spells_out_every_default():
    config = load_config(GeneratorConfig, SHIPPED)
    assert config.model_dump(exclude={"generator_id"}) == GeneratorConfig().model_dump(exclude={"generator_id"})
    written = tomllib.loads(SHIPPED.read_text())
    dumped = config.model_dump()
    for section, values in written.items():
        if isinstance(values, dict):
            assert set(values) | {"token"} >= set(dumped[section]) - {"token"}, f"[{section}] lacks a key"
            for key, value in values.items():
                assert dumped[section][key] == value, f"{section}.{key}"
        else:
            assert dumped[section] == values


def test_generator_id_defaults_to_hostname_pid_and_differs_per_process():
    import os
    import socket

    assert GeneratorConfig().generator_id == f"{socket.gethostname()}-{os.getpid()}"


def test_environment_and_flags_override_and_the_token_is_masked(monkeypatch):
    monkeypatch.setenv("SPARROW_SECURITY__TOKEN", "s3cret")
    monkeypatch.setenv("SPARROW_REDIS__URL", "redis://elsewhere:6380/1")
    config = load_config(GeneratorConfig, SHIPPED, {"engine.kind": "reference", "queue.claim_idle_s": 2.5})
    assert config.redis.url == "redis://elsewhere:6380/1" and config.queue.claim_idle_s == 2.5
    assert config.engine.kind == "reference"
    assert config.security.client().token == "s3cret" and config.security.server().token == "s3cret"
    dumped = config.dump()
    assert "s3cret" not in dumped and json.loads(dumped)["security"]["token"] == "**********"


def test_the_old_queue_url_is_read_with_one_deprecation_line(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SPARROW_QUEUE__URL", "redis://elsewhere:6380/1")
    with caplog.at_level("WARNING", logger="sparrow.config"):
        config = load_config(GeneratorConfig, SHIPPED)
    assert config.redis.url == "redis://elsewhere:6380/1"
    assert [r.getMessage().split(" is deprecated")[0] for r in caplog.records] == [
        "SPARROW_QUEUE__URL in the environment"
    ]
    monkeypatch.delenv("SPARROW_QUEUE__URL")
    old = tmp_path / "old.toml"
    old.write_text('[queue]\nurl = "redis://file:6379/2"\nclaim_idle_s = 7.0\n')
    config = load_config(GeneratorConfig, old)
    assert config.redis.url == "redis://file:6379/2" and config.queue.claim_idle_s == 7.0


def test_tls_settings_split_into_server_and_client_sides():
    config = load_config(GeneratorConfig, overrides={"security.tls_cert": "c.pem", "security.tls_key": "k.pem"})
    assert config.security.server().tls and config.security.server().tls_key == "k.pem"
    only_ca = load_config(GeneratorConfig, overrides={"security.tls_ca": "ca.pem"})
    assert only_ca.security.client().tls and not only_ca.security.server().tls


def test_weights_address_defaults_to_the_trainer_address():
    config = load_config(GeneratorConfig, overrides={"trainer.address": "t:1"})
    assert config.trainer.weights_target == "t:1"
    assert load_config(GeneratorConfig, overrides={"trainer.weights_address": "w:2"}).trainer.weights_target == "w:2"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"engine.kind": "sglang"}, "engine.kind"),
        ({"queue.claim_idle_s": 0}, "queue.claim_idle_s"),
        ({"queue.max_attempts": 0}, "queue.max_attempts"),
        ({"max_in_flight_groups": 0}, "max_in_flight_groups"),
        ({"security.tls_cert": "c.pem"}, "must be set together"),
        ({"trainer.reconnect_initial_s": 20.0}, "reconnect_initial_s is above"),
        ({"metrics.port": 70000}, "metrics.port"),
        ({"queue.claim_idel_s": 1}, "unknown config key 'queue.claim_idel_s'"),
        ({"generator_id": ""}, "generator_id"),
        ({"engine.kind": "reference", "engine.speculative_tokens": 17}, "engine.speculative_tokens"),
        ({"engine.kind": "reference", "engine.speculative_tokens": 0}, "engine.speculative_tokens"),
        ({"engine.kind": "reference", "engine.decode": "lossy"}, "engine.decode"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(GeneratorConfig, overrides=override)
    assert "\n" not in str(info.value)


def test_speculative_decode_is_a_vllm_engine_setting_too():
    config = load_config(GeneratorConfig, overrides={"engine.decode": "speculative", "engine.speculative_tokens": 4})
    assert (config.engine.kind, config.engine.decode, config.engine.speculative_tokens) == ("vllm", "speculative", 4)


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "want"),
    [(False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")],
)
def test_auto_dtype_on_cpu_is_bf16_only_where_the_cpu_computes_it(monkeypatch, avx512_bf16, amx, want):
    import torch

    from services.generator.main import cpu_auto_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert cpu_auto_dtype() == want


@pytest.mark.parametrize(
    "cuda, cpu_compile, cuda_graphs, eager",
    [(False, False, "piecewise", True), (False, True, "piecewise", False), (True, True, "off", True),
     (True, False, "piecewise", False)],
)  # fmt: skip
def test_a_cpu_engine_compiles_only_when_asked_and_a_cuda_one_as_its_graphs_say(
    monkeypatch, cuda, cpu_compile, cuda_graphs, eager
):
    """The vLLM engine's build is replaced by a recorder (building one is the integration tests' work): what
    `build_engine` asks of it is the knob's whole effect."""
    import services.generator.vllm_engine as vllm_engine
    from services.generator import main

    built = []
    monkeypatch.setattr(vllm_engine, "VllmEngine", lambda config: built.append(config) or config)
    monkeypatch.setattr(main, "_cuda", lambda: cuda)
    overrides = {"engine.cpu_compile": cpu_compile, "engine.cuda_graphs": cuda_graphs, "engine.dtype": "float32"}
    main.build_engine(load_config(GeneratorConfig, overrides=overrides))
    assert [c.enforce_eager for c in built] == [eager]
