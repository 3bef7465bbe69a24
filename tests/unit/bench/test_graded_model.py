"""The graded bench model: written loadable, refused settings, and graded disagreement that the
trainer's top-20 bound sees (checked on its own samples, dense against block-sparse scoring)."""

import json

import torch

from bench.graded_model import main
from sparrow.acceptance import alpha_exact, alpha_topk
from sparrow.schedule import Schedule
from sparrow.tasks.chain import ChainTask, generate
from sparrow.tasks.vocab import BOS, TOKEN_TO_ID, encode_words
from trainer.model_io import load_model
from trainer.scoring import Scorer


def test_bad_settings_are_one_line_errors(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "m"), "--std", "0"]) == 2
    assert main(["--out", str(tmp_path / "m"), "--embed-scale", "-1"]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["--out", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


def test_its_alpha_falls_by_degrees_with_the_budget_and_top20_sees_it(tmp_path):
    torch.manual_seed(0)
    assert main(["--out", str(tmp_path / "m")]) == 0
    info = json.loads((tmp_path / "m" / "build.json").read_text())
    assert info["init_std"] == 0.1 and info["embed_scale"] == 4.0
    model = load_model(tmp_path / "m").eval()
    prompt = [TOKEN_TO_ID[BOS]] + encode_words(generate(ChainTask(64, 8), 1, seed=5)[0].prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=200, min_new_tokens=200, do_sample=True)
    sequence = out[0].tolist()
    scorer = Scorer(model, backend="torch")
    dense = scorer.score([sequence], [len(prompt)], full=True)[0]
    means = []
    for budget in (48, 96, 256):
        rule = Schedule(budgets=(budget,), bin_width=4096, dense_layers=())
        sparse = scorer.score([sequence], [len(prompt)], schedule=rule, full=True)[0]
        exact = alpha_exact(sparse.full_logprobs, dense.full_logprobs)
        bound = alpha_topk(sparse.top_ids, sparse.top_logprobs, dense.top_ids, dense.top_logprobs)
        assert float((exact - bound).mean()) < 0.02  # top-20 holds nearly all the mass: the bound is tight
        means.append(float(exact.mean()))
        if budget == 48:
            low = exact
    # Graded, not all-or-nothing: at 48 tokens most tokens sit strictly between 0.05 and 0.99.
    assert float(((low > 0.05) & (low < 0.99)).double().mean()) > 0.3
    assert means[0] < means[1] < means[2] and 0.6 < means[0] < 0.97
