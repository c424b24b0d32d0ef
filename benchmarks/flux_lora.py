"""FLUX.1 LoRA step time and peak memory: dreamstep's trainer against a reference loop, in one run.

The reference does what seed 000 (and diffusers' train_dreambooth_lora_flux.py at its defaults) does each
step: VAE-encode the batch, sample the posterior, noise, forward, backward, clip, optimizer step (text
embeddings precomputed, as the seed does). dreamstep's step reads the cached VAE posterior instead and runs
through the TrainStep engine. Both train the same LoRA (rank 16, the seed's attention targets) on the same
model. With the tiny model a third row runs dreamstep's whole training loop as the trainer does: the
bundled robot images through the loader and the caches, logging to TensorBoard every step.

The loops take turns step by step (the reference between two steps of each of dreamstep's), so a slow
spell of a shared machine slows them alike; s/step is the median. A last row runs the reference on the cached
posterior: its own step without the VAE, the most that caching latents can gain over it (at low resolutions the
VAE's share of the reference's step is small, and the transformer's forward and backward, the same in both,
bound every loop).

    python benchmarks/flux_lora.py                                  # tiny model, CPU, 512 px
    python benchmarks/flux_lora.py --resolution 96                  # the demo's resolution
    python benchmarks/flux_lora.py --size full --resolution 1024    # FLUX.1-dev architecture, random weights, GPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from measure import time_alternating, time_steps, timed

from dreamstep.data.cache import TensorCache
from dreamstep.data.dataset import ConditionedBatches, build_dataset, make_dataloader
from dreamstep.data.sources import bucket_spec, dreambooth_from_flags
from dreamstep.diffusion import flow_matching as fm
from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.logging import TrainingLogger
from dreamstep.engine.loop import run_training
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models import parking
from dreamstep.models.flux import plumbing as flux
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze
from dreamstep.models.vae import sample_latents
from dreamstep.recipes.flux_lora import FluxLoraModel, FluxLoraStep

ROBOT_DIR = Path(__file__).resolve().parents[1] / "examples" / "robot"
ROBOT_PROMPT = "a photo of sks robot"

# FLUX.1-dev's transformer and VAE configs (black-forest-labs/FLUX.1-dev).
FULL_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                        guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FULL_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)
T5_TOKENS, T5_DIM, CLIP_DIM = 512, 4096, 768


def build_models(size: str, device: torch.device, dtype: torch.dtype, pipe=None) -> tuple:
    """(transformer, vae, scheduler, text embedding sizes); weights are random (speed does not depend on
    them). The tiny ones are ``pipe``'s when given."""
    if size == "tiny":
        pipe = pipe or build_tiny_flux(seed=0, guidance_embeds=True)
        text = (16, pipe.text_encoder_2.config.d_model, pipe.text_encoder.config.hidden_size)
        transformer, vae, scheduler = pipe.transformer, pipe.vae, pipe.scheduler
    else:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**FULL_TRANSFORMER).to(dtype)
            vae = AutoencoderKL(**FULL_VAE).to(dtype)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        text = (T5_TOKENS, T5_DIM, CLIP_DIM)
    freeze(transformer, vae)
    return transformer.to(device), vae.to(device).eval(), scheduler, text


