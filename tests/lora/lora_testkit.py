"""Random LoRAs and their merged deltas for the conversion tests.

A random LoRA gets one scale (alpha / rank) per Kohya module, so the parts of a fused FLUX module share it,
and ranks that differ between modules, so alphas differ too and go through PEFT's alpha_pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dreamstep.lora.convert import LoraWeights
from dreamstep.models.lora_keys import ModelKeys

# Two small checkpoints written by the MindSpore port (mindone), fp32 and fp16, shipped with the tests.
MINDSPORE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "mindspore"
SCALES = (0.5, 1.0, 2.0)


def module_of(pipe, name: str) -> torch.nn.Module:
    """The pipeline module a diffusers LoRA name adapts (transformers >= 5 has no CLIPTextModel.text_model)."""
    component, _, path = name.partition(".")
    model = getattr(pipe, component)
    if not hasattr(model, "text_model"):
        path = path.removeprefix("text_model.")
    return model.get_submodule(path)


def random_lora(pipe, keys: ModelKeys, names: list[str], seed: int,
                scale_of: Callable[[int, int], float] | None = None, rank: int | None = None) -> dict[str, LoraWeights]:
    """Random diffusers-named LoRA modules for ``names``; ``scale_of(kohya index, part index)``; one
    ``rank`` for all, or ranks 2, 3, 4 in turn."""
    g = torch.Generator().manual_seed(seed)
    kohya_index = {n: i for i, m in enumerate(keys.maps) for n in m.diffusers}
    out = {}
    for n, name in enumerate(names):
        layer = module_of(pipe, name)
        r = rank or 2 + n % 3
        weight = layer.weight
        down = torch.randn(r, *weight.shape[1:], generator=g) * 0.2
        up = torch.randn(weight.shape[0], r, *([1] * (weight.dim() - 2)), generator=g) * 0.2
        part = keys.by_diffusers[name].diffusers.index(name)
        scale = scale_of(kohya_index[name], part) if scale_of else SCALES[kohya_index[name] % 3]
        out[name] = LoraWeights(down, up, r * scale)
    return out


def delta(m: LoraWeights) -> torch.Tensor:
    """The merged weight change alpha / rank * up @ down, in float64, shaped like the weight."""
    down = m.down.double().flatten(1)
    up = m.up.double().flatten(1)
    return (m.scale * (up @ down)).reshape(m.up.shape[0], *m.down.shape[1:])


def merge_into(pipe, modules: dict[str, LoraWeights]) -> None:
    """Add each module's delta to its weight: the reference a LoRA loader must reproduce."""
    with torch.no_grad():
        for name, m in modules.items():
            weight = module_of(pipe, name).weight
            weight += delta(m).to(weight.dtype)


def inference_mode(pipe):
    """The pipeline with every model in eval mode (modules built in-process start in train mode, where the
    text encoders' dropout makes two identical calls differ)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def loaded_image(pipe, source, render: Callable[[object], torch.Tensor]) -> torch.Tensor:
    """``render(pipe)`` with ``source`` (a file, or a state dict) loaded by diffusers, which is then unloaded."""
    if isinstance(source, dict):
        pipe.load_lora_weights(source)
    else:
        pipe.load_lora_weights(source.parent, weight_name=source.name)
    try:
        return render(pipe)
    finally:
        pipe.unload_lora_weights()
