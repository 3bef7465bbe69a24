"""`sparrow export`: a published version as an HF folder in the user's dtype, with tokenizer and chat template."""

import json

import torch

from services.trainer.weights import POLICY, WeightStore, save_hf_policy
from tests.cli_runner import sparrow
from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint
from trainer.model_io import load_model


def _run_dir(tmp_path, template_file):
    """A `sparrow up` run folder holding two policy versions published the way the trainer publishes them."""
    model_dir = build_qwen3_checkpoint(tmp_path / "qwen3", template_file=template_file)
    run = tmp_path / "run"
    (run / "services").mkdir(parents=True)
    (run / "services" / "trainer.toml").write_text(f'model_dir = "{model_dir}"\n')
    model = load_model(model_dir)  # float32, as the trainer trains
    store = WeightStore(run / "trainer", keep=3)
    for version in (1, 2):
        with torch.no_grad():
            model.model.norm.weight.add_(1.0)  # a "step"
        store.publish(POLICY, version, lambda out: save_hf_policy(model, out, model_dir, "float32"))
    store.close()
    return run, model_dir, model


def test_export_loads_in_bf16_with_the_same_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    for template_file in (False, True):
        run, model_dir, trained = _run_dir(tmp_path / str(template_file), template_file)
        published = run / "trainer" / POLICY / "v00000002"
        assert (published / "chat_template.jinja").is_file() == template_file  # versions keep every template file
        out = tmp_path / f"export-{template_file}"
        result = sparrow("export", run, "--out", out, "--json", timeout=120)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["version"] == 2 and json.loads(result.stdout)["dtype"] == "bfloat16"
        model = AutoModelForCausalLM.from_pretrained(out)
        assert model.dtype == torch.bfloat16
        assert torch.equal(model.model.norm.weight, trained.model.norm.weight.to(torch.bfloat16))
        tok, base = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(model_dir)
        assert tok.chat_template == base.chat_template and tok.chat_template
        assert GenerationConfig.from_pretrained(out).eos_token_id == [2, 0]


def test_export_refusals_are_one_line(tmp_path):
    run, _, _ = _run_dir(tmp_path, False)
    for args, fragment in [
        ((tmp_path / "nothing", "--out", tmp_path / "o1"), "no published policy versions"),
        ((run, "--out", tmp_path / "o2", "--version", "7"), "no policy version 7 (kept: 1, 2)"),
    ]:
        result = sparrow("export", *args, timeout=120)
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
