"""A tiny random FLUX.1 (and FLUX.1 Kontext) pipeline, and the single files ComfyUI and sd-scripts users have
(see :mod:`dreamstep.models.tiny` for what is kept from the real models)."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
from safetensors.torch import save_file
from transformers import CLIPTextModel

from dreamstep.files import honour_umask
from dreamstep.models import published_configs
from dreamstep.models.tiny import (
    build_clip_tokenizer,
    build_t5_tokenizer,
    clip_config,
    seeded,
    t5_encoder,
    tiny_vae,
    to_eval,
)


def _flux_scheduler(guidance_embeds: bool) -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's scheduler (resolution-dependent shift) or FLUX.1-schnell's (no shift)."""
    return FlowMatchEulerDiscreteScheduler(**(published_configs.FLUX_DEV_SCHEDULER if guidance_embeds
                                              else published_configs.FLUX_SCHNELL_SCHEDULER))



def build_tiny_flux(seed: int = 0, guidance_embeds: bool = False) -> FluxPipeline:
    """A random FLUX.1 pipeline with every block type of the real one, in fp32 on the CPU."""
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    with seeded(seed):
        text_encoder = CLIPTextModel(clip_config(tokenizer, "quick_gelu", 32, projection_dim=32))
        text_encoder_2 = t5_encoder(tokenizer_2)
        vae = tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False)
        # Rotary axes (text/time, height, width) must add up to the head dimension: 4 + 6 + 6 = 16.
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1,
            num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=text_encoder_2.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
        )
    pipe = FluxPipeline(scheduler=_flux_scheduler(guidance_embeds), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        transformer=transformer)
    to_eval(pipe)
    return pipe


def build_tiny_flux_kontext(seed: int = 0) -> FluxKontextPipeline:
    """A random FLUX.1 Kontext [dev] pipeline: the guidance-distilled tiny FLUX (Kontext [dev] has guidance
    embedding and FLUX.1-dev's scheduler) in a ``FluxKontextPipeline``."""
    flux = build_tiny_flux(seed=seed, guidance_embeds=True)
    return FluxKontextPipeline(**{name: getattr(flux, name) for name in (
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")})



def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as a file of ``dtype`` stores it: fp8 copies (sd-scripts', ComfyUI's) keep only matrices in fp8."""
    if dtype.itemsize == 1 and tensor.ndim != 2:
        dtype = torch.bfloat16
    return tensor.detach().to(dtype).contiguous()


# The storage dtypes of the files people download: flux1-dev and ae in bf16, clip_l and t5xxl_fp16 in fp16.
FLUX_FILE_DTYPES = {"transformer": torch.bfloat16, "ae": torch.bfloat16, "clip_l": torch.float16,
                    "t5xxl": torch.float16}


def write_flux_component_files(pipe: FluxPipeline, out_dir: str | Path,
                               dtypes: dict[str, torch.dtype] | None = None) -> dict[str, Path]:
    """Write a FLUX pipeline as the single files ComfyUI and sd-scripts users have, named like them:
    ``flux1.safetensors`` (the transformer in Black Forest Labs' layout), ``ae.safetensors`` (LDM layout),
    ``clip_l.safetensors`` and ``t5xxl.safetensors`` (transformers' keys, ``text_model.`` kept as ComfyUI's files
    have it), each stored in its :data:`FLUX_FILE_DTYPES` dtype unless ``dtypes`` says otherwise
    (``torch.float8_e4m3fn``: an fp8 copy). Returns the paths by sd-scripts' flag names (the transformer as
    "transformer")."""
    from dreamstep.models.flux.files import transformer_to_bfl
    from dreamstep.models.sdxl.sgm_keys import vae_to_ldm

    out_dir = Path(out_dir)
    clip = {k if k.startswith("text_model.") else f"text_model.{k}": v
            for k, v in pipe.text_encoder.state_dict().items()}
    dtypes = {**FLUX_FILE_DTYPES, **(dtypes or {})}
    parts = {
        "transformer": ("flux1.safetensors",
                        transformer_to_bfl(pipe.transformer.state_dict(), pipe.transformer.config)),
        "ae": ("ae.safetensors", vae_to_ldm(pipe.vae.state_dict(), pipe.vae.config)),
        "clip_l": ("clip_l.safetensors", clip),
        # The token embedding once ("shared"): transformers ties the encoder's to it on loading.
        "t5xxl": ("t5xxl.safetensors", {k: v for k, v in pipe.text_encoder_2.state_dict().items()
                                        if k != "encoder.embed_tokens.weight"}),
    }
    paths = {}
    for part, (name, state_dict) in parts.items():
        paths[part] = out_dir / name
        save_file({k: _stored(v, dtypes[part]) for k, v in state_dict.items()}, str(paths[part]),
                  metadata={"format": "pt"})
        honour_umask(paths[part])
    return paths


