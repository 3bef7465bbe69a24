"""The distributed helpers outside a process group: one rank, nothing to reduce; shares cover a batch once."""

from trainer import distributed
from trainer.rl_update import acceptance


def test_shares_of_every_rank_cover_the_batch_once():
    items = list(range(9))
    shares = [distributed.share(items, r, 4) for r in range(4)]
    assert shares == [[0, 4, 8], [1, 5], [2, 6], [3, 7]]
    assert sorted(i for s in shares for i in s) == items
    assert distributed.share(items[:2], 3, 4) == []  # a rank may get nothing from a small batch


def test_without_a_process_group_every_helper_is_the_identity():
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.share([5, 6, 7]) == [0, 1, 2]
    assert distributed.max_over_ranks(3) == 3 and distributed.sum_over_ranks([1.5, 2.0]) == [1.5, 2.0]
    assert distributed.gather_objects({"a": 1}) == [{"a": 1}] and distributed.broadcast_object(7) == 7
    assert distributed.gradient_scale() == 1.0


def test_an_empty_share_has_an_empty_acceptance():
    acc = acceptance([], [])
    assert acc.alpha.shape == acc.kv_lens.shape == (0,)
