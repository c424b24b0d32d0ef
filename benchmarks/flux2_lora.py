"""FLUX.2 [klein] LoRA step time and peak memory: dreamstep's step against the loop of diffusers'
``train_dreambooth_lora_flux2_klein.py`` at its default flags, on the same model, in one run.

The reference is the script's step as it runs by default (no --cache_latents): VAE-encode the batch (the posterior's
mode), patchify and normalise by the VAE's batch-norm statistics, position ids built on the host and copied over,
noise, timesteps looked up one by one in the schedule (a host sync per sample), pack, forward, the scatter back by
the ids, the weighted MSE, backward, clipping, torch's AdamW step. dreamstep's step reads the posterior from the
latent cache (filled once before the loop), keeps its ids and σ table on the device, and steps a fused AdamW. Both
train the same rank-16 LoRA (the script's default targets) on the same model; prompt embeddings are precomputed in
both, as the script does.

The loops take turns step by step, so a slow spell of a shared machine slows them alike; s/step is the median.

    python benchmarks/flux2_lora.py                                # tiny [klein], CPU, 512 px (the script's default)
    python benchmarks/flux2_lora.py --size full --resolution 1024  # [klein] 4B's architecture, random weights, GPU
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from measure import time_alternating, time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.flux2 import plumbing as flux2
from dreamstep.models.flux2 import published
from dreamstep.models.flux2.lora_targets import flux2_lora_targets
from dreamstep.models.flux2.step import Flux2Step
from dreamstep.models.flux2.tiny import FLUX2_SCHEDULER, build_tiny_flux2_klein
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze

TEXT_TOKENS = 512  # --max_sequence_length's default


def build_models(size: str, device: torch.device, dtype: torch.dtype) -> tuple:
    """(transformer, vae, scheduler); weights are random (speed does not depend on them)."""
    if size == "tiny":
        pipe = build_tiny_flux2_klein(seed=0)
        transformer, vae, scheduler = pipe.transformer, pipe.vae, pipe.scheduler
    else:
        from diffusers import FlowMatchEulerDiscreteScheduler

        with torch.device(device):
            transformer = Flux2Transformer2DModel(**published.KLEIN_4B_TRANSFORMER).to(dtype)
            vae = AutoencoderKLFlux2().to(dtype)
        scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER)
    freeze(transformer, vae)
    add_lora(transformer, flux2_lora_targets(transformer, ["attention"]), rank=16, alpha=16)
    cast_trainable_params_to_fp32(transformer)
    transformer.train()
    return transformer.to(device), vae.to(device).eval(), scheduler


def reference_step(transformer, vae, scheduler, optimizer, pixels, prompt_embeds, text_ids, autocast) -> None:
    """The klein script's step from "Convert images to latent space" to zero_grad, at its defaults."""
    device = pixels.device
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(device)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(device)
    with torch.no_grad():
        model_input = vae.encode(pixels).latent_dist.mode()
    model_input = Flux2KleinPipeline._patchify_latents(model_input)
    model_input = (model_input - bn_mean) / bn_std
    model_input_ids = Flux2KleinPipeline._prepare_latent_ids(model_input).to(device=device)
    noise = torch.randn_like(model_input)
    u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=model_input.shape[0],
                                              logit_mean=0.0, logit_std=1.0, mode_scale=1.29)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices].to(device=device)
    schedule_timesteps = scheduler.timesteps.to(device)
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas.to(device=device, dtype=model_input.dtype)[step_indices].flatten()
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    packed = Flux2KleinPipeline._pack_latents(noisy_model_input)
    with autocast:
        model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=None,
                                 encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=model_input_ids,
                                 return_dict=False)[0]
    model_pred = Flux2KleinPipeline._unpack_latents_with_ids(model_pred[:, :packed.size(1)], model_input_ids)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                      1).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="default: 512 tiny, 1024 full")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    resolution = args.resolution or (512 if args.size == "tiny" else 1024)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(0)
    transformer, vae, scheduler = build_models(args.size, device, dtype)
    params = [p for p in transformer.parameters() if p.requires_grad]
    b = args.batch_size
    pixels = torch.rand(b, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    text_dim = transformer.config.joint_attention_dim
    prompt_embeds = torch.randn(b, TEXT_TOKENS, text_dim, device=device, dtype=dtype)
    text_ids = Flux2KleinPipeline._prepare_text_ids(prompt_embeds).to(device)
    reference_optimizer = torch.optim.AdamW(params, lr=1e-4)

    def reference() -> None:
        reference_step(transformer, vae, scheduler, reference_optimizer, pixels, prompt_embeds, text_ids, autocast)

    accelerator = make_accelerator(mixed_precision="bf16" if device.type == "cuda" else "no")
    step = Flux2Step(transformer, optimizer=build_optimizer("AdamW", params, 1e-4), accelerator=accelerator,
                     max_grad_norm=1.0, sigmas=flux2.training_sigmas(scheduler).to(device),
                     objective=FlowMatchingObjective(), guidance_scale=None)
    batch = {"latent_dist": flux2.encode_posterior(vae, pixels), "prompt_embeds": prompt_embeds,
             "is_reg": torch.zeros(b, dtype=torch.bool)}  # the posterior comes from the latent cache in training

    _, reference_memory = time_steps(reference, args.steps, args.warmup, device)
    _, ours_memory = time_steps(lambda: step(batch), args.steps, args.warmup, device)
    reference_time, ours_time = time_alternating([reference, lambda: step(batch)], args.steps, args.warmup, device)
    print(f"FLUX.2 [klein] LoRA ({args.size}, {resolution}x{resolution}, batch {b}, {device.type})")
    print(f"{'':2}{'loop':<44}{'s/step':>10}{'peak MiB':>12}{'speed-up':>10}")
    print(f"{'':2}{'diffusers klein script (VAE every step)':<44}{reference_time:>10.4f}{reference_memory:>12.0f}")
    print(f"{'':2}{'dreamstep step (cached latents)':<44}{ours_time:>10.4f}{ours_memory:>12.0f}"
          f"{reference_time / ours_time:>9.2f}x")
    print(f"  memory ratio: {ours_memory / reference_memory:.2f}")


if __name__ == "__main__":
    main()
