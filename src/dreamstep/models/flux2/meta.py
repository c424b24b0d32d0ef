"""FLUX.2 on the meta device: its components for the memory plan, the transformer's training pass as the trainer
calls it, and the full-size parts whose weight shapes check a LoRA file."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from dreamstep.models import memory_plan as mp
from dreamstep.models.flux2 import published


def meta_components(folder: Path | None, dev_without_folder: bool = False) -> dict[str, nn.Module]:
    """The FLUX.2 components on the meta device, from ``folder``'s configs ([dev]'s Mistral encoder when its
    model_index.json names it); without a folder, [dev]'s published configs (``dev_without_folder``: ``plan
    flux2``) or [klein] 4B's."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3ForConditionalGeneration, Qwen3ForCausalLM

    dev = (_text_encoder_class(folder) == Mistral3ForConditionalGeneration.__name__
           or (folder is None and dev_without_folder))
    return mp.components_on_meta(folder, {
        "transformer": (Flux2Transformer2DModel, published.DEV_TRANSFORMER if dev else published.KLEIN_4B_TRANSFORMER),
        "text_encoder": ((Mistral3ForConditionalGeneration, published.MISTRAL_SMALL_3_1) if dev
                         else (Qwen3ForCausalLM, published.QWEN3_4B)),
        "vae": (AutoencoderKLFlux2, published.VAE),
    })


def _text_encoder_class(folder: Path | None) -> str | None:
    index = folder / "model_index.json" if folder is not None else None
    if index is None or not index.is_file():
        return None
    entry = json.loads(index.read_text(encoding="utf-8")).get("text_encoder")
    return entry[1] if isinstance(entry, list) and len(entry) == 2 else None


def training_pass(transformer: nn.Module, *, resolution: int, batch: int, text_tokens: int, train: bool = True,
                  image_token_multiplier: int = 1, trainable: nn.Module | None = None,
                  ) -> Callable[[], torch.Tensor | None]:
    """One forward of the transformer at ``resolution`` (a 1024 px image is 64 x 64 tokens of 2x2 latent patches,
    times ``image_token_multiplier`` with reference images beside the target), returning a loss when ``train``:
    the inputs in the transformer's dtype (the trainer casts its cached ones; σ and the guidance as each gives them,
    the trainer's fp32) under autocast, or the pipeline's."""
    config = transformer.config
    tokens = (resolution // 16) ** 2 * image_token_multiplier

    def run() -> torch.Tensor | None:
        dtype = mp.input_dtype(transformer)
        time_dtype = torch.float32 if train else dtype
        out = transformer(
            hidden_states=torch.empty(batch, tokens, config.in_channels, dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config.joint_attention_dim, dtype=dtype),
            timestep=torch.empty(batch, dtype=time_dtype), img_ids=torch.empty(batch, tokens, 4, dtype=torch.long),
            txt_ids=torch.empty(batch, text_tokens, 4, dtype=torch.long),
            guidance=torch.empty(batch, dtype=time_dtype) if config.guidance_embeds else None, return_dict=False)[0]
        return (out.float() - torch.empty_like(out, dtype=torch.float32)).pow(2).mean() if train else None

    return run


def released_components(configs: Mapping[str, Mapping]) -> dict[str, nn.Module]:
    """The transformer built empty from ``configs`` (the text encoder has no LoRA in the FLUX.2 trainers)."""
    from accelerate import init_empty_weights
    from diffusers import Flux2Transformer2DModel

    with init_empty_weights():
        return {"transformer": Flux2Transformer2DModel.from_config(
            {k: v for k, v in configs["transformer"].items() if not k.startswith("_")})}
