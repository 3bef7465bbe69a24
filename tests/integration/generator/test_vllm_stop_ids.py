"""Generation stops at every stop id, for real on vLLM's CPU engine: both eos ids a Qwen3 checkpoint lists in
generation_config.json and the run's own `sampling.stop_token_ids`, gathered as the trainer gathers them.

vLLM by itself stops at one eos id (and, with no tokenizer loaded, maybe none); the engine passes every id.
The checkpoint's weights are random and tiny (tests/fixtures), so each token is close to uniform over the
vocabulary and every stop id ends some of the samples: each sample that stopped ends at its first stop id,
which is kept as its last token (the trainer trains on it); every other one ran to the length limit with no
stop id in it.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from sparrow.work import PromptGroup, Sampling
from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint

pytestmark = pytest.mark.slow

MAX_NEW = 256
EXTRA_STOP = 100  # an ordinary BPE token named in sampling.stop_token_ids


def test_generation_stops_at_both_eos_ids_and_the_configured_stop_ids(tmp_path):
    from transformers import AutoTokenizer

    from services.generator.engine import FINISH_LENGTH, FINISH_STOP
    from services.generator.vllm_engine import VllmEngine, VllmEngineConfig
    from sparrow.prompts import stop_token_ids

    torch.set_num_threads(1)
    model = build_qwen3_checkpoint(tmp_path / "Qwen3-test")
    tok = AutoTokenizer.from_pretrained(model)
    eos = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    stops = stop_token_ids(tok, model, (EXTRA_STOP,))
    assert len(eos) == 2 and set(stops) == {*eos, EXTRA_STOP}
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        enable_thinking=False,
        tokenize=False,
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    engine = VllmEngine(VllmEngineConfig(model=str(model), max_model_len=512, max_num_seqs=48))
    try:
        sampling = Sampling(max_new_tokens=MAX_NEW, top_logprobs=1, stop_token_ids=stops)
        for g in range(6):
            engine.submit(PromptGroup(f"stops-{g}", tuple(prompt), 8, 0, sampling))
        done = []
        while engine.in_flight:
            done.extend(engine.step())
    finally:
        engine.close()
    assert len(done) == 48
    ended_by = Counter()
    for s in done:
        hits = [i for i, t in enumerate(s.token_ids) if t in stops]
        if s.finish_reason == FINISH_STOP:
            assert hits == [len(s.token_ids) - 1], f"{s.group_id}/{s.sample_index}: stop ids at {hits}"
            ended_by[s.token_ids[-1]] += 1
        else:
            assert s.finish_reason == FINISH_LENGTH and len(s.token_ids) == MAX_NEW and not hits
    assert set(ended_by) == set(stops), f"samples ended by {dict(ended_by)}; stop ids {stops}"
