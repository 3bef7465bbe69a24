"""The trainer's source plan: a tree under the trainer, bounded children, failed sources dropped, no cycles."""

import pytest

from services.trainer.policy_sources import TRAINER, SourcePlanner


def _relay(i):
    return f"10.0.0.{i}:7000"


def test_the_first_callers_get_the_trainer_then_peers_fill_a_tree_breadth_first():
    plan = SourcePlanner(trainer_fanout=2, peer_fanout=2)
    got = {f"g{i}": plan.assign(f"g{i}", 5, _relay(i), [])[0] for i in range(8)}
    assert got["g0"] == got["g1"] == TRAINER
    assert [got[f"g{i}"] for i in range(2, 8)] == [_relay(0), _relay(0), _relay(1), _relay(1), _relay(2), _relay(2)]
    assert list(plan.assign("g9", 5, _relay(9), [])) == [_relay(3), TRAINER]  # always ends with the trainer


def test_a_generator_that_does_not_relay_is_nobodys_source():
    plan = SourcePlanner(trainer_fanout=1, peer_fanout=4)
    assert plan.assign("quiet", 1, "", []) == [TRAINER]
    assert plan.assign("next", 1, _relay(1), []) == [TRAINER]  # no peer to name: the trainer, over its fanout


def test_a_failed_source_is_dropped_and_a_retry_gets_only_holders_or_the_trainer():
    plan = SourcePlanner(trainer_fanout=1, peer_fanout=4)
    plan.assign("root", 3, _relay(0), [])
    assert plan.assign("a", 3, _relay(1), [])[0] == _relay(0)
    assert plan.assign("b", 3, _relay(2), [])[0] == _relay(0)
    # a's parent died: a may not be sent to b (still fetching, perhaps from a itself), only to a holder.
    assert plan.assign("a", 3, _relay(1), [_relay(0)]) == [TRAINER]
    plan.report("c", 3, _relay(3))
    assert plan.assign("b", 3, _relay(2), [_relay(0)])[0] == _relay(3)
    assert plan.assign("d", 3, _relay(4), [])[0] != _relay(0)  # dropped for everyone


def test_plans_of_old_versions_are_forgotten():
    plan = SourcePlanner(keep=2)
    for v in range(1, 6):
        plan.assign("g", v, "", [])
    assert plan.sources_of(1) == {} and plan.sources_of(5) == {"g": TRAINER}


def test_fanouts_below_one_are_refused():
    with pytest.raises(ValueError, match="fanout"):
        SourcePlanner(trainer_fanout=0)
