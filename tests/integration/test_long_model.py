"""The committed long-context policy (models/long) solves the long task greedily at more than 4K tokens of KV,
where most of its decisions read evidence more than 2K tokens back (the first lap's prompt, or the same hop
one lap earlier)."""

from pathlib import Path

import torch

from sparrow.rewards import chain_reward
from sparrow.tasks import ChainTask, ExampleStream, encode_words
from sparrow.tasks.vocab import BOS, EOS, TOKEN_TO_ID, VOCAB
from sparrow_cli.model_cmd import built_filler
from trainer.model_io import load_model

LONG = Path(__file__).resolve().parents[2] / "models" / "long"


def test_models_long_solves_a_4k_instance_greedily():
    filler = built_filler(str(LONG))
    task = ChainTask(pairs=64, max_hops=120, min_hops=120, filler=filler)
    example = ExampleStream(task, seed=0, split="heldout").next()
    distances = task.evidence_distances(example)
    assert sum(d > 2048 for d in distances) / len(distances) > 0.5  # a walk that stays local would not count
    torch.set_num_threads(1)
    model = load_model(LONG)
    prompt = [TOKEN_TO_ID[BOS], *encode_words(example.prompt)]
    answer = task.sequence_tokens() - task.prompt_tokens()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=answer + 8,
            do_sample=False,
            eos_token_id=TOKEN_TO_ID[EOS],
            pad_token_id=TOKEN_TO_ID[EOS],
        )[0, len(prompt) :].tolist()
    text = " ".join(VOCAB[t] for t in out if t != TOKEN_TO_ID[EOS])
    assert len(prompt) + len(out) >= 4096
    assert text == example.solution  # every hop, every countdown, the boxed answer
    assert chain_reward(text, example.answer) == 1.0


def test_models_long_would_write_a_256_hop_solution_greedily_token_for_token():
    """At 8.9K tokens of KV, checked teacher-forced in one forward: when every token of the solution (and the
    EOS after it) is the argmax given the tokens before it, greedy decoding writes exactly that solution."""
    filler = built_filler(str(LONG))
    task = ChainTask(pairs=64, max_hops=256, min_hops=256, filler=filler)
    example = ExampleStream(task, seed=1, split="heldout").next()
    torch.set_num_threads(1)
    model = load_model(LONG)
    prompt = [TOKEN_TO_ID[BOS], *encode_words(example.prompt)]
    target = [*encode_words(example.solution), TOKEN_TO_ID[EOS]]
    ids = torch.tensor([prompt + target])
    assert ids.shape[1] == task.sequence_tokens() > 8192
    with torch.no_grad():
        argmax = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    wrong = [(i, VOCAB[target[i]], VOCAB[argmax[i]]) for i in range(len(target)) if argmax[i] != target[i]]
    assert not wrong, f"{len(wrong)} of {len(target)} tokens differ (position, wanted, argmax): {wrong[:5]}"
