"""(e) Two processes under `accelerate launch` (gloo, CPU) equal one process with the doubled batch, and
non-boundary micro-batches trigger no gradient all-reduce."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from engine_testkit import reference_train, regression_batches, tiny_mlp
from launch_testkit import accelerate_launch

from dreamstep.engine.checkpoint import list_checkpoints

WORKER = Path(__file__).with_name("ddp_worker.py")


def _launch(tmp_path: Path) -> dict:
    out = tmp_path / "result.pt"
    accelerate_launch(WORKER, out, tmp_path / "ckpt", hf_home=tmp_path / "hf", timeout=180)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ddp")
    return tmp_path, _launch(tmp_path)


def test_two_processes_equal_one_process_with_the_doubled_batch(ddp_run):
    _, result = ddp_run
    assert result["world"] == 2 and result["rank_spread"] == 0.0
    full = regression_batches(5, batch_size=4)
    ref = tiny_mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    ref_losses = []
    for _ in range(2):
        ref_losses += reference_train(ref, opt, [full[0:2], full[2:4], full[4:5]], sched)
    for p, q in zip(result["params"], ref.parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), rtol=0, atol=1e-10)
    assert result["losses"] == pytest.approx(ref_losses, abs=1e-10)  # averaged over both processes
    assert result["loss_scale"] == 2.0**16  # fp16 default scaler, applied once


def test_no_allreduce_on_non_boundary_micro_batches(ddp_run):
    _, result = ddp_run
    record = result["record"]  # per micro-batch: (closes its group, all-reduces before it), then the total
    closes = [c for c, _ in record[:-1]]
    per_micro = [after - before for (_, before), (_, after) in itertools.pairwise(record)]
    assert closes == [False, True, False, True, True] * 2
    assert all(n == 0 for n, c in zip(per_micro, closes) if not c)
    assert all(n > 0 for n, c in zip(per_micro, closes) if c)


def test_main_process_writes_one_checkpoint_with_every_process_rng(ddp_run):
    tmp_path, _ = ddp_run
    checkpoints = list_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in checkpoints] == ["checkpoint-6"]  # total_limit=1 pruned checkpoint-3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint-6"]
    rng = torch.load(checkpoints[0] / "random_states.pt", weights_only=True)
    assert len(rng) == 2
    assert not torch.equal(rng[0]["current"]["torch"], rng[1]["current"]["torch"])
