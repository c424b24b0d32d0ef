"""SDXL LoRA step time and peak memory: dreamstep's trainer against a reference loop, in one run.

The reference does what the seed 004 trainer does with the seed's command: every step VAE-encode the batch
(fp32 VAE, --no_half_vae), encode the captions with both CLIP encoders, noise with offset noise, run the UNet
with the LoRA (rank 256, alpha 256, fp32, gradient checkpointing), min-SNR-weighted MSE, backward, AdamW.
dreamstep's step (the recipe's ``SDXLLoraStep`` on the TrainStep engine) reads the VAE posterior and the
prompt embeddings from the content-keyed caches; it runs twice: with the seed's own flags (fp32, gradient
checkpointing), and as recommended (without checkpointing; on a GPU with --mixed_precision bf16).

    python benchmarks/sdxl_lora.py                                  # tiny model, CPU
    python benchmarks/sdxl_lora.py --size full                      # SDXL architecture, random weights, GPU
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
from measure import time_steps
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from dreamstep.data import TensorCache
from dreamstep.diffusion import noise_prediction as noise_math
from dreamstep.diffusion.losses import LossFunction
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.kohya_network import NetworkOptions, create_network
from dreamstep.models.precision import freeze
from dreamstep.models.published_configs import SDXL_UNET
from dreamstep.models.sdxl import plumbing as sdxl
from dreamstep.models.sdxl.plumbing import SDXLLoraModel
from dreamstep.models.sdxl.tiny import build_tiny_sdxl
from dreamstep.models.tiny import build_clip_tokenizer
from dreamstep.recipes.sdxl_lora import SDXLLoraStep

# stabilityai/stable-diffusion-xl-base-1.0: vae/, text_encoder/ (CLIP-L), text_encoder_2/ (OpenCLIP bigG).
FULL_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, sample_size=1024, scaling_factor=0.13025)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              hidden_act="gelu", projection_dim=1280)
SEED_NETWORK = NetworkOptions(dim=256, alpha=256.0, dropout=0.1)
H100_BF16_PEAK = 989e12


def build_pipeline(size: str, device: torch.device) -> StableDiffusionXLPipeline:
    """The tiny SDXL, or the SDXL base architecture with random weights (speed does not depend on them), fp32."""
    if size == "tiny":
        pipe = build_tiny_sdxl(seed=0)
    else:
        tokenizer, tokenizer_2 = build_clip_tokenizer(), build_clip_tokenizer(pad_token="!")
        with torch.device(device):
            encoders = [cls(CLIPTextConfig(vocab_size=len(tok), max_position_embeddings=77, **cfg))
                        for cls, tok, cfg in ((CLIPTextModel, tokenizer, CLIP_L),
                                              (CLIPTextModelWithProjection, tokenizer_2, CLIP_G))]
            unet = UNet2DConditionModel(**{k: v for k, v in SDXL_UNET.items() if not k.startswith("_")})
            vae = AutoencoderKL(**FULL_VAE)
        pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1],
                                         tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
                                         scheduler=build_tiny_sdxl(seed=0).scheduler)
    freeze(pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_step(pipe, network, scheduler, optimizer, pixels, captions, time_ids) -> None:
    """The seed's trainer, written out: encode image and text, noise, predict, min-SNR MSE, update."""
    with torch.no_grad():
        latents = pipe.vae.encode(pixels).latent_dist.sample() * pipe.vae.config.scaling_factor
        embeds = sdxl.encode_prompts(pipe, captions)
    noise = noise_math.offset_noise(torch.randn_like(latents), latents, 0.0357, 0.00357)
    t = noise_math.sample_timesteps(latents.shape[0], 0, 1000, latents.device)
    pred = pipe.unet(scheduler.add_noise(latents, noise, t), t, encoder_hidden_states=embeds["prompt_embeds"],
                     added_cond_kwargs={"text_embeds": embeds["pooled"], "time_ids": time_ids}, return_dict=False)[0]
    loss = noise_math.per_sample_mse(pred, noise)
    loss = (loss * noise_math.min_snr_weight(noise_math.snr(scheduler.alphas_cumprod, t), 5.0)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(network.parameters()), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def dreamstep_step(unet, network, scheduler, mixed_precision: str, pipe=None) -> SDXLLoraStep:
    """The recipe's step over the cached conditioning, with the seed's loss options (and the recipe's defaults for
    the options the seed did not have: L2 loss, no debiased estimation or input perturbation). ``pipe`` encodes
    captions; without it the batches must bring their embeddings."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    accelerator = make_accelerator(mixed_precision=mixed_precision)
    optimizer = build_optimizer("AdamW", network.parameters(), 1e-4, betas=(0.9, 0.98), weight_decay=0.05)
    model = SDXLLoraModel(unet, network, pipe).train()
    return SDXLLoraStep(model, optimizer=optimizer, accelerator=accelerator, max_grad_norm=1.0,
                        noise_scheduler=scheduler, v_prediction=False, min_snr_gamma=5.0, noise_offset=0.0357,
                        adaptive_noise_scale=0.00357, multires_iterations=None, multires_discount=0.3,
                        timestep_range=(0, 1000), prior_loss_weight=1.0, loss=LossFunction(),
                        debiased_estimation_loss=False, ip_noise_gamma=None, ip_noise_gamma_random_strength=False)


def count_flops(step: Callable[[], None]) -> float:
    """FLOPs of one training step (forward and backward), counted by PyTorch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="default: 64 tiny, 1024 full")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolution = args.resolution or (64 if args.size == "tiny" else 1024)
    b = args.batch_size
    torch.manual_seed(0)

    pipe = build_pipeline(args.size, device)
    scheduler = noise_math.training_scheduler(pipe.scheduler.config)
    network = create_network(pipe.unet, {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2},
                             SEED_NETWORK, train_text_encoder=False).train()
    pixels = torch.rand(b, 3, resolution, resolution, device=device) * 2 - 1
    captions = [f"a drawing of a blue and white pokemon number {i}" for i in range(b)]
    size = torch.tensor([[resolution, resolution]] * b)
    time_ids = sdxl.add_time_ids(size, torch.zeros(b, 2, dtype=torch.long), size).to(device)
    rows = []

    pipe.unet.enable_gradient_checkpointing()
    ref_optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=0.05)
    rows.append(("reference (seed 004: VAE + text every step, fp32, checkpointing)", *time_steps(
        lambda: reference_step(pipe, network, scheduler, ref_optimizer, pixels, captions, time_ids),
        args.steps, args.warmup, device)))

    with tempfile.TemporaryDirectory() as cache_dir:
        conditioner = sdxl.SDXLConditioner(pipe, device=device, encode_text=True,
                                           latent_cache=TensorCache(Path(cache_dir) / "latents", "bench"),
                                           text_cache=TensorCache(Path(cache_dir) / "text", "bench"))
        batch = {"pixel_values": pixels.cpu(), "pixel_items": list(range(b)), "latents": [None] * b,
                 "image_keys": [f"image{i}" for i in range(b)], "image_paths": [f"image{i}.png" for i in range(b)],
                 "captions": captions, "original_sizes": size,
                 "crop_top_lefts": torch.zeros(b, 2, dtype=torch.long), "target_sizes": size,
                 "is_reg": torch.zeros(b, dtype=torch.bool)}
        conditioner(batch)  # fills the caches, as the first epoch does
        cached = {**batch, "pixel_values": None, "pixel_items": [],
                  "latents": [None] * b}  # a later epoch: the data loader finds the entries and sends no pixels

        def ours(step: SDXLLoraStep) -> Callable[[], None]:
            return lambda: step(conditioner(cached))

        step = dreamstep_step(pipe.unet, network, scheduler, "no", pipe)
        rows.append(("dreamstep, seed flags (cached, fp32, checkpointing)",
                     *time_steps(ours(step), args.steps, args.warmup, device)))
        pipe.unet.disable_gradient_checkpointing()
        precision = "bf16" if device.type == "cuda" else "no"  # CPUs without bf16 units are slower in bf16
        if precision == "bf16":
            pipe.unet.to(torch.bfloat16)
        step = dreamstep_step(pipe.unet, network, scheduler, precision, pipe)
        rows.append((f"dreamstep, recommended (cached, {'bf16' if precision == 'bf16' else 'fp32'}, "
                     "no checkpointing)", *time_steps(ours(step), args.steps, args.warmup, device)))
        flops = count_flops(ours(step)) if args.size == "full" and device.type == "cuda" else None

    name = f"SDXL LoRA rank 256 ({args.size}, {resolution}x{resolution}, batch {b}, {device.type})"
    print(f"{name}\n  {'loop':<66}{'s/step':>9}{'peak MiB':>10}{'speed-up':>10}")
    for label, seconds, mib in rows:
        print(f"  {label:<66}{seconds:>9.4f}{mib:>10.0f}{rows[0][1] / seconds:>9.2f}x")
    if flops is not None:
        print(f"  model FLOPs/step (counted): {flops:.3g}   MFU vs 989 TFLOP/s bf16: "
              f"{flops / rows[-1][1] / H100_BF16_PEAK:.1%}   (seed on Ascend 910*: 1.73 s/step)")


if __name__ == "__main__":
    main()
