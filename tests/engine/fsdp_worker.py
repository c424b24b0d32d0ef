"""Worker for test_multiprocess_fsdp.py, run by `accelerate launch --multi_gpu --num_processes N` on CPUs:
the tiny MLP trained through run_training with its state sharded by FSDP2 (each Linear one FSDP unit).

Usage: fsdp_worker.py OUT CHECKPOINT_DIR ZERO_STAGE PHASE, where PHASE is ``full`` (2 epochs straight),
``first`` (stop after 3 optimizer steps, with a checkpoint there) or ``resume`` (continue from that
checkpoint to the end). Each process trains on its share of every batch of 4 rows (accumulation 2,
5 micro-batches per epoch, clipping at 0.5, a static loss scale). The main process writes to OUT the final
full parameters, the losses, the reduce-scatters counted before each micro-batch and every process's bytes
of trainable state (weights, gradients, optimizer).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from engine_testkit import RegressionStep, regression_batches, tiny_mlp

from dreamstep import StaticLossScaler
from dreamstep.engine.checkpoint import load_checkpoint, save_checkpoint
from dreamstep.engine.loop import Every, Hook, run_training
from dreamstep.engine.process_group import leave_process_group
from dreamstep.engine.sharding import full_model_state, load_model_state, local_state_bytes, shard_model
from dreamstep.engine.train_step import make_accelerator

REDUCE_SCATTERS = [0]
RECORD: list[tuple[bool, int]] = []  # per micro-batch: (closes its group, reduce-scatters before it)
_reduce_scatter = dist.reduce_scatter_single


def counting_reduce_scatter(*args, **kwargs):
    REDUCE_SCATTERS[0] += 1
    return _reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = counting_reduce_scatter


class RecordingStep(RegressionStep):
    def forward(self, x, y):
        RECORD.append((self.at_group_end, REDUCE_SCATTERS[0]))
        return super().forward(x, y)


def main(out_file: str, checkpoint_dir: str, zero_stage: int, phase: str) -> None:
    accelerator = make_accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = shard_model(tiny_mlp(), zero_stage, ["Linear"], accelerator.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    rows = 4 // world
    shard = [(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
             for x, y in regression_batches(5, batch_size=4)]
    step = RecordingStep(model, optimizer, scheduler, gradient_accumulation_steps=2, length_of_dataloader=5,
                         accelerator=accelerator, max_grad_norm=0.5, loss_scaler=StaticLossScaler(1024.0))
    resume = None
    if phase == "resume":
        resume = load_checkpoint(checkpoint_dir + "/checkpoint-3", step)
        load_model_state(model, resume.weights)
    def save(position):
        return save_checkpoint(checkpoint_dir, step, position, full_model_state(model))
    result = run_training(step, shard, max_train_steps=3 if phase == "first" else None,
                          num_epochs=None if phase == "first" else 2, resume=resume,
                          hooks=[Hook(Every(steps=3), save)])
    state_bytes = local_state_bytes(model, optimizer)
    everyone = [None] * world
    dist.all_gather_object(everyone, state_bytes) if world > 1 else everyone.__setitem__(0, state_bytes)
    params = full_model_state(model)
    if accelerator.is_main_process:
        torch.save({"params": params, "losses": result.losses, "record": RECORD, "world": world,
                    "state_bytes": everyone, "sharded": type(model).__name__}, out_file)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    leave_process_group()  # main's models are out of scope: the group goes before the interpreter's exit
