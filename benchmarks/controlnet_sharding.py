"""FLUX.1 ControlNet over several processes: DDP against FSDP2 (``--zero_stage 2`` and ``3``), in one run.

For 1, 2 and 4 processes (``accelerate launch``; gloo on CPUs, NCCL on GPUs) each strategy trains the same
ControlNet, built from a FLUX-shaped transformer with random weights, through dreamstep's ``FluxControlNetStep``
on cached posteriors. Printed per row: the median step time, the largest per-process trainable state (weights +
gradients + AdamW moments, measured on the live shards after a step) and the largest per-process peak memory
(CUDA allocator peak, else peak RSS, which includes the frozen base and the Python runtime). The reference is
DDP at the same process count. Then the estimate for the seed's ControlNet at full size on 1-8 GPUs.

    python benchmarks/controlnet_sharding.py                       # CPU processes, a 512-wide model
    python benchmarks/controlnet_sharding.py --size full --resolution 1024 --processes 1 2 4 8   # GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxControlNetModel, FluxTransformer2DModel
from flux_lora import CLIP_DIM, FULL_TRANSFORMER, T5_DIM, T5_TOKENS
from measure import time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.sharding import local_state_bytes, shard_model
from dreamstep.engine.train_step import make_accelerator
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux import plumbing as flux
from dreamstep.recipes.flux_controlnet import FluxControlNetStep

# A FLUX.1-shaped transformer narrow enough for CPU processes (8 heads of 64 = 512 wide).
SMALL_TRANSFORMER = {**FULL_TRANSFORMER, "num_layers": 2, "num_single_layers": 4, "num_attention_heads": 8,
                     "attention_head_dim": 64, "joint_attention_dim": 256, "axes_dims_rope": (8, 28, 28)}
SEED_DOUBLE, SEED_SINGLE = 2, 4  # the ControlNet size the sharding issue quotes (about 1.4B parameters)
STRATEGIES = {"ddp": 0, "fsdp2 zero2": 2, "fsdp2 zero3": 3}


def worker(args: argparse.Namespace) -> None:
    accelerator = make_accelerator(cpu=not torch.cuda.is_available(),
                                   mixed_precision="bf16" if torch.cuda.is_available() else "no")
    device = accelerator.device
    torch.manual_seed(0)
    config = FULL_TRANSFORMER if args.size == "full" else SMALL_TRANSFORMER
    with torch.device(device):
        transformer = FluxTransformer2DModel(**config)
    transformer.requires_grad_(False)
    if device.type == "cuda":
        transformer.bfloat16()
    controlnet = cn.build_from_transformer(transformer, args.double, args.single).float().to(device).train()
    shard_model(controlnet, args.zero_stage, cn.BLOCK_CLASSES, device)
    optimizer = build_optimizer("AdamW", controlnet.parameters(), 1e-4)
    if args.zero_stage == 0 and accelerator.num_processes > 1:
        controlnet, optimizer = accelerator.prepare(controlnet, optimizer)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    step = FluxControlNetStep(controlnet, transformer=transformer, optimizer=optimizer, accelerator=accelerator,
                              max_grad_norm=1.0, sigmas=scheduler.sigmas[:1000], objective=FlowMatchingObjective(),
                              guidance_scale=3.5)
    latent = args.resolution // 8
    tokens, t5_dim, clip_dim = (T5_TOKENS, T5_DIM, CLIP_DIM) if args.size == "full" else (32, 256, 768)
    batch = {"latent_dist": torch.randn(1, 32, latent, latent, device=device),
             "condition_dist": torch.randn(1, 32, latent, latent, device=device),
             "prompt_embeds": torch.randn(1, tokens, t5_dim, device=device),
             "pooled": torch.randn(1, clip_dim, device=device),
             "text_ids": flux.text_ids(tokens, device, torch.float32)}
    seconds, peak = time_steps(lambda: step(batch), args.steps, args.warmup, device)
    row = {"seconds": seconds, "peak_mib": peak, "state_mib": local_state_bytes(controlnet, optimizer) / 2**20}
    rows = accelerator.gather_for_metrics([row], use_gather_object=True)
    if accelerator.is_main_process:
        Path(args.json).write_text(json.dumps(rows))
    accelerator.wait_for_everyone()


def launch(args: argparse.Namespace, processes: int, zero_stage: int, out: Path) -> list[dict]:
    own = [__file__, "--worker", "--json", str(out), "--zero_stage", str(zero_stage), "--size", args.size,
           "--resolution", str(args.resolution), "--double", str(args.double), "--single", str(args.single),
           "--steps", str(args.steps), "--warmup", str(args.warmup)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(port), *own] if processes > 1 else [sys.executable, *own]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{processes} processes, zero_stage {zero_stage} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def seed_estimate(gpus: range) -> None:
    """Per-GPU memory of the seed's ControlNet training state and frozen base, by strategy (no activations)."""
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FULL_TRANSFORMER)
        controlnet = FluxControlNetModel.from_transformer(transformer, num_layers=SEED_DOUBLE,
                                                          num_single_layers=SEED_SINGLE)
    params = sum(p.numel() for p in controlnet.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in [*controlnet.transformer_blocks,
                                                                 *controlnet.single_transformer_blocks])
    base = sum(p.numel() for p in transformer.parameters()) * 2  # bf16, frozen
    state = 16 * params  # fp32 weights + gradients + two AdamW moments
    gib = 2**30
    print(f"\nestimate: FLUX.1-dev base (bf16, {base / 2 / 1e9:.2f}B) + ControlNet {SEED_DOUBLE}+{SEED_SINGLE} blocks "
          f"({params / 1e9:.2f}B, fp32 AdamW), GiB per GPU before activations")
    print(f"  {'GPUs':>4}{'DDP':>10}{'zero2':>10}{'zero3':>10}{'zero3 + --shard_base':>22}")
    for n in gpus:
        ddp = (state + base) / gib
        # One process shards nothing. zero2: the full fp32 weights stay gathered through backward; zero3: one
        # block's full weights and gradients at a time; --shard_base: the base too, plus one gathered frozen block.
        zero2 = ddp if n == 1 else (state / n + 4 * params + base) / gib
        zero3 = ddp if n == 1 else (state / n + 8 * block + base) / gib
        shard_base = ddp if n == 1 else (state / n + 8 * block + base / n + base / 57) / gib
        print(f"  {n:>4}{ddp:>10.1f}{zero2:>10.1f}{zero3:>10.1f}{shard_base:>22.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["small", "full"], default="small")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--double", type=int, default=SEED_DOUBLE)
    parser.add_argument("--single", type=int, default=SEED_SINGLE)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zero_stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"FLUX ControlNet ({args.size}, {args.double} double + {args.single} single blocks), "
          f"{args.resolution}x{args.resolution}, batch 1 per process, {device}")
    print(f"  {'processes':>9}  {'strategy':<12}{'s/step':>9}{'vs DDP':>8}{'state MiB/proc':>16}{'peak MiB/proc':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        for processes in args.processes:
            ddp_seconds = None
            for name, stage in STRATEGIES.items():
                rows = launch(args, processes, stage, Path(tmp) / f"{processes}-{stage}.json")
                seconds = max(r["seconds"] for r in rows)
                ddp_seconds = ddp_seconds or seconds
                print(f"  {processes:>9}  {name:<12}{seconds:>9.3f}{ddp_seconds / seconds:>7.2f}x"
                      f"{max(r['state_mib'] for r in rows):>16.1f}{max(r['peak_mib'] for r in rows):>15.0f}")
    seed_estimate(range(1, 9))


if __name__ == "__main__":
    main()
