"""The trajectory store: one trajectory per slot, durable across restarts, torn tails cut, damage refused."""

import threading

import pytest

from services.api.sparrow.v1 import rollout_pb2
from services.trainer.store import ACCEPTED, DUPLICATE, LOG_NAME, StoreError, TrajectoryStore


def _traj(tid: str, group: str = "g", index: int = 0, tokens=(5, 6)) -> rollout_pb2.Trajectory:
    return rollout_pb2.Trajectory(
        trajectory_id=tid, group_id=group, sample_index=index, prompt_token_ids=[1, 2], token_ids=list(tokens)
    )


def test_one_trajectory_per_id_and_per_slot(tmp_path):
    store = TrajectoryStore(tmp_path)
    assert store.add(_traj("a", index=0)) == ACCEPTED
    assert store.add(_traj("a", index=0)) == DUPLICATE  # a resend
    assert store.add(_traj("a", index=1)) == DUPLICATE  # same id, whatever it claims
    assert store.add(_traj("b", index=0, tokens=(9,))) == DUPLICATE  # a second sample for a filled slot
    assert store.add(_traj("c", index=1)) == ACCEPTED
    assert store.count("g") == 2 and [t.trajectory_id for t in store.samples("g")] == ["a", "c"]
    assert list(store.samples("g")[0].token_ids) == [5, 6]  # the first one is the one kept
    store.close()


def test_reopened_store_has_everything_acked(tmp_path):
    store = TrajectoryStore(tmp_path)
    for i in range(5):
        store.add(_traj(f"t{i}", group=f"g{i % 2}", index=i // 2))
    store.close()
    again = TrajectoryStore(tmp_path)
    assert again.group_ids() == {"g0", "g1"} and again.count("g0") == 3 and again.count("g1") == 2
    assert again.has_id("t4") and again.add(_traj("t4", group="g0", index=2)) == DUPLICATE
    again.close()


def test_a_torn_last_record_is_cut_and_the_store_goes_on(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.add(_traj("a", index=0))
    store.add(_traj("b", index=1))
    store.close()
    path = tmp_path / LOG_NAME
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # a crash in the middle of the second write
    again = TrajectoryStore(tmp_path)
    assert again.count("g") == 1 and not again.has_id("b")
    assert again.add(_traj("b", index=1)) == ACCEPTED  # the resend (its ack was never sent) is taken
    again.close()
    assert TrajectoryStore(tmp_path).count("g") == 2


def test_damage_before_the_end_refuses_to_start(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.add(_traj("a", index=0))
    store.add(_traj("b", index=1))
    store.close()
    path = tmp_path / LOG_NAME
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # inside the first record's body
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="damaged record at byte 0"):
        TrajectoryStore(tmp_path)


def test_compaction_keeps_only_what_is_asked_on_disk_and_in_memory(tmp_path):
    store = TrajectoryStore(tmp_path)
    for g in ("old", "new"):
        for i in range(2):
            store.add(_traj(f"{g}{i}", group=g, index=i))
    assert store.compact(lambda gid: gid != "old") == 2
    assert store.group_ids() == {"new"} and not store.has_id("old0")
    store.add(_traj("new2", group="new", index=2))  # appends still work after the rewrite
    store.close()
    again = TrajectoryStore(tmp_path)
    assert again.group_ids() == {"new"} and again.count("new") == 3
    again.close()


def test_concurrent_writers_fill_each_slot_exactly_once(tmp_path):
    store = TrajectoryStore(tmp_path)
    results: list[str] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        for i in range(10):  # every writer races for the same 10 slots under its own ids
            status = store.add(_traj(f"w{w}-{i}", index=i))
            with lock:
                results.append(status)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(ACCEPTED) == 10 and results.count(DUPLICATE) == 50
    store.close()
    assert TrajectoryStore(tmp_path).count("g") == 10


def test_a_damaged_length_before_the_end_refuses_to_start_rather_than_cut_what_follows(tmp_path):
    store = TrajectoryStore(tmp_path)
    for i in range(4):
        store.add(_traj(f"t{i}", index=i))
    store.close()
    path = tmp_path / LOG_NAME
    data = bytearray(path.read_bytes())
    second = 8 + int.from_bytes(data[0:4], "little")
    data[second + 2] ^= 0x40  # the second record's length now runs past the end of the file
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"damaged record at byte {second} .* after it"):
        TrajectoryStore(tmp_path)
    assert path.read_bytes() == bytes(data)  # nothing cut: the three records after it are still there
