"""Datasets in the shapes users bring (verl's Parquet, plain JSONL, folders of shards), mixing, templating."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow.data import DataError, load_samples
from sparrow.mix import Mix, Source
from sparrow.prompts import ChatSettings, PromptError, Renderer, prepare_source, stop_token_ids
from sparrow.rows import RowShape


def verl_rows(count, source="openai/gsm8k"):
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_verl_parquet_rows(tmp_path):
    result = load_samples(write_parquet(tmp_path / "train.parquet", verl_rows(3)))
    s = result.samples[2]
    assert s.messages == [{"role": "user", "content": "What is 2 + 2?"}]
    assert (s.ground_truth, s.data_source, s.row, s.extras["index"]) == ("4", "openai/gsm8k", 3, 2)


def test_plain_jsonl_with_keys_and_gsm8k_extraction(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm8k.jsonl",
        [{"question": "Q1", "answer": "48 / 2 = 24\n#### 1,024"}, {"question": "Q2", "answer": "no marker"}],
    )
    shape = RowShape(prompt_key="question", answer_key="answer", answer_extraction="gsm8k")
    result = load_samples(path, shape, on_bad_row="skip")
    assert [(s.prompt, s.ground_truth, s.data_source) for s in result.samples] == [("Q1", "1024", "gsm8k")]
    assert [str(b) for b in result.skipped] == [f"{path} line 2: field 'answer' has no '#### answer' to extract"]


def test_numbers_as_answers_and_bad_lines_with_their_numbers(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "a", "answer": 3}, "{broken", {"problem": "", "answer": 1}])
    result = load_samples(path, RowShape(prompt_key="problem"), on_bad_row="skip")
    assert [s.ground_truth for s in result.samples] == ["3"]
    assert [b.line for b in result.skipped] == [2, 3]
    with pytest.raises(DataError, match=r"p.jsonl line 2: not valid JSON"):
        load_samples(path, RowShape(prompt_key="problem"))


def test_folder_of_shards_is_one_source(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-0.parquet", verl_rows(2))
    write_parquet(shards / "part-1.parquet", verl_rows(3))
    assert len(load_samples(shards).samples) == 5


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.parquet", "no such data file"),
        (lambda d: (d / "data.csv").write_text("a,b\n") and d / "data.csv", "unknown data file type '.csv'"),
        (lambda d: (d / "bad.parquet").write_bytes(b"not parquet") and d / "bad.parquet", "not a readable parquet"),
        (
            lambda d: write_parquet(d / "q.parquet", [{"question": "x", "answer": "1"}]),
            r"no prompt column 'prompt' \(columns: question, answer\)",
        ),
    ],
)
def test_bad_files_are_one_line(tmp_path, make, message):
    with pytest.raises(DataError, match=message) as info:
        load_samples(make(tmp_path))
    assert "\n" not in str(info.value)


def test_unknown_role_is_a_bad_row(tmp_path):
    rows = verl_rows(2)
    rows[1]["prompt"] = [{"role": "narrator", "content": "x"}]
    with pytest.raises(DataError, match=r"row 2: field 'prompt' message 0 has role 'narrator'"):
        load_samples(write_parquet(tmp_path / "t.parquet", rows))


def test_mix_follows_ratios_and_resumes():
    mix = Mix([Source("a", list(range(10)), 3.0), Source("b", list(range(100, 110)), 1.0)], seed=1)
    draws = [mix.next() for _ in range(4000)]
    share = sum(i == 0 for i, _ in draws) / len(draws)
    assert 0.72 < share < 0.78
    first_epoch = [x for i, x in draws if i == 0][:10]
    assert sorted(first_epoch) == list(range(10))  # every row once per epoch
    state = mix.state()
    ahead = [mix.next() for _ in range(50)]
    again = Mix([Source("a", list(range(10)), 3.0), Source("b", list(range(100, 110)), 1.0)], seed=1)
    again.restore(json.loads(json.dumps(state)))
    assert [again.next() for _ in range(50)] == ahead


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.fixtures.qwen3_checkpoint import build_qwen3_checkpoint

    return build_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3") / "model")


def test_chat_template_with_kwargs_and_system_prompt(qwen3, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3)
    samples = load_samples(write_parquet(tmp_path / "t.parquet", verl_rows(4))).samples
    chat = ChatSettings(kwargs={"enable_thinking": False}, system_prompt="Reason, then answer in \\boxed{}.")
    prepared = prepare_source("gsm8k", samples, Renderer(tok, chat), max_prompt_tokens=512)
    messages = [{"role": "system", "content": chat.system_prompt}, *samples[0].messages]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert list(prepared.prompts[0].token_ids) == list(want)
    assert prepared.prompts[0].text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert stop_token_ids(tok, qwen3) == (tok.convert_tokens_to_ids("<|im_end|>"), 0)


def test_long_prompts_filtered_with_a_count_or_refused(qwen3, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3)
    rows = verl_rows(3)
    rows[1]["prompt"][0]["content"] = "What is 1 + 1? " * 200
    samples = load_samples(write_parquet(tmp_path / "t.parquet", rows)).samples
    renderer = Renderer(tok, ChatSettings())
    prepared = prepare_source("s", samples, renderer, max_prompt_tokens=64)
    assert (len(prepared.prompts), prepared.too_long) == (2, 1)
    with pytest.raises(PromptError, match=r"row 2: the prompt is \d+ tokens after templating, over max_prompt_tokens"):
        prepare_source("s", samples, renderer, max_prompt_tokens=64, on_long_prompt="error")
    with pytest.raises(PromptError, match="no prompt left after templating"):
        prepare_source("s", samples, renderer, max_prompt_tokens=4)


def test_no_chat_template_refused_when_asked_for():
    from trainer.model_io import load_tokenizer

    tok = load_tokenizer("models/tiny")
    with pytest.raises(PromptError, match="has no chat template"):
        Renderer(tok, ChatSettings(template="tokenizer"))
    assert Renderer(tok, ChatSettings()).raw  # auto: raw text for a model without one
