"""Qwen-Image LoRA step time and peak memory: dreamstep's trainer step against diffusers'
``train_dreambooth_lora_qwen_image.py`` loop at its defaults, in one run, on the same model.

The reference does what the script's loop does each step at its defaults (no --cache_latents): VAE-encode the batch
as a one-frame video, sample the posterior and normalise it by the latents mean / std, noise, uniform timesteps and
their σ looked up one by one in the scheduler's table, the permuted packing, the transformer with the prompt
embeddings joined as the script joins them, unpack, the weighted loss, backward, clip, optimizer and LR steps (the
instance prompt's embedding is computed once, as the script does). dreamstep's step reads the cached posterior and
prompt embeddings and runs through the TrainStep engine (fused AdamW, no host syncs). Both train the same LoRA
(rank 4, the script's to_k, to_q, to_v, to_out.0) on the same tiny model.

The loops take turns step by step, so a slow spell of a shared machine slows them alike; s/step is the median. A
last row runs the reference on the cached posterior: its own step without the VAE, the most that caching latents
alone gains over it.

    python benchmarks/qwen_image_lora.py                    # tiny model, 512 px (the script's default resolution)
    python benchmarks/qwen_image_lora.py --resolution 256
"""

from __future__ import annotations

import argparse
import copy

import torch
from diffusers import QwenImagePipeline
from diffusers.optimization import get_scheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from measure import time_alternating, time_steps

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.precision import cast_trainable_params_to_fp32, freeze
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.tiny import build_tiny_qwen_image
from dreamstep.models.vae import sample_latents
from dreamstep.recipes.qwen_image_lora import QwenImageLoraStep

PROMPT = "a photo of sks robot"


class Reference:
    """The script's loop body at its defaults (fp32 here; --mixed_precision bf16 on a GPU)."""

    def __init__(self, pipe: QwenImagePipeline, params: list[torch.nn.Parameter], pixels: torch.Tensor,
                 text: tuple[torch.Tensor, torch.Tensor | None], autocast: torch.autocast):
        self.pipe, self.pixels, self.text, self.autocast = pipe, pixels, text, autocast
        self.scheduler = copy.deepcopy(type(pipe.scheduler).from_config(pipe.scheduler.config, shift=3.0))
        vae = pipe.vae
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
        self.latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
        self.lr_scheduler = get_scheduler("constant", optimizer=self.optimizer, num_warmup_steps=500,
                                          num_training_steps=1000)
        self.params = params

    def __call__(self, latent_dist: torch.Tensor | None = None) -> None:
        vae, transformer = self.pipe.vae, self.pipe.transformer
        prompt_embeds, prompt_embeds_mask = self.text
        if latent_dist is None:
            with torch.no_grad():
                model_input = vae.encode(self.pixels.unsqueeze(2)).latent_dist.sample()
            model_input = (model_input - self.latents_mean) * self.latents_std
        else:  # the cached posterior (normalised already): the same loop without the VAE
            model_input = sample_latents(latent_dist).unsqueeze(2)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(weighting_scheme="none", batch_size=bsz, logit_mean=0.0,
                                                  logit_std=1.0, mode_scale=1.29)
        indices = (u * self.scheduler.config.num_train_timesteps).long()
        timesteps = self.scheduler.timesteps[indices]
        step_indices = [(self.scheduler.timesteps == t).nonzero().item() for t in timesteps]
        sigmas = self.scheduler.sigmas[step_indices].flatten().view(-1, 1, 1, 1, 1)
        noisy = ((1.0 - sigmas) * model_input + sigmas * noise).permute(0, 2, 1, 3, 4)
        height, width = model_input.shape[3], model_input.shape[4]
        packed = QwenImagePipeline._pack_latents(noisy, bsz, model_input.shape[1], height, width)
        with self.autocast:
            pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds,
                               encoder_hidden_states_mask=prompt_embeds_mask, timestep=timesteps / 1000,
                               img_shapes=[(1, height // 2, width // 2)] * bsz, return_dict=False)[0]
        pred = QwenImagePipeline._unpack_latents(pred, height * 8, width * 8, 8)
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(bsz, -1), 1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolution", type=int, default=512, help="the script's default")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    torch.manual_seed(0)
    pipe = build_tiny_qwen_image(seed=0).to(device)
    freeze(pipe.transformer, pipe.vae, pipe.text_encoder)
    add_lora(pipe.transformer, qwen_image_lora_targets(pipe.transformer, ["attention"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    pipe.transformer.train()
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    b = args.batch_size
    pixels = torch.rand(b, 3, args.resolution, args.resolution, device=device) * 2 - 1
    embeds, mask = pipe.encode_prompt(prompt=PROMPT, device=device, max_sequence_length=512)
    reference = Reference(pipe, params, pixels, (embeds.repeat(b, 1, 1), mask), autocast)
    cached = qwen.batch_text(qwen.encode_prompts(pipe, [PROMPT] * b, 512), device)
    batch = {"latent_dist": qwen.encode_posterior(pipe.vae, pixels), "is_reg": torch.zeros(b, dtype=torch.bool),
             **cached}  # the posterior and the embeddings come from the caches in training
    step = QwenImageLoraStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                             accelerator=make_accelerator(mixed_precision="bf16" if device.type == "cuda" else "no"),
                             max_grad_norm=1.0, sigmas=qwen.training_sigmas(pipe.scheduler),
                             objective=FlowMatchingObjective())

    def ours() -> None:
        step(batch)

    def reference_cached() -> None:
        reference(batch["latent_dist"])

    _, ref_mem = time_steps(reference, args.steps, args.warmup, device)
    _, ours_mem = time_steps(ours, args.steps, args.warmup, device)
    ref_time, ours_time, cached_time = time_alternating([reference, ours, reference_cached], args.steps,
                                                        args.warmup, device)
    name = f"Qwen-Image LoRA (tiny, {args.resolution}x{args.resolution}, batch {b}, {device.type})"
    print(f"{name}\n{'':2}{'loop':<44}{'s/step':>10}{'peak MiB':>12}{'speed-up':>10}")
    print(f"{'':2}{'reference (the script: VAE every step)':<44}{ref_time:>10.4f}{ref_mem:>12.0f}")
    print(f"{'':2}{'dreamstep step (cached latents)':<44}{ours_time:>10.4f}{ours_mem:>12.0f}"
          f"{ref_time / ours_time:>9.2f}x")
    print(f"{'':2}{'reference without its VAE (the ceiling)':<44}{cached_time:>10.4f}{'':>12}"
          f"{ref_time / cached_time:>9.2f}x")
    print(f"  memory ratio: {ours_mem / ref_mem:.2f}")


if __name__ == "__main__":
    main()
