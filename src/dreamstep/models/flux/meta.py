"""FLUX.1 on the meta device: its components for the memory plan, the transformer's training pass as the trainers
call it, and the full-size parts whose weight shapes check a LoRA file."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models import published_configs as published


def meta_components(folder: Path | None) -> dict[str, nn.Module]:
    """The FLUX.1 components on the meta device, from ``folder``'s configs or FLUX.1-dev's."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    return mp.components_on_meta(folder, {
        "transformer": (FluxTransformer2DModel, published.FLUX_DEV_TRANSFORMER),
        "text_encoder_2": (T5EncoderModel, published.T5_XXL_ENCODER),
        "text_encoder": (CLIPTextModel, published.CLIP_L_TEXT),
        "vae": (AutoencoderKL, published.FLUX_VAE),
    })


def training_pass(transformer: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool = True,
                  image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                  ) -> Callable[[], torch.Tensor | None]:
    """One forward of the transformer (fed by a ControlNet ``trainable``'s residuals when given) at ``resolution``
    (FLUX packs 2x2 latent patches: a 1024 px image is 64 x 64 tokens, times ``image_token_multiplier`` for a model
    that reads condition images' tokens beside the target's), returning a loss when ``train``. The inputs are in the
    transformer's dtype, as the trainer casts its cached latents and embeddings and the pipeline makes them; σ and
    the guidance as each gives them (the trainer: fp32)."""
    config = transformer.config
    tokens = (resolution // 16) ** 2 * image_token_multiplier

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(transformer)
        time_dtype = torch.float32 if train else dtype
        inputs = dict(
            hidden_states=torch.empty(batch, tokens, config.in_channels, dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config.joint_attention_dim, dtype=dtype),
            pooled_projections=torch.empty(batch, config.pooled_projection_dim, dtype=dtype),
            timestep=torch.empty(batch, dtype=time_dtype), img_ids=torch.empty(tokens, 3),
            txt_ids=torch.empty(text_tokens, 3),
            guidance=torch.empty(batch, dtype=time_dtype) if config.guidance_embeds else None, return_dict=False)
        residuals = {}
        if trainable is not None:
            double, single = trainable(controlnet_cond=torch.empty_like(inputs["hidden_states"]), **inputs)
            residuals = {"controlnet_block_samples": double, "controlnet_single_block_samples": single}
        out = transformer(**inputs, **residuals)[0]
        if train and not out.requires_grad:  # only a text encoder trains (flux-kohya's
            for name in ("encoder_hidden_states", "pooled_projections"):  # --network_train_text_encoder_only): the
                inputs[name].requires_grad_(True)  # loss reaches it back through the transformer's text inputs
            out = transformer(**inputs, **residuals)[0]
        return (out.float() - torch.empty_like(out, dtype=torch.float32)).pow(2).mean() if train else None

    return run


def released_components(configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The transformer, CLIP-L and T5 built empty from ``configs``."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with init_empty_weights():
        return {"transformer": FluxTransformer2DModel.from_config(_clean(configs["transformer"])),
                "text_encoder": CLIPTextModel(CLIPTextConfig(**_clean(configs["text_encoder"]))),
                "text_encoder_2": T5EncoderModel(T5Config(**_clean(configs["text_encoder_2"])))}


def _clean(config: Mapping) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}
