"""Checkpoints: model, optimizer and run state round-trip; newest K kept; a damaged newest one is skipped."""

import shutil
from pathlib import Path

import pytest
import torch

from services.trainer.checkpoint import CheckpointError, CheckpointManager, CheckpointPacing, TrainState
from trainer.model_io import load_model

TINY = Path(__file__).resolve().parents[3] / "models" / "tiny"


def _trained_step(model, optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _fresh():
    model = load_model(TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _state(step: int) -> TrainState:
    return TrainState(
        run_id="abcd",
        step=step,
        policy_version=step + 1,
        feeder={"position": 10 * step, "rng": [3, [1, 2], None]},
        history=[[f"g{s}-a", f"g{s}-b"] for s in range(step)],
        dropped=["late"],
    )


def test_round_trip_of_model_optimizer_and_state(tmp_path):
    model, opt = _fresh()
    _trained_step(model, opt, 0)
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(model, opt, _state(1))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()

    model2, opt2 = _fresh()
    state = CheckpointManager(tmp_path, keep=2).load_latest(model2, opt2)
    assert state == _state(1)
    assert state.finished == {"g0-a": "trained", "g0-b": "trained", "late": "dropped"}
    assert all(torch.equal(expected[k], v) for k, v in model2.state_dict().items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], moments)
    # Both continue identically from here: the optimizer state is whole, not just the weights.
    _trained_step(model, opt, 1)
    _trained_step(model2, opt2, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))


def test_only_the_newest_are_kept_and_a_damaged_newest_is_skipped(tmp_path):
    model, opt = _fresh()
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _trained_step(model, opt, step)
        manager.save(model, opt, _state(step))
        if step == 2:
            at_two = {k: v.clone() for k, v in model.state_dict().items()}
    assert [p.name for p in manager.checkpoints()] == ["step-000000002", "step-000000003"]
    assert manager.oldest_state().step == 2
    newest = manager.checkpoints()[-1]
    for shard in (newest / "state").glob("*.distcp"):
        shard.write_bytes(b"garbage")
    model2, opt2 = _fresh()
    state = manager.load_latest(model2, opt2)
    assert state.step == 2
    assert all(torch.equal(at_two[k], v) for k, v in model2.state_dict().items())


def test_unfinished_checkpoints_are_invisible_and_removed(tmp_path):
    model, opt = _fresh()
    manager = CheckpointManager(tmp_path, keep=3)
    done = manager.save(model, opt, _state(1))
    shutil.copytree(done, tmp_path / ".tmp-step-000000002-deadbeef")  # a crash before the rename
    (tmp_path / "step-000000003").mkdir()  # no meta, no state: not a checkpoint
    assert [p.name for p in manager.checkpoints()] == ["step-000000001"]
    CheckpointManager(tmp_path, keep=3)  # a reader leaves a checkpoint being written alone
    assert (tmp_path / ".tmp-step-000000002-deadbeef").exists()
    manager.remove_unfinished()  # the writer, at its start, clears what a crash left
    assert not (tmp_path / ".tmp-step-000000002-deadbeef").exists()
    assert CheckpointManager(tmp_path, keep=3).load_latest(*_fresh()).step == 1


def test_checkpoints_that_none_loads_stop_the_start(tmp_path):
    model, opt = _fresh()
    manager = CheckpointManager(tmp_path, keep=2)
    manager.save(model, opt, _state(1))
    for shard in (manager.checkpoints()[0] / "state").glob("*.distcp"):
        shard.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no checkpoint under .* loads"):
        manager.load_latest(*_fresh())


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert CheckpointManager(tmp_path, keep=1).load_latest(*_fresh()) is None
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


def test_a_damaged_checkpoint_skipped_at_resume_is_set_aside_so_its_step_saves_again(tmp_path):
    model, opt = _fresh()
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        _trained_step(model, opt, step)
        manager.save(model, opt, _state(step))
    damaged = manager.checkpoints()[-1]
    (damaged / "meta.json").write_text("{torn")
    model2, opt2 = _fresh()
    assert manager.load_latest(model2, opt2).step == 2
    assert [p.name for p in manager.checkpoints()] == ["step-000000002"]
    kept_aside = [p for p in tmp_path.iterdir() if p.name.startswith("damaged-step-000000003")]
    assert len(kept_aside) == 1 and (kept_aside[0] / "meta.json").read_text() == "{torn"  # kept to look at
    # The resumed run trains step 3 again: its checkpoint is written, not taken as saved already.
    retrained = _state(3)
    retrained.history[-1] = ["g2-other"]
    manager.save(model2, opt2, retrained)
    assert manager.read_state(manager.checkpoints()[-1]) == retrained
    assert manager.oldest_state().step == 2


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_fixed_interval_checkpoints_every_nth_step_whatever_the_time():
    pacing = CheckpointPacing(every=3, max_overhead=0.05, max_interval_s=1.0, clock=_Clock())
    assert [s for s in range(1, 10) if pacing.due(s)] == [3, 6, 9]


def test_paced_checkpoints_keep_their_share_of_the_time_and_the_unsaved_interval_bounded():
    """every = 0: the first step checkpoints; then one is due once 19x its duration has passed (5%), or the cap."""
    clock = _Clock()
    pacing = CheckpointPacing(every=0, max_overhead=0.05, max_interval_s=1000.0, clock=clock)
    assert pacing.due(1)
    started = clock.now
    clock.now += 10.0  # the checkpoint took 10 s: the next is due 190 s after it ended
    pacing.taken(started)
    clock.now += 189.0
    assert not pacing.due(2)
    clock.now += 1.0
    assert pacing.due(3)
    started = clock.now
    clock.now += 100.0  # a 100 s checkpoint would wait 1,900 s; the cap says 1,000
    pacing.taken(started)
    clock.now += 999.0
    assert not pacing.due(4)
    clock.now += 1.0
    assert pacing.due(5)


def test_a_cheap_checkpoint_is_due_after_nearly_every_step():
    clock = _Clock()
    pacing = CheckpointPacing(every=0, max_overhead=0.05, max_interval_s=1800.0, clock=clock)
    pacing.taken(clock.now - 0.05)  # 50 ms: due 0.95 s later
    clock.now += 1.0  # one step of a tiny model
    assert pacing.due(2)
