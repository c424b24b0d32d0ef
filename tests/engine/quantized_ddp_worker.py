"""Worker for test_quantized_ddp.py, run by ``accelerate launch --multi_gpu --num_processes 2`` without GPUs (gloo):
for each base precision in ``sys.argv[2:]`` ("none", "int8", "fp8"), a small FLUX transformer with its linear
weights quantized as ``--base_quantization`` loads them and a LoRA on its attention goes through
``accelerator.prepare`` (DDP) and one optimizer step on this process's own batch. The main process writes each
mode's LoRA weights after the step, gathered from both processes, to ``sys.argv[1]``."""

from __future__ import annotations

import sys

import torch
from diffusers import FluxTransformer2DModel

from dreamstep.engine.process_group import leave_process_group
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze
from dreamstep.models.quantization import quantize_built_model


def lora_after_one_step(accelerator, mode: str) -> torch.Tensor:
    torch.manual_seed(0)  # the same base and LoRA on both processes
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).to(torch.bfloat16)
    freeze(model)
    quantize_built_model(model, mode)
    add_lora(model, flux_lora_targets(model, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    ddp, optimizer = accelerator.prepare(model, torch.optim.SGD(trained, lr=0.5))
    torch.manual_seed(1 + accelerator.process_index)  # each process its own batch
    out = ddp(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
              pooled_projections=torch.randn(1, 32), timestep=torch.rand(1), img_ids=torch.zeros(16, 3),
              txt_ids=torch.zeros(4, 3), return_dict=False)[0]
    accelerator.backward(out.float().pow(2).mean())
    optimizer.step()
    return accelerator.gather(torch.cat([p.detach().flatten() for p in trained])[None])


def main(out_file: str, modes: list[str]) -> None:
    accelerator = make_accelerator(cpu=True, mixed_precision="bf16")
    results = {mode: lora_after_one_step(accelerator, mode) for mode in modes}
    if accelerator.is_main_process:
        torch.save(results, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    leave_process_group()  # main's models are out of scope: the group goes before the interpreter's exit
