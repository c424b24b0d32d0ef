"""Worker for test_multiprocess_ddp.py, run by `accelerate launch --multi_gpu --num_processes 2` on a machine
without GPUs: ``Accelerator(cpu=True)`` then trains with DDP over gloo.

Each process trains on its half of every batch through run_training (accumulation 2, 5 micro-batches per
epoch, 2 epochs, a checkpoint every 3 steps). A counting DDP comm hook records how many gradient all-reduces
each micro-batch's backward triggered. The main process writes the results to ``sys.argv[1]``; checkpoints
go to ``sys.argv[2]``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from engine_testkit import RegressionStep, regression_batches, tiny_mlp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dreamstep import DynamicLossScaler
from dreamstep.engine.checkpoint import save_checkpoint
from dreamstep.engine.loop import Every, Hook, run_training
from dreamstep.engine.process_group import leave_process_group
from dreamstep.engine.train_step import make_accelerator

ALLREDUCE_CALLS = [0]
RECORD: list[tuple[bool, int]] = []  # per micro-batch: (closes its group, all-reduces before it)


def counting_allreduce(group, bucket):
    ALLREDUCE_CALLS[0] += 1
    return default_hooks.allreduce_hook(group, bucket)


class RecordingStep(RegressionStep):
    """Records, before each micro-batch, whether it closes a group and the all-reduces so far."""

    def forward(self, x, y):
        RECORD.append((self.at_group_end, ALLREDUCE_CALLS[0]))
        return super().forward(x, y)


def main(out_file: str, checkpoint_dir: str) -> None:
    # fp16 on a CPU: accelerate does no autocast and no GradScaler; TrainStep must pick its dynamic scaler
    accelerator = make_accelerator(cpu=True, mixed_precision="fp16")
    rank, world = accelerator.process_index, accelerator.num_processes
    model = tiny_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.register_comm_hook(dist.group.WORLD, counting_allreduce)
    torch.manual_seed(100 + rank)  # distinct RNG per process, to check that each one's state is saved

    full = regression_batches(5, batch_size=4)  # identical on both processes; each takes its rows
    shard = [(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]) for x, y in full]
    step = RecordingStep(model, optimizer, scheduler, gradient_accumulation_steps=2, length_of_dataloader=5,
                         accelerator=accelerator)
    assert isinstance(step.loss_scaler, DynamicLossScaler)
    def save(position):
        return save_checkpoint(checkpoint_dir, step, position, accelerator.unwrap_model(model).state_dict(),
                               total_limit=1)

    result = run_training(step, shard, num_epochs=2, hooks=[Hook(Every(steps=3), save)])
    RECORD.append((False, ALLREDUCE_CALLS[0]))

    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    everyone = accelerator.gather(torch.cat([p.reshape(-1) for p in params])[None])  # (world, n_params)
    if accelerator.is_main_process:
        torch.save({"params": params, "losses": result.losses, "record": RECORD, "world": world,
                    "rank_spread": (everyone - everyone[0]).abs().max().item(),
                    "loss_scale": step.loss_scale}, out_file)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    leave_process_group()  # main's models are out of scope: the group goes before the interpreter's exit
