"""Z-Image on the meta device: its components for the memory plan, the transformer's training pass as the trainer
calls it, and the full-size parts whose weight shapes check a LoRA file."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models.z_image import configs


def meta_components(folder: Path | None) -> dict[str, nn.Module]:
    """The Z-Image components on the meta device, from ``folder``'s configs or the released model's."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    return mp.components_on_meta(folder, {
        "transformer": (ZImageTransformer2DModel, configs.TRANSFORMER),
        "text_encoder": (Qwen3Model, _clean(configs.TEXT_ENCODER)),
        "vae": (AutoencoderKL, configs.VAE),
    })


def training_pass(transformer: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool = True,
                  image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                  ) -> Callable[[], torch.Tensor | None]:
    """One forward of the transformer at ``resolution`` (8x VAE, 2x2 patches: a 1024 px image is 64 x 64 tokens)
    with ``text_tokens`` caption tokens per sample, fed as the trainer feeds it: lists of per-sample latents
    (C, 1, h, w) and caption features (S, D) in the transformer's dtype (the timestep in fp32 when ``train``, as the
    trainer gives it), returning a loss when ``train``."""
    config = transformer.config
    side = resolution // 8

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(transformer)
        latents = [torch.empty(config.in_channels, 1, side, side * image_token_multiplier, dtype=dtype)
                   for _ in range(batch)]
        captions = [torch.empty(text_tokens, config.cap_feat_dim, dtype=dtype) for _ in range(batch)]
        timestep = torch.empty(batch, dtype=torch.float32 if train else dtype)
        out = torch.stack(transformer(latents, timestep, captions, return_dict=False)[0])
        return (out.float() - torch.empty_like(out, dtype=torch.float32)).pow(2).mean() if train else None

    return run


def released_components(configs_: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The transformer and the Qwen3 text encoder built empty from ``configs_``, the transformer also under the
    name ComfyUI's files give it (``diffusion_model``)."""
    from accelerate import init_empty_weights
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    with init_empty_weights():
        transformer = ZImageTransformer2DModel.from_config(_clean(configs_["transformer"]))
        text_encoder = Qwen3Model(Qwen3Config(**_clean(configs_["text_encoder"])))
    # The transformer under ComfyUI's prefix too: its files name the same modules so (lora_keys.COMFYUI_PREFIX).
    return {"transformer": transformer, "text_encoder": text_encoder, "diffusion_model": transformer}


def _clean(config: Mapping) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
