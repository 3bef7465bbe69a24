"""The long model's curriculum: every stage is the long task (same countdown), its batches mark exactly the
looked-up names, and the build's extra loss on them is what lets lookup form under the countdown's tokens."""

import dataclasses

from offline.curriculum import Curriculum, stage_tasks
from offline.model_build import BuildConfig, qwen3_config
from sparrow.tasks.chain import LONG_FILLER, LONG_HOPS
from sparrow.tasks.vocab import NAMES, PAD, VOCAB


def test_long_stages_keep_the_countdown_and_end_at_the_full_length():
    cfg = BuildConfig.for_size("long")
    tasks = stage_tasks(cfg.curriculum)
    assert {t.filler for t in tasks} == {LONG_FILLER}
    assert (tasks[0].pairs, tasks[0].max_hops) == (4, 2)
    assert (tasks[-1].pairs, tasks[-1].max_hops) == (64, LONG_HOPS)
    model = qwen3_config("long")
    assert tasks[-1].sequence_tokens() <= model.max_position_embeddings
    assert model.num_hidden_layers >= 8 and model.rope_parameters["rope_theta"] >= 1e6
    assert cfg.lookup_weight > 0 and BuildConfig.for_size("small").lookup_weight == 0


def test_long_batches_mark_each_hops_looked_up_name_and_nothing_else():
    cur = Curriculum(BuildConfig.for_size("long").curriculum, seed=3)
    cur.stage = 6
    batch = cur.next_batch()
    task = cur.tasks[6]
    for row, mask, loss in zip(batch.input_ids, batch.lookup_mask, batch.loss_mask, strict=True):
        words = [VOCAB[int(t)] for t in row]
        marked = [i for i in range(len(words)) if mask[i]]
        start = int(loss.nonzero()[0])
        hops = int(words[start])  # the first hop's counter is the hop count
        assert marked == [start + off for off in task.lookup_offsets(hops)]
        assert all(words[i] in NAMES and words[i - 2] == str(hops - j) for j, i in enumerate(marked))
        assert words[marked[0] + 1 : marked[0] + 1 + LONG_FILLER] == [str(n) for n in range(LONG_FILLER, 0, -1)]


def test_head_batches_are_the_first_tokens_of_full_examples_and_leave_the_stage_accuracy_alone():
    cfg = dataclasses.replace(BuildConfig.for_size("long").curriculum, head_share=0.5, head_tokens=300)
    cur = Curriculum(cfg, seed=4, start_at_last=True)
    batches = [cur.next_batch() for _ in range(40)]
    heads = [b for b in batches if b.head]
    assert 10 <= len(heads) <= 30  # about half of 40
    task = cur.tasks[-1]
    for batch in heads:
        assert batch.input_ids.shape == (cfg.batch_tokens // 300, 300)
        for row, mask, loss in zip(batch.input_ids, batch.lookup_mask, batch.loss_mask, strict=True):
            words = [VOCAB[int(t)] for t in row if VOCAB[int(t)] != PAD]
            start = int(loss.nonzero()[0])
            hops = int(words[start])
            assert words[start - 2] == str(hops)  # the query's count, copied by the first solution token
            # the whole example, cut: the loss covers the solution up to the cut, lookups only inside it
            assert int(loss.sum()) == len(words) - start
            assert [int(i) for i in mask.nonzero()] == [start + off for off in task.lookup_offsets(hops)
                                                        if start + off < len(words)]  # fmt: skip
    ema = cur.ema
    assert not cur.update(0, heads[0], 0.0) and cur.ema == ema
    full = next(b for b in batches if not b.head)
    assert full.input_ids.shape[1] == max(int(m.nonzero()[-1]) for m in full.loss_mask) + 1


def test_no_head_batches_by_default_or_before_the_last_stage():
    cur = Curriculum(BuildConfig.for_size("long").curriculum, seed=4, start_at_last=True)
    assert not any(cur.next_batch().head for _ in range(20))
    cfg = dataclasses.replace(BuildConfig.for_size("long").curriculum, head_share=0.9)
    cur = Curriculum(cfg, seed=4)
    cur.stage = 5
    assert not any(cur.next_batch().head for _ in range(20))
