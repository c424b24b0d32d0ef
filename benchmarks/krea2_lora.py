"""Krea 2 LoRA step time and peak memory: dreamstep's trainer step against the loop of diffusers'
``train_dreambooth_lora_krea2.py`` at its default flags, in one run.

The reference does what the script does each step without ``--cache_latents`` (its default): VAE-encode the batch
(Qwen-Image's VAE, a frame axis of one) and draw from the posterior, normalise per channel, noise, timesteps from
the scheduler's table (looked up per sample), the inlined 2x2 packing, position ids built on the device, forward,
unpacking, weighted MSE, backward, clip, AdamW step; the caption features (12 layers deep) are precomputed, as the
script does for an instance prompt. dreamstep's step reads the cached posterior and runs through the TrainStep
engine (fused AdamW, the σ table indexed on the device, position ids made once). Both train the same LoRA (rank 16
on the script's default to_q, to_k, to_v, to_out.0) of the same model; the loops take turns step by step; s/step is
the median. A last row runs the reference on cached latents: the most that caching can gain over it.

    python benchmarks/krea2_lora.py                                  # tiny model, CPU, 512 px
    python benchmarks/krea2_lora.py --size full --resolution 1024    # Krea 2's architecture, random weights, GPU
"""

from __future__ import annotations

import argparse

import torch
from diffusers import AutoencoderKLQwenImage, Krea2Pipeline, Krea2Transformer2DModel
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from measure import time_alternating, time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.krea2 import configs
from dreamstep.models.krea2.lora_targets import krea2_lora_targets
from dreamstep.models.krea2.plumbing import encode_posterior, latent_normalization, training_sigmas
from dreamstep.models.krea2.step import Krea2FlowMatchingStep
from dreamstep.models.krea2.tiny import build_tiny_krea2
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze

FULL_CAPTION_TOKENS = 512  # the script's --max_sequence_length: Krea 2 reads a fixed-length caption


def build_models(size: str, device: torch.device, dtype: torch.dtype) -> tuple:
    pipe = build_tiny_krea2(seed=0)
    if size == "tiny":
        transformer, vae, tokens = pipe.transformer, pipe.vae, 16
    else:
        with torch.device(device):
            transformer = Krea2Transformer2DModel(**configs.TRANSFORMER).to(dtype)
            vae = AutoencoderKLQwenImage(**configs.VAE).to(dtype)
        tokens = FULL_CAPTION_TOKENS
    freeze(transformer, vae)
    config = transformer.config
    return transformer.to(device), vae.to(device).eval(), pipe.scheduler, tokens, (config.num_text_layers,
                                                                                  config.text_hidden_dim)


def reference_step(transformer, vae, scheduler, optimizer, pixels, embeds, mask, autocast, latents=None) -> None:
    """The script's step, written out (no --cache_latents); given ``latents`` (normalised, (B, C, 1, h, w)) it skips
    the VAE."""
    if latents is None:
        with torch.no_grad():
            model_input = vae.encode(pixels.unsqueeze(2)).latent_dist.sample()
        mean, inverse_std = (t.unsqueeze(2).to(model_input.device) for t in latent_normalization(vae))
        model_input = (model_input - mean) * inverse_std
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
    sigmas = scheduler.sigmas.to(model_input.device, model_input.dtype)[step_indices].reshape(-1, 1, 1, 1, 1)
    noisy = ((1.0 - sigmas) * model_input + sigmas * noise).permute(0, 2, 1, 3, 4)
    c, h, w = model_input.shape[1], model_input.shape[3], model_input.shape[4]
    packed = noisy.reshape(bsz, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(bsz, h * w // 4, c * 4)
    position_ids = Krea2Pipeline.prepare_position_ids(embeds.shape[1], h // 2, w // 2, model_input.device)
    with autocast:
        pred = transformer(hidden_states=packed, encoder_hidden_states=embeds, timestep=timesteps / 1000,
                           position_ids=position_ids, encoder_attention_mask=mask, return_dict=False)[0]
    pred = pred.view(bsz, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(bsz, c, 1, h, w)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(bsz, -1), 1).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="default: 512 tiny, 1024 full")
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

    transformer, vae, scheduler, tokens, (layers, width) = build_models(args.size, device, dtype)
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    add_lora(transformer, krea2_lora_targets(transformer, ["attention"]), rank=16, alpha=16)
    cast_trainable_params_to_fp32(transformer)
    transformer.train()
    params = [p for p in transformer.parameters() if p.requires_grad]
    b = args.batch_size
    pixels = torch.rand(b, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    embeds = torch.randn(b, tokens, layers, width, device=device, dtype=dtype)
    mask = torch.ones(b, tokens, dtype=torch.bool, device=device)
    ref_optimizer = torch.optim.AdamW(params, lr=1e-4)
    latent_dist = encode_posterior(vae, pixels)  # what the latent cache holds

    def reference() -> None:
        reference_step(transformer, vae, scheduler, ref_optimizer, pixels, embeds, mask, autocast)

    def reference_cached() -> None:
        reference_step(transformer, vae, scheduler, ref_optimizer, pixels, embeds, mask, autocast,
                       latent_dist.chunk(2, dim=1)[0].unsqueeze(2))

    accelerator = make_accelerator(mixed_precision="bf16" if device.type == "cuda" else "no")
    step = Krea2FlowMatchingStep(transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                                 accelerator=accelerator, max_grad_norm=1.0, sigmas=training_sigmas(scheduler),
                                 objective=FlowMatchingObjective(), prior_loss_weight=1.0)
    batch = {"latent_dist": latent_dist, "prompt_embeds": embeds.float(), "prompt_mask": mask,
             "is_reg": torch.zeros(b, dtype=torch.bool)}

    _, ref_mem = time_steps(reference, args.steps, args.warmup, device)
    _, ours_mem = time_steps(lambda: step(batch), args.steps, args.warmup, device)
    ref_time, ours_time, cached_time = time_alternating([reference, lambda: step(batch), reference_cached],
                                                        args.steps, args.warmup, device)
    print(f"Krea 2 LoRA ({args.size}, {resolution}x{resolution}, batch {b}, {device.type})\n"
          f"{'':2}{'loop':<44}{'s/step':>10}{'peak MiB':>12}{'speed-up':>10}")
    print(f"{'':2}{'reference (the script: VAE every step)':<44}{ref_time:>10.4f}{ref_mem:>12.0f}")
    print(f"{'':2}{'dreamstep step (cached latents)':<44}{ours_time:>10.4f}{ours_mem:>12.0f}"
          f"{ref_time / ours_time:>9.2f}x")
    print(f"{'':2}{'reference without its VAE (the ceiling)':<44}{cached_time:>10.4f}{'':>12}"
          f"{ref_time / cached_time:>9.2f}x")
    print(f"  memory ratio: {ours_mem / ref_mem:.2f}")


if __name__ == "__main__":
    main()
