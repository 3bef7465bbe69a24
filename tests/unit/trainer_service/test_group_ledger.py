"""The group ledger: enqueued groups and answers survive restarts; states; compaction; torn lines."""

import pytest

from services.trainer.ledger import (
    DEAD,
    DROPPED,
    LEDGER_NAME,
    OUTSTANDING,
    TAKEN,
    TRAINED,
    GroupLedger,
    GroupRecord,
    LedgerError,
)


def _rec(index: int, answer: str = "bob") -> GroupRecord:
    return GroupRecord(index, f"run-{index:08d}", (1, 5, 6), 4, answer, policy_version=3, max_new_tokens=16)


def test_groups_answers_and_queue_marks_survive_a_restart(tmp_path):
    ledger = GroupLedger(tmp_path)
    for i in range(3):
        ledger.add(_rec(i, answer=f"name{i}"))
    ledger.mark_queued("run-00000000")
    ledger.mark_queued("run-00000002")
    assert ledger.mark_dead("run-00000002", "too many retries")
    ledger.close()
    again = GroupLedger(tmp_path, finished={"run-00000000": TRAINED})  # the checkpoint says 0 was trained
    assert again.get("run-00000001").answer == "name1" and again.get("run-00000001").prompt_token_ids == (1, 5, 6)
    assert again.state("run-00000000") == TRAINED
    assert again.state("run-00000002") == DEAD and again.dead_reason("run-00000002") == "too many retries"
    assert [r.group_id for r in again.outstanding()] == ["run-00000001"]
    assert [r.group_id for r in again.unqueued()] == ["run-00000001"]  # never confirmed on the stream
    assert again.next_index == 3 and again.state("elsewhere") is None
    with pytest.raises(LedgerError, match="already in the ledger"):
        again.add(_rec(1))
    again.close()


def test_take_release_finish(tmp_path):
    ledger = GroupLedger(tmp_path)
    for i in range(3):
        ledger.add(_rec(i))
    ids = ["run-00000000", "run-00000001"]
    ledger.take(ids)
    assert ledger.state(ids[0]) == TAKEN and [r.index for r in ledger.outstanding()] == [2]
    assert not ledger.mark_dead(ids[0], "late")  # a group in a step is not dead-lettered under it
    ledger.release(ids)
    assert ledger.state(ids[1]) == OUTSTANDING
    ledger.take(ids)
    ledger.finish(ids[:1], TRAINED)
    ledger.finish(ids[1:], DROPPED)
    assert ledger.finished() == {ids[0]: TRAINED, ids[1]: DROPPED}
    with pytest.raises(ValueError, match="not taken"):
        ledger.release(ids)
    ledger.close()


def test_compaction_rewrites_only_kept_groups(tmp_path):
    ledger = GroupLedger(tmp_path)
    for i in range(4):
        ledger.add(_rec(i))
        ledger.mark_queued(f"run-{i:08d}")
    assert ledger.compact(lambda gid: gid >= "run-00000002") == 2
    ledger.add(_rec(4))
    ledger.close()
    again = GroupLedger(tmp_path)
    assert [r.index for r in again.outstanding()] == [2, 3, 4]
    assert [r.index for r in again.unqueued()] == [4] and again.get("run-00000000") is None
    again.close()


def test_a_torn_last_line_is_cut_and_damage_before_it_refused(tmp_path):
    ledger = GroupLedger(tmp_path)
    ledger.add(_rec(0))
    ledger.add(_rec(1))
    ledger.close()
    path = tmp_path / LEDGER_NAME
    whole = path.read_text()
    path.write_text(whole[:-10])
    again = GroupLedger(tmp_path)
    assert [r.index for r in again.outstanding()] == [0]
    again.close()
    path.write_text("{not json\n" + whole)
    with pytest.raises(LedgerError, match="damaged line at byte 0"):
        GroupLedger(tmp_path)


@pytest.mark.parametrize(
    "damaged",
    [
        '{"kind":"enqueued","group":{"index":0,"group_id":"run-00000000"}}',  # fields missing
        '{"kind":"enqueued"}',
        "[1, 2]",
        '"queued"',
        '{"kind":"enqueued","group":{"index":"zero","group_id":"g","prompt_token_ids":[1],"n":4,"answer":"a",'
        '"policy_version":1,"max_new_tokens":16}}',
    ],
)
def test_a_line_that_parses_but_is_no_entry_is_damage_in_one_line(tmp_path, damaged):
    ledger = GroupLedger(tmp_path)
    ledger.add(_rec(0))
    ledger.close()
    path = tmp_path / LEDGER_NAME
    whole = path.read_text()
    path.write_text(
        whole + damaged + "\n" + whole.replace("run-00000000", "run-00000001").replace('"index":0', '"index":1')
    )
    with pytest.raises(LedgerError, match=f"damaged entry at byte {len(whole)} "):
        GroupLedger(tmp_path)
