"""Checkpoint files: round trip, atomic save, pruning, resume resolution, RNG capture."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
from engine_testkit import RegressionStep, regression_batches, tiny_mlp
from safetensors.torch import save_file

import dreamstep.engine.disk as disk
from dreamstep import DynamicLossScaler
from dreamstep.engine.checkpoint import (
    TrainingPosition,
    capture_rng_state,
    check_weights_file,
    checkpoint_bytes,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_resume,
    restore_rng_state,
    save_checkpoint,
)
from dreamstep.engine.disk import DiskFullError
from dreamstep.errors import UserError


def _trained_step(seed: int = 0, steps: int = 2) -> RegressionStep:
    model = tiny_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = RegressionStep(model, opt, sched, loss_scaler=DynamicLossScaler(8.0, 2, 1))
    for batch in regression_batches(steps, batch_size=2):
        step(*batch)
    return step


def _save(tmp_path, step, global_step, **kwargs):
    position = TrainingPosition(global_step=global_step, epoch=1, batch_in_epoch=3,
                                epoch_start_rng=capture_rng_state())
    return save_checkpoint(tmp_path, step, position, step.model.state_dict(), **kwargs)


def test_round_trip_restores_everything(tmp_path):
    step = _trained_step()
    path = _save(tmp_path, step, 2, extra={"config": {"rank": 4}})
    assert path == tmp_path / "checkpoint-2"
    assert sorted(p.name for p in path.iterdir()) == ["lr_scheduler.pt", "optimizer.pt", "random_states.pt",
                                                      "trainable_weights.safetensors", "trainer_state.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]  # no temporary folder left

    fresh = _trained_step(seed=5, steps=0)
    loaded = load_checkpoint(path, fresh)
    fresh.model.load_state_dict(loaded.weights)
    for p, q in zip(step.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p, q)
    saved_state, new_state = step.optimizer.state_dict(), fresh.optimizer.state_dict()
    for index, entry in saved_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, new_state["state"][index][key])
    assert fresh.optimizer.param_groups[0]["lr"] == step.optimizer.param_groups[0]["lr"] == 2.5e-3
    assert fresh.lr_scheduler.state_dict() == step.lr_scheduler.state_dict()
    assert fresh.state_dict() == step.state_dict() and fresh.loss_scale == 32.0
    assert (loaded.position.global_step, loaded.position.epoch, loaded.position.batch_in_epoch) == (2, 1, 3)
    assert loaded.extra == {"config": {"rank": 4}}
    assert loaded.rng_state is not None and loaded.position.epoch_start_rng is not None


def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    step = _trained_step()
    _save(tmp_path, step, 2)
    with pytest.raises(TypeError):  # extra that JSON cannot hold: the save dies after writing tensors
        _save(tmp_path, step, 3, extra={"bad": object()})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    latest = resolve_resume(tmp_path, "latest")
    assert latest == tmp_path / "checkpoint-2"
    load_checkpoint(latest, _trained_step(steps=0))
    _save(tmp_path, step, 3)  # the next save clears the leftover temporary folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    step = _trained_step()
    _save(tmp_path, step, 2, extra={"run": 1})
    _save(tmp_path, step, 2, extra={"run": 2})
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["extra"] == {"run": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]


def test_total_limit_keeps_the_newest(tmp_path):
    step = _trained_step()
    for global_step in (5, 10, 15, 20):
        _save(tmp_path, step, global_step, total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-15", "checkpoint-20"]
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["checkpoint-15"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-20"]


def test_resolve_resume(tmp_path):
    assert resolve_resume(tmp_path, None) is None
    assert resolve_resume(tmp_path, "latest") is None  # nothing yet: start fresh
    step = _trained_step()
    for global_step in (9, 10):
        _save(tmp_path, step, global_step)
    assert resolve_resume(tmp_path, "latest") == tmp_path / "checkpoint-10"  # numeric, not text, order
    assert resolve_resume(tmp_path, "checkpoint-9") == tmp_path / "checkpoint-9"
    assert resolve_resume("elsewhere", str(tmp_path / "checkpoint-9")) == tmp_path / "checkpoint-9"
    with pytest.raises(UserError, match="--resume_from_checkpoint: 'checkpoint-7' not found .*checkpoint-9, "
                                        "checkpoint-10"):
        resolve_resume(tmp_path, "checkpoint-7")


def test_incomplete_or_mismatched_checkpoint_is_a_user_error(tmp_path):
    step = _trained_step()
    path = _save(tmp_path, step, 2)
    (path / "optimizer.pt").unlink()
    with pytest.raises(UserError, match="optimizer.pt: missing from the checkpoint"):
        load_checkpoint(path, _trained_step(steps=0))
    path = _save(tmp_path, step, 3)
    model = tiny_mlp()
    unscaled = RegressionStep(model, torch.optim.AdamW(model.parameters()),
                              torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(model.parameters()), 1))
    with pytest.raises(UserError, match="TrainStep state does not match this run"):
        load_checkpoint(path, unscaled)


def test_rng_state_round_trip():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3), np.random.randn())
    assert first[0] == again[0] and first[1] == again[1] and torch.equal(first[2], again[2])
    assert first[3] == again[3]


def _tree_size(folder):
    return sum(p.stat().st_size for p in folder.iterdir())


def test_the_free_space_check_allows_a_save_that_fits_and_refuses_one_byte_less(tmp_path, monkeypatch):
    """The estimate is at least what the checkpoint takes (so a save it allows fits) and not far above it
    (so a nearly full disk is not refused a save that fits): the headroom is proportional."""
    step = _trained_step()
    history = {"loss_history": [[i, 0.5] for i in range(500)], "config": "rank = 4\n" * 50}
    first = _save(tmp_path / "measure", step, 1, extra=history)
    written = _tree_size(first)
    needed = checkpoint_bytes(step.optimizer.state_dict(), step.model.state_dict(), history)
    assert written <= needed <= 1.5 * written + 2**17
    line = needed + disk.headroom(needed)
    assert line <= 1.5 * needed + 2**18

    monkeypatch.setattr(disk, "free_bytes", lambda path: line)
    assert _save(tmp_path / "fits", step, 1, extra=history).is_dir()
    monkeypatch.setattr(disk, "free_bytes", lambda path: line - 1)
    with pytest.raises(DiskFullError, match=r"^the disk is full: checkpoint-1 needs about"):
        _save(tmp_path / "full", step, 1, extra=history)
    assert not list((tmp_path / "full").glob("*checkpoint-1*"))


def test_a_safetensors_header_length_starting_with_the_pickle_byte_is_still_safetensors(tmp_path):
    """The first byte of a safetensors file is the low byte of its header length: 0x80 there is no pickle."""
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    file = folder / "trainable_weights.safetensors"
    for padding in range(256):
        save_file({"w": torch.zeros(2)}, str(file), metadata={"pad": "x" * padding})
        if file.read_bytes()[:1] == b"\x80":
            break
    assert file.read_bytes()[:1] == b"\x80"
    check_weights_file(folder)
    file.write_bytes(pickle.dumps({"w": 1}, protocol=2))
    with pytest.raises(UserError, match="a torch pickle, not the safetensors file a checkpoint holds"):
        check_weights_file(folder)
