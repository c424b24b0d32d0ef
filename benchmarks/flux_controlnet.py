"""FLUX.1 ControlNet step time and memory: dreamstep's trainer against a reference loop, in one run.

The reference does what seed 003 (diffusers' ``train_controlnet_flux.py``) does each step: VAE-encode the
target and the control image, sample both posteriors, noise, run the ControlNet and the frozen transformer
with its residuals, backward, clip, optimizer step (text embeddings precomputed, as the seed does).
dreamstep's step reads both cached posteriors instead and runs through the TrainStep engine. Both train
the same ControlNet built from the same transformer. With ``--mixed_precision bf16`` a third row trains
bf16 ControlNet weights with the stochastic-rounding AdamW (``--controlnet_weights_dtype bf16``).

Trainable-state memory (weights + gradients + optimizer state) is measured from the live tensors; peak
memory is the CUDA allocator's peak on a GPU, else the process's peak RSS.

    python benchmarks/flux_controlnet.py                                     # tiny model, CPU, fp32
    python benchmarks/flux_controlnet.py --mixed_precision bf16              # + the bf16-weights mode
    python benchmarks/flux_controlnet.py --size full --resolution 1024       # FLUX.1-dev architecture, GPU
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from flux_lora import build_models
from measure import time_steps

from dreamstep.diffusion import flow_matching as fm
from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.bf16_adamw import StochasticRoundingAdamW, trainable_state_bytes
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux import plumbing as flux
from dreamstep.recipes.flux_controlnet import FluxControlNetStep

SEED_CONTROLNET_PARAMS = 1.44e9  # seed 003: the ControlNet it trains has about 1.44B parameters


def reference_step(transformer, controlnet, vae, sigmas, optimizer, pixels, control_pixels, embeds,
                   autocast) -> None:
    """Seed 003, written out: encode both images, sample, noise, ControlNet + transformer, loss, update."""
    with torch.no_grad():
        latents, control = ((vae.encode(p).latent_dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
                            for p in (pixels, control_pixels))
    latents, control = latents.float(), control.float()
    b, _, h, w = latents.shape
    noise = torch.randn_like(latents)
    indices = fm.sample_timestep_indices("none", b, len(sigmas)).to(latents.device)
    s = fm.sigmas_at(sigmas, indices, latents.ndim).to(latents.device)
    inputs = dict(hidden_states=flux.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(),
                  guidance=torch.full((b,), 3.5, device=latents.device), pooled_projections=embeds["pooled"],
                  encoder_hidden_states=embeds["prompt_embeds"], txt_ids=embeds["text_ids"],
                  img_ids=flux.latent_image_ids(h, w, latents.device, latents.dtype))
    with autocast:
        residuals = cn.residuals(controlnet, controlnet_cond=flux.pack(control), **inputs)
        pred = transformer(**inputs, **residuals, return_dict=False)[0]
    loss = fm.weighted_mse(flux.unpack(pred, h, w), fm.velocity_target(latents, noise), s, "none").mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def dreamstep_step(transformer, controlnet, optimizer, sigmas, mixed_precision: str) -> FluxControlNetStep:
    return FluxControlNetStep(controlnet, transformer=transformer, optimizer=optimizer,
                              accelerator=make_accelerator(mixed_precision=mixed_precision), max_grad_norm=1.0,
                              sigmas=sigmas, objective=FlowMatchingObjective(), guidance_scale=3.5)


def mib(n: int) -> float:
    return n / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="default: 64 tiny, 1024 full")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--num_double_layers", type=int, default=None, help="default: 1 tiny, 4 full")
    parser.add_argument("--num_single_layers", type=int, default=None, help="default: 1 tiny, 0 full")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default=None, help="default: bf16 on GPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mixed_precision = args.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    half = mixed_precision == "bf16"
    dtype = torch.bfloat16 if half else torch.float32
    resolution = args.resolution or (64 if args.size == "tiny" else 1024)
    double = args.num_double_layers if args.num_double_layers is not None else (1 if args.size == "tiny" else 4)
    single = args.num_single_layers if args.num_single_layers is not None else (1 if args.size == "tiny" else 0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if half else contextlib.nullcontext()
    torch.manual_seed(0)

    transformer, vae, scheduler, (tokens, t5_dim, clip_dim) = build_models(args.size, device, dtype)
    if half:  # the tiny model is built in fp32; seed 003 keeps the frozen base in bf16
        transformer, vae = transformer.bfloat16(), vae.bfloat16()
    b = args.batch_size
    pixels, control_pixels = (torch.rand(b, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
                              for _ in range(2))
    embeds = {"prompt_embeds": torch.randn(b, tokens, t5_dim, device=device, dtype=dtype),
              "pooled": torch.randn(b, clip_dim, device=device, dtype=dtype),
              "text_ids": flux.text_ids(tokens, device, dtype)}
    sigmas = scheduler.sigmas[:scheduler.config.num_train_timesteps]

    def new_controlnet(weights: torch.dtype) -> torch.nn.Module:
        controlnet = cn.cast(cn.build_from_transformer(transformer, double, single), weights).to(device)
        return controlnet.train()

    rows = []
    controlnet = new_controlnet(torch.float32)
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=1e-4)
    time_ref, peak_ref = time_steps(lambda: reference_step(transformer, controlnet, vae, sigmas, optimizer, pixels,
                                                           control_pixels, embeds, autocast),
                                    args.steps, args.warmup, device)
    rows.append(("reference (seed 003: VAE x2 every step)", time_ref, peak_ref, trainable_state_bytes(optimizer)))
    # The posteriors come from the latent cache in training.
    batch = {"latent_dist": flux.encode_posterior(vae, pixels),
             "condition_dist": flux.encode_posterior(vae, control_pixels), **embeds}
    variants = [("dreamstep (cached latents)", torch.float32, lambda params: build_optimizer("AdamW", params, 1e-4))]
    if half:
        variants.append(("dreamstep, bf16 weights + SR AdamW", torch.bfloat16,
                         lambda params: StochasticRoundingAdamW(params, lr=1e-4)))
    for name, weights, make_optimizer in variants:
        del controlnet, optimizer
        controlnet = new_controlnet(weights)
        optimizer = make_optimizer(controlnet.parameters())
        step = dreamstep_step(transformer, controlnet, optimizer, sigmas, mixed_precision)
        seconds, peak = time_steps(lambda: step(batch), args.steps, args.warmup, device)
        rows.append((name, seconds, peak, trainable_state_bytes(optimizer)))

    params = sum(p.numel() for p in controlnet.parameters())
    print(f"FLUX.1 ControlNet ({args.size}, {double} double + {single} single blocks, {params / 1e6:.2f}M params, "
          f"{resolution}x{resolution}, batch {b}, {device.type}, mixed precision {mixed_precision})")
    print(f"{'':2}{'loop':<42}{'s/step':>10}{'peak MiB':>10}{'train-state MiB':>17}{'B/param':>9}")
    for name, seconds, peak, state in rows:
        print(f"{'':2}{name:<42}{seconds:>10.4f}{peak:>10.0f}{mib(state['total']):>17.2f}"
              f"{state['total'] / params:>9.2f}")
    print(f"  speed-up vs reference: {time_ref / rows[1][1]:.2f}x")
    if half:
        fp32_state, bf16_state = rows[1][3]["total"], rows[2][3]["total"]
        print(f"  bf16 weights: trainable state {mib(bf16_state):.2f} MiB vs {mib(fp32_state):.2f} MiB "
              f"({1 - bf16_state / fp32_state:.0%} less); "
              f"for the seed's {SEED_CONTROLNET_PARAMS / 1e9:.2f}B ControlNet "
              f"{fp32_state / params * SEED_CONTROLNET_PARAMS / 2**30:.1f} GiB -> "
              f"{bf16_state / params * SEED_CONTROLNET_PARAMS / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
