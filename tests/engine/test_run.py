"""The engine's run around the loop (start_run, fit, finish) on a tiny real model: run_status.json, damaged
checkpoints named and skipped over with `latest`, and the share of non-finite steps a run may skip."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from engine_testkit import RegressionStep, flat_params, regression_batches, tiny_mlp
from PIL import Image

from dreamstep.engine import checkpoint
from dreamstep.engine.checkpoint import DamagedCheckpointError, TrainingPosition, load_checkpoint, save_checkpoint
from dreamstep.engine.fit import RunHooks, finish, fit
from dreamstep.engine.loop import Every, NonFiniteLossError
from dreamstep.engine.run import claim_output_dir, start_run
from dreamstep.engine.run_folder import LOCK_FILE, read_status
from dreamstep.errors import UserError

STEPS = 8


def _train(folder: Path, *, steps: int = STEPS, nan_at: tuple[int, ...] = (), resume: str | None = None,
           checkpointing_steps: int = 0, **fit_options) -> torch.Tensor:
    """Train the tiny MLP one batch per step (SGD, so a resumed run must match exactly); return its weights."""
    run = start_run(folder, mixed_precision="no", seed=0, report_to="none", resume_from_checkpoint=resume,
                    config_toml="", command="dreamstep train test")
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05))
    batches = regression_batches(STEPS, batch_size=2)
    for index in nan_at:  # a NaN target makes that step's loss (and gradients) NaN
        batches[index - 1][1][0, 0] = float("nan")
    result = fit(run, step, batches, total_steps=steps, trained=model,
                 hooks=RunHooks(checkpoint_every=Every(checkpointing_steps or None)), **fit_options)
    finish(run, {}, result)
    return flat_params(model)


def test_run_status_follows_the_run_and_the_lock_goes_with_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    weights = _train(out, checkpointing_steps=4)
    status = read_status(out)
    assert status["state"] == "finished" and status["step"] == status["total_steps"] == STEPS
    assert status["checkpoint"] == "checkpoint-8" and status["loss"] > 0 and status["message"] is None
    assert not (out / LOCK_FILE).exists()
    assert torch.isfinite(weights).all()


@pytest.mark.parametrize("nan_at", [(3,), (2, 7)])
def test_skipped_steps_within_the_allowed_share_are_reported(nan_at: tuple[int, ...], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    weights = _train(tmp_path / "out", nan_at=nan_at, on_nonfinite_loss="skip", max_skipped_steps_fraction=0.25)
    assert torch.isfinite(weights).all()
    steps = ", ".join(map(str, nan_at))
    assert (f"note: {len(nan_at)} of {STEPS} steps were skipped because the loss was not finite (steps {steps})"
            in capsys.readouterr().out)
    assert read_status(tmp_path / "out")["state"] == "finished"


@pytest.mark.parametrize("nan_at, fraction", [((2, 4, 6), 0.25), ((1,), 0.0), (tuple(range(1, 9)), 0.5)])
def test_more_skipped_steps_than_allowed_stop_the_run(nan_at: tuple[int, ...], fraction: float,
                                                      tmp_path: Path) -> None:
    allowed = int(fraction * STEPS)
    with pytest.raises(NonFiniteLossError, match=rf"^{allowed + 1} of the {STEPS} steps had a non-finite loss "
                                                 rf".*more than --max_skipped_steps_fraction {fraction:g} allows"):
        _train(tmp_path / "out", nan_at=nan_at, on_nonfinite_loss="skip", max_skipped_steps_fraction=fraction)
    status = read_status(tmp_path / "out")
    assert status["state"] == "failed" and "non-finite" in status["message"]
    assert status["step"] == nan_at[allowed] - 1  # stopped at the first step over the limit
    assert not (tmp_path / "out" / LOCK_FILE).exists()


def _saved_step(folder: Path) -> RegressionStep:
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    step = RegressionStep(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    step(*regression_batches(1, batch_size=2)[0])
    save_checkpoint(folder, step, TrainingPosition(global_step=1), model.state_dict())
    return step


@pytest.mark.parametrize("name", ["trainable_weights.safetensors", "optimizer.pt", "lr_scheduler.pt",
                                  "random_states.pt", "trainer_state.json"])
def test_a_truncated_file_is_named_and_nothing_is_restored(name: str, tmp_path: Path) -> None:
    _saved_step(tmp_path)
    file = tmp_path / "checkpoint-1" / name
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    optimizer = torch.optim.AdamW(tiny_mlp(1).parameters())
    fresh = RegressionStep(tiny_mlp(1), optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    with pytest.raises(DamagedCheckpointError, match=rf"^{file}: unreadable, the file is damaged or truncated"):
        load_checkpoint(tmp_path / "checkpoint-1", fresh)
    assert fresh.optimizer.state_dict()["state"] == {}


def test_latest_falls_back_to_the_newest_checkpoint_that_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    straight = _train(tmp_path / "straight", steps=6)
    out = tmp_path / "out"
    _train(out, steps=4, checkpointing_steps=2)
    damaged = out / "checkpoint-4" / "optimizer.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    capsys.readouterr()
    with pytest.raises(UserError, match=rf"^{damaged}: unreadable"):  # a checkpoint asked for by name
        _train(out, steps=6, resume="checkpoint-4")
    resumed = _train(out, steps=6, resume="latest", checkpointing_steps=2)
    err = capsys.readouterr().out
    assert f"warning: {damaged}: unreadable" in err
    assert "checkpoint-4 cannot be read; resuming from checkpoint-2, the newest checkpoint that loads" in err
    torch.testing.assert_close(resumed, straight, atol=0, rtol=0)
    # The resumed run saved step 4 again, over the damaged checkpoint.
    model = tiny_mlp()
    load_checkpoint(out / "checkpoint-4", RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05)))


@pytest.mark.parametrize("request_", ["checkpoint-4", "latest"])
def test_a_resume_reads_its_checkpoint_once_before_it_loads_it(request_: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """claim_output_dir checks the checkpoint it will resume; start_run takes its answer instead of reading the
    files again, and the resume is still exact."""
    straight = _train(tmp_path / "straight", steps=6)
    out = tmp_path / "out"
    _train(out, steps=4, checkpointing_steps=4)
    checked = []
    check_readable = checkpoint.check_readable
    monkeypatch.setattr(checkpoint, "check_readable", lambda path: checked.append(path.name) or check_readable(path))
    claim_output_dir(out, overwrite=False, resume_from_checkpoint=request_)
    resumed = _train(out, steps=6, resume=request_)
    assert checked == ["checkpoint-4"]
    torch.testing.assert_close(resumed, straight, atol=0, rtol=0)


class _RunsCode:
    """Unpickles as a call to print: a stand-in for a pickle that runs code."""

    def __reduce__(self):
        return print, ("PICKLED CODE RAN",)


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_that_finds_no_readable_checkpoint_leaves_the_finished_run_as_it_was(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    _train(out, steps=6, checkpointing_steps=2)
    with_code = out / "checkpoint-6" / "optimizer.pt"
    with_code.write_bytes(pickle.dumps(_RunsCode(), protocol=2))
    truncated = out / "checkpoint-4" / "trainable_weights.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    (out / "checkpoint-2" / "random_states.pt").write_bytes(b"PK\x03\x04 not a zip")
    before = _folder_bytes(out)
    capsys.readouterr()
    with pytest.raises(UserError, match=r"^--resume_from_checkpoint latest: no checkpoint in .* can be read .*"
                                        r"nothing was changed; start a new run in a new --output_dir$") as error:
        _train(out, steps=8, resume="latest")
    assert (f"{with_code}: a pickle holding objects other than tensors, which may run code, so it was not loaded "
            "(nothing in it ran)") in str(error.value)
    assert f"{truncated}: unreadable, the file is damaged or truncated" in str(error.value)
    assert "PICKLED CODE RAN" not in capsys.readouterr().out
    assert _folder_bytes(out) == before
    assert read_status(out)["state"] == "finished"


def test_a_resume_that_fails_while_loading_puts_the_status_back(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _train(out, steps=4, checkpointing_steps=2)
    before = _folder_bytes(out)
    run = start_run(out, mixed_precision="no", seed=0, report_to="none", resume_from_checkpoint="latest",
                    config_toml="", command="dreamstep train test")
    assert read_status(out)["state"] == "running"
    run.close("failed", "the model could not be loaded")
    assert _folder_bytes(out) == before


def test_scores_come_back_through_their_own_hook_on_their_own_cadence(tmp_path: Path) -> None:
    """Samples every 2 steps, scores every 4 (and at step 0 and the end); each scoring sees the images sampled
    at its step, if any; the scores land in metrics.csv."""
    run = start_run(tmp_path / "out", mixed_precision="no", seed=0, report_to="none", resume_from_checkpoint=None,
                    config_toml="", command="dreamstep train test")
    model = tiny_mlp()
    step = RegressionStep(model, torch.optim.SGD(model.parameters(), lr=0.05))
    sampled, scored = [], []

    def sample(global_step: int) -> list:
        sampled.append(global_step)
        return [Image.new("RGB", (8, 8))]

    def score(global_step: int, images: list) -> dict[str, float]:
        scored.append((global_step, len(images)))
        return {"val_loss": float(global_step)}

    hooks = RunHooks(sample=sample, score=score, sample_every=Every(2), score_every=Every(4), sample_first=True,
                     sample_final=lambda global_step: [])
    result = fit(run, step, regression_batches(STEPS, batch_size=2), total_steps=7, trained=model, hooks=hooks)
    finished = finish(run, {}, result, hooks, best_by="val_loss")
    assert sampled == [0, 2, 4, 6]
    assert scored == [(0, 1), (4, 1), (7, 0)]  # the final point: sample_final gave no images
    assert run.logger.metrics.rows == {0: {"val_loss": 0.0}, 4: {"val_loss": 4.0}, 7: {"val_loss": 7.0}}
    assert finished.written["metrics table"].read_text().splitlines()[1:] == ["0,0", "4,4", "7,7"]
