"""Z-Image LoRA step time and peak memory: dreamstep's trainer step against the loop of diffusers'
``train_dreambooth_lora_z_image.py`` at its default flags, in one run.

The reference does what the script does each step without ``--cache_latents`` (its default): VAE-encode the
batch and take the posterior's mode, noise, timesteps from the scheduler's table (looked up per sample), the lists
of per-sample latents and caption features, forward, negate, weighted MSE, backward, clip, AdamW step; the caption
features are precomputed, as the script does for an instance prompt. dreamstep's step reads the cached posterior
and runs through the TrainStep engine (fused AdamW, the σ table indexed on the device). Both train the same LoRA
(rank 16 on the script's default to_q, to_k, to_v, to_out.0) of the same model. The loops take turns step by step;
s/step is the median. A last row runs the reference on cached latents: the most that caching can gain over it.

    python benchmarks/z_image_lora.py                                  # tiny model, CPU, 512 px
    python benchmarks/z_image_lora.py --size full --resolution 1024    # Z-Image's architecture, random weights, GPU
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKL, ZImageTransformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from measure import time_alternating, time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze
from dreamstep.models.vae import encode_posterior
from dreamstep.models.z_image import configs
from dreamstep.models.z_image.lora_targets import z_image_lora_targets
from dreamstep.models.z_image.plumbing import training_sigmas
from dreamstep.models.z_image.step import ZImageFlowMatchingStep
from dreamstep.models.z_image.tiny import build_tiny_z_image

FULL_CAPTION_TOKENS = 128  # a typical caption with Qwen3's chat template around it


def build_models(size: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """(transformer, vae, scheduler, caption tokens, caption width); weights are random (speed does not depend on
    them)."""
    pipe = build_tiny_z_image(seed=0)
    if size == "tiny":
        transformer, vae, tokens = pipe.transformer, pipe.vae, 20
    else:
        with torch.device(device):
            transformer = ZImageTransformer2DModel(**configs.TRANSFORMER).to(dtype)
            vae = AutoencoderKL(**configs.VAE).to(dtype)
        tokens = FULL_CAPTION_TOKENS
    freeze(transformer, vae)
    return (transformer.to(device), vae.to(device).eval(), pipe.scheduler, tokens,
            transformer.config.cap_feat_dim)


def reference_step(transformer, vae, scheduler, optimizer, pixels, captions, autocast, latents=None) -> None:
    """The script's step, written out (no --cache_latents); given ``latents`` (the scaled posterior mode a latent
    cache holds) it skips the VAE: the same loop with the VAE's work taken out."""
    if latents is None:
        with torch.no_grad():
            model_input = vae.encode(pixels).latent_dist.mode()
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    else:
        model_input = latents
    noise = torch.randn_like(model_input)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz, logit_mean=0.0, logit_std=1.0,
                                              mode_scale=1.29)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices].to(model_input.device)
    schedule = scheduler.timesteps.to(model_input.device)
    step_indices = [(schedule == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas.to(model_input.device, model_input.dtype)[step_indices].reshape(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    with autocast:
        pred = transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000, captions,
                           return_dict=False)[0]
    model_pred = -torch.stack(pred).squeeze(2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="default: 512 tiny (the script's), 1024 full")
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

    transformer, vae, scheduler, tokens, width = build_models(args.size, device, dtype)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    add_lora(transformer, z_image_lora_targets(transformer, ["attention"]), rank=16, alpha=16)
    cast_trainable_params_to_fp32(transformer)
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    b = args.batch_size
    pixels = torch.rand(b, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    captions = [torch.randn(tokens, width, device=device, dtype=dtype) for _ in range(b)]
    ref_optimizer = torch.optim.AdamW(params, lr=1e-4)

    def reference() -> None:
        reference_step(transformer, vae, scheduler, ref_optimizer, pixels, captions, autocast)

    latent_dist = encode_posterior(vae, pixels)  # what the latent cache holds

    def reference_cached() -> None:
        reference_step(transformer, vae, scheduler, ref_optimizer, pixels, captions, autocast,
                       latent_dist.chunk(2, dim=1)[0].to(dtype))

    accelerator = make_accelerator(mixed_precision="bf16" if device.type == "cuda" else "no")
    step = ZImageFlowMatchingStep(transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                                  accelerator=accelerator, max_grad_norm=1.0, sigmas=training_sigmas(scheduler),
                                  objective=FlowMatchingObjective(), prior_loss_weight=1.0)
    padded = torch.zeros(b, tokens, width, device=device)
    padded[:] = torch.stack(captions).float()
    batch = {"latent_dist": latent_dist, "prompt_embeds": padded, "prompt_lengths": torch.full((b,), tokens),
             "is_reg": torch.zeros(b, dtype=torch.bool)}

    _, ref_mem = time_steps(reference, args.steps, args.warmup, device)
    _, ours_mem = time_steps(lambda: step(batch), args.steps, args.warmup, device)
    ref_time, ours_time, cached_time = time_alternating([reference, lambda: step(batch), reference_cached],
                                                        args.steps, args.warmup, device)
    print(f"Z-Image LoRA ({args.size}, {resolution}x{resolution}, batch {b}, {device.type})\n"
          f"{'':2}{'loop':<44}{'s/step':>10}{'peak MiB':>12}{'speed-up':>10}")
    print(f"{'':2}{'reference (the script: VAE every step)':<44}{ref_time:>10.4f}{ref_mem:>12.0f}")
    print(f"{'':2}{'dreamstep step (cached latents)':<44}{ours_time:>10.4f}{ours_mem:>12.0f}"
          f"{ref_time / ours_time:>9.2f}x")
    print(f"{'':2}{'reference without its VAE (the ceiling)':<44}{cached_time:>10.4f}{'':>12}"
          f"{ref_time / cached_time:>9.2f}x")
    print(f"  memory ratio: {ours_mem / ref_mem:.2f}")


if __name__ == "__main__":
    main()
