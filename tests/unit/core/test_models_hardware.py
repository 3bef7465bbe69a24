import json
import os

import pytest

from sparrow.hardware import Hardware, HardwareError, get_hardware, list_hardware, probe_cpu
from sparrow.models import ModelSpecError, from_hf_config, get_model, list_models, resolve_model

# Model-card totals and non-embedding counts, in billions.
PUBLISHED = {"qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_model_cards(name):
    spec = get_model(name)
    total, non_embedding = PUBLISHED[name]
    assert spec.params / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.non_embedding_params / 1e9 == pytest.approx(non_embedding, rel=0.02)


def test_derived_kv_dim_and_gqa_ratio():
    m = get_model("qwen3-4b")
    assert m.kv_dim == 36 * 8 * 128 and m.gqa_ratio == 4
    assert get_model("QWEN3-14B").gqa_ratio == 5
    assert get_model("qwen3-1.7b").tie_embeddings and not get_model("qwen3-8b").tie_embeddings
    assert list_models() == list(PUBLISHED)


def test_hf_config_round_trip(tmp_path):
    m = get_model("qwen3-8b")
    config = {
        "model_type": "qwen3",
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": False,
    }
    built = from_hf_config(config, name="qwen3-8b")
    assert built == m
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(tmp_path)).params == m.params
    with pytest.raises(ModelSpecError, match="missing vocab_size"):
        from_hf_config({k: v for k, v in config.items() if k != "vocab_size"})


def test_unknown_model_names_close_ones():
    with pytest.raises(ModelSpecError, match="did you mean qwen3-4b"):
        get_model("qwen3-4")
    with pytest.raises(ModelSpecError, match="cannot read model config"):
        resolve_model("/nonexistent/config.json")


def test_hardware_presets():
    h200, h100 = get_hardware("h200"), get_hardware("H100")
    assert h200.flops_per_byte == pytest.approx(989e12 / 4.8e12)
    assert h100.flops_per_byte == pytest.approx(989e12 / 3.35e12)
    assert h200.bytes_per_element == 2 and "datasheet" in h200.source
    assert list_hardware() == ["h200", "h100"]
    with pytest.raises(HardwareError, match="unknown hardware 'a100'"):
        get_hardware("a100")


def test_cpu_probe_measures_something_plausible():
    hw = probe_cpu(seconds=0.2, reuse=False)
    assert hw.name == "cpu" and hw.bytes_per_element == 4
    assert 1e8 < hw.peak_flops < 1e14
    assert 1e8 < hw.mem_bandwidth < 1e13


def test_a_cpu_measurement_is_reused_until_it_is_old_or_unreadable(tmp_path, monkeypatch):
    import time

    from sparrow import disk_cache, hardware

    monkeypatch.setenv(disk_cache.ENV, str(tmp_path))
    measured = []

    def measure(seconds):
        measured.append(seconds)
        return Hardware("cpu", 1e10 * len(measured), 1e9, 4, "measured")

    monkeypatch.setattr(hardware, "_measure_cpu", measure)
    first = probe_cpu()
    assert probe_cpu() == first and get_hardware("cpu") == first and len(measured) == 1  # one measurement, shared
    assert probe_cpu(reuse=False).peak_flops == 2e10  # measured again on request, and kept
    assert probe_cpu().peak_flops == 2e10 and len(measured) == 2
    (entry,) = (tmp_path / "cpu-probe").glob("*.json")
    entry.write_text("{not json")  # torn or hand-edited: a miss, measured and written again
    assert probe_cpu().peak_flops == 3e10 and probe_cpu().peak_flops == 3e10 and len(measured) == 3
    monkeypatch.setattr(time, "time", lambda real=time.time: real() + hardware.PROBE_MAX_AGE_S + 1)
    assert probe_cpu().peak_flops == 4e10  # a day old: measured again
    monkeypatch.setenv(disk_cache.ENV, "none")  # caching off: every call measures
    assert probe_cpu().peak_flops == 5e10 and probe_cpu().peak_flops == 6e10


def test_a_cache_folder_that_cannot_be_written_costs_only_the_reuse(tmp_path, monkeypatch):
    from sparrow import disk_cache, hardware

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(disk_cache.ENV, str(blocker / "below-a-file"))
    monkeypatch.setattr(hardware, "_measure_cpu", lambda seconds: Hardware("cpu", 1e10, 1e9, 4, "measured"))
    assert probe_cpu().peak_flops == 1e10


def test_auto_is_this_machines_hardware(monkeypatch):
    import torch

    # no GPU here: auto is this CPU, measured (a local run's generators run on it)
    if not torch.cuda.is_available():
        assert get_hardware("auto").name == "cpu"
    # a GPU is priced by its preset when its name has one, and refused in one line when not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU on CI machines: the name is faked
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert get_hardware("AUTO").name == "h200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    assert get_hardware("auto").name == "h100"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A10G")
    with pytest.raises(HardwareError, match="no preset for the GPU 'NVIDIA A10G'"):
        get_hardware("auto")


def test_a_process_without_torch_finds_the_kept_cpu_figures_without_importing_it(tmp_path):
    """The controller prices `auto` hardware at start: on a machine with no GPU device node and OMP_NUM_THREADS set (as
    `sparrow up` sets it for every child), the CPU's kept figures are found under the key torch would make, and torch
    (2 s of CPU) is never imported; without the variable only torch can tell the thread count, and it is asked."""
    import subprocess
    import sys

    from sparrow import hardware

    script = (
        "import sys, json; from sparrow.hardware import get_hardware; hw = get_hardware('auto'); "
        "print(json.dumps([hw.peak_flops, 'torch' in sys.modules]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"SPARROW_CACHE_DIR": str(tmp_path)}
    keep = [sys.executable, "-c", "from sparrow.hardware import probe_cpu; probe_cpu(seconds=0.1)"]  # measures, keeps
    subprocess.run(keep, env=env | {"OMP_NUM_THREADS": "1"}, check=True, timeout=120)
    (entry,) = (tmp_path / "cpu-probe").glob("*.json")
    kept = json.loads(entry.read_text())["value"]["peak_flops"]
    for threads, torch_expected in (("1", hardware._accelerator_nodes()), (None, True)):
        run_env = env | ({"OMP_NUM_THREADS": threads} if threads else {})
        r = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        flops, imported = json.loads(r.stdout)
        assert imported == torch_expected, threads
        if threads:
            assert flops == kept  # the figures kept by the process that imported torch: one key for both
    assert len(list((tmp_path / "cpu-probe").glob("*.json"))) <= 2  # the 2-thread default may have measured its own
