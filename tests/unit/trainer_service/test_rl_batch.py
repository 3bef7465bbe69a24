"""Padded tensors from rollouts: response tokens land where the logits that score them are."""

import math

import pytest
import torch

from trainer.batch import Rollout, collate, generator_topk, micro_batches


def _rollout(prompt, tokens, gid="g", index=0):
    n = len(tokens)
    return Rollout(
        group_id=gid,
        sample_index=index,
        prompt_ids=tuple(prompt),
        token_ids=tuple(tokens),
        logprobs=tuple(-0.1 * (i + 1) for i in range(n)),
        top_ids=tuple((t, t + 1) for t in tokens),
        top_logprobs=tuple((-0.1, -2.5) for _ in tokens),
    )


def test_collate_aligns_targets_mask_and_rollout_logprobs():
    a = _rollout([1, 2, 3], [7, 8])
    b = _rollout([1, 2], [9, 10, 11, 12], index=1)
    mb = collate([a, b], torch.tensor([0.5, -0.5]), [0, 1])
    assert mb.input_ids.tolist() == [[1, 2, 3, 7, 8, 0], [1, 2, 9, 10, 11, 12]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    # logits at column c score input c + 1: row a's response (7, 8) is scored at columns 2 and 3
    assert mb.mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert mb.targets[0, 2:4].tolist() == [7, 8] and mb.targets[1, 1:5].tolist() == [9, 10, 11, 12]
    assert mb.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0])
    placed = mb.place([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0, 6.0])])
    assert placed.tolist() == [[0, 0, 1, 2, 0], [0, 3, 4, 5, 6]]
    assert a.kv_lens().tolist() == [3, 4] and b.kv_lens().tolist() == [2, 3, 4, 5]


def test_micro_batches_cover_the_batch_in_order():
    rollouts = [_rollout([1, 2], [5] * (i + 1), index=i) for i in range(5)]
    adv = torch.arange(5.0)
    mbs = micro_batches(rollouts, adv, size=2)
    assert [mb.rows for mb in mbs] == [[0, 1], [2, 3], [4]]
    assert mbs[1].advantages.tolist() == [2.0, 3.0] and mbs[2].input_ids.shape == (1, 7)
    with pytest.raises(ValueError, match="advantages of shape"):
        micro_batches(rollouts, torch.zeros(4), size=2)


def test_generator_topk_stacks_every_position_and_pads_short_rows():
    a = _rollout([1], [7, 8])
    short = Rollout("g", 1, (1,), (4,), (-0.3,), ((4,),), ((-0.3,),))
    ids, lps = generator_topk([a, short])
    assert ids.tolist() == [[7, 8], [8, 9], [4, -1]]
    assert lps[2, 1].item() == -math.inf and lps[0, 0].item() == pytest.approx(-0.1)


def test_bad_rollouts_are_refused():
    empty = Rollout("g", 0, (1,), (), (), (), ())
    with pytest.raises(ValueError, match="empty prompt or response"):
        collate([empty], torch.zeros(1), [0])
    uneven = Rollout("g", 0, (1,), (2, 3), (-0.1,), ((2,), (3,)), ((-0.1,), (-0.1,)))
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        collate([uneven], torch.zeros(1), [0])


def test_token_budget_micro_batches_group_rows_of_similar_length_within_the_budget():
    from trainer.batch import plan_micro_batches

    lengths = [30, 5, 12, 6, 29, 100, 7]
    plan = plan_micro_batches(lengths, max_seqs=8, max_tokens=40)
    assert sorted(r for rows in plan for r in rows) == list(range(7))  # every row once
    assert plan == [[1, 3, 6], [2], [4], [0], [5]]  # 3 x 7 <= 40; 4 x 12 > 40; 100 alone, over budget
    for rows in plan[:-1]:
        assert len(rows) * max(lengths[r] for r in rows) <= 40
    assert plan_micro_batches(lengths, max_seqs=2, max_tokens=1000) == [[1, 3], [6, 2], [4, 0], [5]]
    assert plan_micro_batches(lengths, max_seqs=3) == [[0, 1, 2], [3, 4, 5], [6]]  # no budget: in order
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_micro_batches(lengths, 2, -1)
    with pytest.raises(ValueError, match="micro-batch size"):
        plan_micro_batches(lengths, 0)


def test_token_budget_micro_batches_pad_less_than_row_count_ones():
    rollouts = [_rollout([1, 2], [5] * n, index=i) for i, n in enumerate([40, 3, 38, 2, 41, 4])]
    adv = torch.zeros(6)
    padded = {
        name: sum(mb.input_ids.numel() for mb in mbs)
        for name, mbs in (("rows", micro_batches(rollouts, adv, 2)), ("tokens", micro_batches(rollouts, adv, 8, 90)))
    }
    assert padded["tokens"] < padded["rows"]
    assert padded["tokens"] == 3 * 6 + 2 * 42 + 43  # [3, 2, 4] | [40, 38] | [41]