def add_benchmark_lora(transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    add_lora(transformer, flux_lora_targets(transformer, ["attention"]), rank=16, alpha=16)
    cast_trainable_params_to_fp32(transformer)
    transformer.train()
    return [p for p in transformer.parameters() if p.requires_grad]


def reference_step(transformer, vae, sigmas, optimizer, pixels, embeds, autocast, latent_dist=None) -> None:
    """Seed 000, written out: encode, sample, noise, predict, flow-matching loss, update. Given the posterior
    (``latent_dist``, as a latent cache holds it) it samples that instead of encoding: the same loop with the VAE's
    work taken out, which bounds what caching latents can gain over it."""
    if latent_dist is not None:
        latents = sample_latents(latent_dist)
    else:
        with torch.no_grad():
            posterior = vae.encode(pixels).latent_dist
            latents = (posterior.sample() - vae.config.shift_factor) * vae.config.scaling_factor
    latents = latents.float()
    b, _, h, w = latents.shape
    noise = torch.randn_like(latents)
    indices = fm.sample_timestep_indices("none", b, len(sigmas)).to(latents.device)
    s = fm.sigmas_at(sigmas, indices, latents.ndim).to(latents.device)
    with autocast:
        pred = transformer(hidden_states=flux.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(),
                           guidance=torch.full((b,), 3.5, device=latents.device), pooled_projections=embeds["pooled"],
                           encoder_hidden_states=embeds["prompt_embeds"], txt_ids=embeds["text_ids"],
                           img_ids=flux.latent_image_ids(h, w, latents.device, latents.dtype), return_dict=False)[0]
    loss = fm.weighted_mse(flux.unpack(pred, h, w), fm.velocity_target(latents, noise), s, "none").mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def dreamstep_step(transformer: torch.nn.Module, params: list[torch.nn.Parameter], sigmas: torch.Tensor,
                   accelerator) -> FluxLoraStep:
    """The trainer's step at its defaults: fused AdamW, clipping at 1, uniform timesteps, guidance 3.5."""
    return FluxLoraStep(FluxLoraModel(transformer), optimizer=build_optimizer("AdamW", params, 1e-4),
                        accelerator=accelerator, max_grad_norm=1.0, sigmas=sigmas, objective=FlowMatchingObjective(),
                        guidance_scale=3.5, prior_loss_weight=1.0)


def trainer_loop_times(pipe, step: FluxLoraStep, resolution: int, tokens: int, steps: int, warmup: int,
                       between: Callable[[], None]) -> tuple[float, float]:
    """Median s/step of dreamstep's training loop over the robot images (caches filled first, as the trainer
    does), and of ``between()``, which runs after each of the loop's steps, outside the loop's time."""
    root = Path(tempfile.mkdtemp(prefix="flux_lora_bench_"))
    latent_cache, text_cache = TensorCache(root / "latents", "vae"), TensorCache(root / "text", "text")
    config = dreambooth_from_flags(ROBOT_DIR, ROBOT_PROMPT, buckets=bucket_spec(resolution), center_crop=True)
    dataset = build_dataset([config], seed=0, latent_cache=latent_cache)
    dataset.text_cache = text_cache
    conditioner = flux.FluxConditioner(pipe, latent_cache=latent_cache, text_cache=text_cache,
                                       max_sequence_length=tokens, device=step.accelerator.device)
    parking.fill_caches(conditioner, dataset, epochs=1)
    loop_times, between_times, mark = [], [], [0.0]

    def after_step(position, loss, total) -> bool:
        loop_times.append(time.perf_counter() - mark[0])
        between_times.append(timed(between, step.accelerator.device))
        mark[0] = time.perf_counter()
        return False

    mark[0] = time.perf_counter()
    run_training(step, ConditionedBatches(make_dataloader(dataset, seed=0), conditioner),
                 max_train_steps=warmup + steps, logger=TrainingLogger(root / "logs"), progress=False,
                 log_every=10, on_step=after_step)
    return statistics.median(loop_times[warmup:]), statistics.median(between_times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None,
                        help="default: 512 tiny (the trainers' and diffusers' default), 1024 full")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    resolution = args.resolution or (512 if args.size == "tiny" else 1024)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(0)

    pipe = build_tiny_flux(seed=0, guidance_embeds=True) if args.size == "tiny" else None
    transformer, vae, scheduler, (tokens, t5_dim, clip_dim) = build_models(args.size, device, dtype, pipe)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    params = add_benchmark_lora(transformer)
    b = args.batch_size
    pixels = torch.rand(b, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    embeds = {"prompt_embeds": torch.randn(b, tokens, t5_dim, device=device, dtype=dtype),
              "pooled": torch.randn(b, clip_dim, device=device, dtype=dtype),
              "text_ids": flux.text_ids(tokens, device, dtype)}
    sigmas = scheduler.sigmas[:scheduler.config.num_train_timesteps]

    ref_optimizer = torch.optim.AdamW(params, lr=1e-4)

    def reference() -> None:
        reference_step(transformer, vae, sigmas, ref_optimizer, pixels, embeds, autocast)

    accelerator = make_accelerator(mixed_precision="bf16" if device.type == "cuda" else "no")
    step = dreamstep_step(transformer, params, sigmas, accelerator)
    batch = {"latent_dist": flux.encode_posterior(vae, pixels), "is_reg": torch.zeros(b, dtype=torch.bool),
             **embeds}  # the posterior comes from the latent cache in training
    def reference_cached() -> None:
        reference_step(transformer, vae, sigmas, ref_optimizer, pixels, embeds, autocast, batch["latent_dist"])

    _, ref_mem = time_steps(reference, args.steps, args.warmup, device)
    _, ours_mem = time_steps(lambda: step(batch), args.steps, args.warmup, device)
    ref_time, ours_time, cached_time = time_alternating([reference, lambda: step(batch), reference_cached],
                                                        args.steps, args.warmup, device)

    name = f"FLUX.1 LoRA ({args.size}, {resolution}x{resolution}, batch {b}, {device.type})"
    print(f"{name}\n{'':2}{'loop':<40}{'s/step':>10}{'peak MiB':>12}{'speed-up':>10}")
    print(f"{'':2}{'reference (seed 000: VAE every step)':<40}{ref_time:>10.4f}{ref_mem:>12.0f}")
    print(f"{'':2}{'dreamstep step (cached latents)':<40}{ours_time:>10.4f}{ours_mem:>12.0f}"
          f"{ref_time / ours_time:>9.2f}x")
    print(f"{'':2}{'reference without its VAE (the ceiling)':<40}{cached_time:>10.4f}{'':>12}"
          f"{ref_time / cached_time:>9.2f}x")
    if pipe is not None and b == 1:
        loop_step = dreamstep_step(transformer, params, sigmas, accelerator)
        loop_time, ref_beside = trainer_loop_times(pipe, loop_step, resolution, tokens, args.steps, args.warmup,
                                                   reference)
        print(f"{'':2}{'dreamstep trainer loop (data, logging)':<40}{loop_time:>10.4f}{'':>12}"
              f"{ref_beside / loop_time:>9.2f}x   (reference beside it: {ref_beside:.4f} s/step)")
    print(f"  memory ratio: {ours_mem / ref_mem:.2f}")
    if args.size == "full" and device.type == "cuda":
        report_mfu(transformer, resolution, b, ours_time)


def report_mfu(transformer: torch.nn.Module, resolution: int, batch: int, seconds: float) -> None:
    """Model FLOPs utilisation against the H100 dense bf16 peak (989 TFLOP/s), counting the usual 6·N·tokens
    per step (attention scores not counted, so this is a lower bound on the work done)."""
    params = sum(p.numel() for p in transformer.parameters())
    tokens = batch * ((resolution // 16) ** 2 + T5_TOKENS)
    flops = 6 * params * tokens
    print(f"  model FLOPs/step: {flops:.3g}   MFU vs 989 TFLOP/s: {flops / seconds / 989e12:.1%}")


if __name__ == "__main__":
    main()
