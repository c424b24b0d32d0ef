"""FSDP2 under `accelerate launch` (gloo, 2 CPU processes): sharded training equals one process with the
doubled batch, gradients are reduce-scattered only when a group closes, each process holds half the
trainable state, and sharded checkpoints resume exactly, at the same or another process count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_testkit import reference_train, regression_batches, tiny_mlp
from launch_testkit import accelerate_launch

WORKER = Path(__file__).with_name("fsdp_worker.py")


def _run(tmp_path: Path, name: str, zero_stage: int, phase: str, processes: int = 2) -> dict:
    out = tmp_path / f"{name}.pt"
    accelerate_launch(WORKER, out, tmp_path / "ckpt", zero_stage, phase, processes=processes, hf_home=tmp_path / "hf",
                      pythonpath=WORKER.parent, timeout=180)
    return torch.load(out, weights_only=False)


def _reference() -> tuple[torch.nn.Module, list[float]]:
    """One process, the whole batch of 4 rows, written out by hand (clipping as the worker's 0.5)."""
    full = regression_batches(5, batch_size=4)
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    losses = []
    for _ in range(2):
        losses += reference_train(model, optimizer, [full[0:2], full[2:4], full[4:5]], scheduler, max_grad_norm=0.5)
    return model, losses


def _assert_params_equal(params: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    expected = model.state_dict()
    assert params.keys() == expected.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def stage3(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fsdp"), "full", 3, "full")


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_sharded_training_equals_one_process_with_the_doubled_batch(zero_stage, stage3, tmp_path):
    result = stage3 if zero_stage == 3 else _run(tmp_path, "full", zero_stage, "full")
    assert result["world"] == 2 and result["sharded"].startswith("FSDP")
    model, losses = _reference()
    _assert_params_equal(result["params"], model)
    assert result["losses"] == pytest.approx(losses, abs=1e-10)


def test_no_reduce_scatter_on_micro_batches_that_do_not_close_a_group(stage3):
    record = stage3["record"]  # (closes its group, reduce-scatters so far), before each micro-batch and at the end
    for (closes, before), (_, after) in zip(record, record[1:]):
        if closes:
            assert after > before  # the counter sees FSDP's reduce-scatters
        else:
            assert after == before


def test_each_process_holds_half_of_the_trainable_state(stage3):
    # weights + AdamW's two moments, float64; gradients are freed after each step
    whole = 3 * sum(p.numel() for p in tiny_mlp().parameters()) * 8
    assert sum(stage3["state_bytes"]) == whole
    assert max(stage3["state_bytes"]) <= whole / 2


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A 2-process stage-3 run stopped after 3 of its 6 optimizer steps, with a checkpoint there."""
    tmp_path = tmp_path_factory.mktemp("fsdp-interrupted")
    _run(tmp_path, "first", 3, "first")
    return tmp_path


@pytest.mark.parametrize("resume_processes", [2, 1])
def test_sharded_checkpoint_resumes_exactly(resume_processes, stage3, interrupted):
    assert (interrupted / "ckpt" / "checkpoint-3" / "optimizer.pt").is_file()
    resumed = _run(interrupted, f"resumed-{resume_processes}", 3, "resume", processes=resume_processes)
    for name, value in stage3["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-10)
