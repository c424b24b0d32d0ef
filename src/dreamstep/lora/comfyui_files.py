"""The names of the LoRA files a trainer writes, and ComfyUI's layout for a model whose weights ComfyUI names as
diffusers does, under ``diffusion_model.`` (Qwen-Image's).

For such a model ComfyUI's LoRA key map takes
``diffusion_model.<module>`` (the generic form), ``<module>``, ``transformer.<module>`` and
``lora_unet_<module with _>``, each with ``.lora_down.weight`` / ``.lora_up.weight`` and ``.alpha``. The ComfyUI file
is the first form, with the trained alpha (no folding needed: ComfyUI applies alpha / rank); diffusers' loader
reads it too (``_convert_non_diffusers_qwen_lora_to_diffusers`` drops the prefix and folds the alphas).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dreamstep.lora.inject import lora_modules
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import LoraWeights, kohya_state_dict

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' layout: lora.inject.save_flux_lora writes it
EMA_WEIGHT_NAME = "pytorch_lora_weights_ema.safetensors"
KOHYA_WEIGHT_NAME = "pytorch_lora_weights_kohya.safetensors"
COMFYUI_WEIGHT_NAME = "pytorch_lora_weights_comfyui.safetensors"
COMFYUI_PREFIX = "diffusion_model."


def comfyui_modules(transformer: torch.nn.Module) -> dict[str, LoraWeights]:
    """The trained LoRA under ComfyUI's names (``diffusion_model.transformer_blocks.0.attn.to_q``)."""
    return {COMFYUI_PREFIX + name.removeprefix("transformer."): weights
            for name, weights in lora_modules(transformer, "transformer").items()}


def save_comfyui_lora(out_dir: str | Path, transformer: torch.nn.Module,
                      weight_name: str = COMFYUI_WEIGHT_NAME) -> Path:
    """``out_dir/weight_name`` in ComfyUI's layout (fp32 tensors, ``.alpha`` per module)."""
    path = Path(out_dir) / weight_name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_lora_file(path, kohya_state_dict(comfyui_modules(transformer)), {"format": "pt"}, "safetensors")
    return path
