"""The chain task: format, determinism, difficulty knobs, and a held-out split that never overlaps training."""

import random

import pytest

from sparrow.rewards import chain_reward
from sparrow.tasks import VOCAB, ChainTask, ExampleStream, TaskError, encode_words, generate, split_of
from sparrow.tasks.vocab import MAX_NAMES, NAMES, NUMBERS


def _follow(example):
    words = example.prompt.split()
    q = words.index("?")
    pairs = {words[i]: words[i + 1] for i in range(0, q, 3)}
    cur, hops = words[q + 1], int(words[q + 2])
    for _ in range(hops):
        cur = pairs[cur]
    return cur


def test_solution_follows_the_chain_and_boxes_the_answer():
    for ex in generate(ChainTask(pairs=12, max_hops=12), 50, seed=3):
        assert _follow(ex) == ex.answer
        assert ex.solution.endswith(f"\\boxed{{ {ex.answer} }}")
        assert chain_reward(ex.solution, ex.answer) == 1.0
        steps = ex.solution.split(" ; ")[:-1]
        assert len(steps) == ex.hops
        assert [int(s.split()[0]) for s in steps] == list(range(ex.hops, 0, -1))


def test_context_is_one_cycle_in_random_order():
    ex = generate(ChainTask(pairs=30, max_hops=30, min_hops=30), 1, seed=1)[0]
    words = ex.prompt.split()
    keys = words[0:90:3]
    values = words[1:90:3]
    assert words[2:90:3] == [";"] * 30
    assert sorted(keys) == sorted(values) and len(set(keys)) == 30
    assert ex.answer == words[91]  # 30 hops around a 30-cycle come back to the start
    assert keys != [words[91]] + values[:-1]  # not listed in chain order


def test_long_chains_go_round_the_cycle():
    for ex in generate(ChainTask(pairs=5, max_hops=40, min_hops=12), 20, seed=2):
        assert _follow(ex) == ex.answer
        assert len(ex.solution.split(" ; ")) - 1 == ex.hops
        assert len(set(ex.prompt.split()[0:15:3])) == 5  # still only the prompt's names


def test_lengths_match_the_difficulty():
    task = ChainTask(pairs=40, max_hops=25, min_hops=25)
    ex = generate(task, 1)[0]
    assert 1 + len(encode_words(ex.prompt)) == task.prompt_tokens()
    assert 1 + len(encode_words(ex.text)) + 1 == task.sequence_tokens()
    assert ChainTask(64, 200, min_hops=200).sequence_tokens() >= 1000


def test_deterministic_per_seed_and_split():
    task = ChainTask(pairs=8, max_hops=8)
    assert generate(task, 20, seed=5) == generate(task, 20, seed=5)
    assert generate(task, 20, seed=5) != generate(task, 20, seed=6)
    assert generate(task, 20, seed=5, split="heldout") == generate(task, 20, seed=5, split="heldout")


@pytest.mark.parametrize("pairs", [3, 4, 16])
def test_heldout_never_overlaps_training(pairs):
    # small tasks repeat prompts often, so overlap would show here first
    task = ChainTask(pairs=pairs, max_hops=min(pairs, 3), name_pool=max(pairs, 8))
    train = {ex.prompt for ex in generate(task, 3000, seed=0)}
    held = {ex.prompt for ex in generate(task, 300, seed=0, split="heldout")}
    assert not train & held
    assert all(split_of(ex) == "heldout" for ex in generate(task, 50, split="heldout"))


def test_stream_changes_difficulty_between_draws():
    stream = ExampleStream(ChainTask(4, 2), seed=0)
    assert stream.next().pairs == 4
    assert stream.next(ChainTask(10, 5)).pairs == 10


def test_name_pool_limits_names():
    for ex in generate(ChainTask(pairs=10, max_hops=5, name_pool=10), 20):
        assert set(ex.prompt.split()[0:30:3]) == set(NAMES[:10])


def test_every_word_is_in_the_vocabulary():
    ex = generate(ChainTask(pairs=MAX_NAMES, max_hops=MAX_NAMES, min_hops=MAX_NAMES), 1)[0]
    assert len(encode_words(ex.text)) == len(ex.text.split())
    assert len(set(VOCAB)) == len(VOCAB)
    assert not set(NAMES) & set(NUMBERS)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pairs=1, max_hops=1),
        dict(pairs=8, max_hops=257),
        dict(pairs=8, max_hops=4, min_hops=5),
        dict(pairs=8, max_hops=0),
        dict(pairs=20, max_hops=4, name_pool=10),
        dict(pairs=MAX_NAMES + 1, max_hops=4),
    ],
)
def test_impossible_settings_are_clear_errors(kwargs):
    with pytest.raises(TaskError):
        ChainTask(**kwargs)


def test_bad_split_is_an_error():
    with pytest.raises(TaskError):
        generate(ChainTask(4, 2), 1, split="test")


def test_sampling_uses_only_the_given_rng():
    a = ChainTask(6, 3).sample(random.Random(1))
    b = ChainTask(6, 3).sample(random.Random(1))
    assert a == b


def _positions(example):
    """Every token of prompt and solution with its position (BOS at 0)."""
    return ["<s>", *example.prompt.split(), *example.solution.split()]


def test_long_task_writes_a_countdown_after_each_hop():
    task = ChainTask(pairs=8, max_hops=20, min_hops=20, filler=5)
    ex = generate(task, 1, seed=2)[0]
    assert _follow(ex) == ex.answer and chain_reward(ex.solution, ex.answer) == 1.0
    hops = ex.solution.split(" ; ")[:-1]
    assert [h.split()[3:] for h in hops] == [["5", "4", "3", "2", "1"]] * 20
    assert len(_positions(ex)) + 1 == task.sequence_tokens() == task.prompt_tokens() + 20 * task.hop_tokens + 4
    assert task.name == "p8-h20-f5"
    with pytest.raises(TaskError, match="filler"):
        ChainTask(pairs=8, max_hops=8, filler=-1)


def test_evidence_distances_point_at_the_nearest_earlier_statement_of_the_pair():
    task = ChainTask(pairs=6, max_hops=15, min_hops=15, filler=3)
    ex = generate(task, 1, seed=5)[0]
    tokens = _positions(ex)
    start = 1 + len(ex.prompt.split())
    for off, dist in zip(task.lookup_offsets(ex.hops), task.evidence_distances(ex), strict=True):
        here = start + off - 1  # the current name, whose next token is the looked-up one
        key, value = tokens[here], tokens[here + 1]
        # a brute-force search: the latest earlier position where `key` is followed by `value`
        earlier = [i for i in range(here) if tokens[i] == key and tokens[i + 1] == value]
        assert earlier and here - earlier[-1] == dist
    # a lap (6 hops of 7 tokens) back once the first lap is written
    assert task.evidence_distances(ex)[6:] == [6 * task.hop_tokens] * 9


def test_the_long_task_puts_most_evidence_more_than_2k_tokens_back():
    long = ChainTask(pairs=64, max_hops=256, min_hops=256, filler=30)
    plain = ChainTask(pairs=64, max_hops=200, min_hops=200)
    far = [d > 2048 for ex in generate(long, 4, seed=0) for d in long.evidence_distances(ex)]
    assert long.sequence_tokens() == 8905 and sum(far) / len(far) > 0.75
    assert max(d for ex in generate(plain, 4, seed=0) for d in plain.evidence_distances(ex)) < 600
