"""The Z-Image ComfyUI file at full size, on the meta device: every key a LoRA of every --lora_layers preset writes
is one ComfyUI's Z-Image loader maps, onto a slice of the released checkpoint's weight that has the LoRA's shape;
diffusers' own single-file converter agrees with that mapping; diffusers' Z-Image loader reads the file.

ComfyUI's rule, restated from ``comfy/lora.py`` (its Lumina2 branch) and ``comfy/utils.py``
(``z_image_to_diffusers``): in every block of ``layers``, ``noise_refiner`` and ``context_refiner``, the diffusers
module ``attention.to_q`` / ``to_k`` / ``to_v`` is rows [0, d) / [d, 2d) / [2d, 3d) of the released
``attention.qkv`` (d: the transformer's width), ``attention.to_out.0`` is ``attention.out``, and
``feed_forward.w1/w2/w3`` and ``adaLN_modulation.0`` keep their names; the LoRA's key is that module under
``diffusion_model.`` (or ``transformer.``), up and down as ``.lora_B.weight`` / ``.lora_A.weight``, scale alpha /
rank with a ``.alpha`` key, else 1.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

from dreamstep.lora.inject import add_lora
from dreamstep.models.memory_plan import build_on_meta
from dreamstep.models.z_image import configs
from dreamstep.models.z_image.lora_keys import COMFYUI_PREFIX, comfyui_state_dict
from dreamstep.models.z_image.lora_targets import Z_IMAGE_LORA_PRESETS, z_image_lora_targets
from dreamstep.models.z_image.tiny import build_tiny_z_image

_BLOCK = re.compile(r"^(layers|noise_refiner|context_refiner)\.(\d+)\.(.+)$")
_SAME_NAME = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0")


def comfyui_target(key: str, width: int) -> tuple[str, int, int | None] | None:
    """(released weight, first row, rows or None for all) that ComfyUI patches for a LoRA module key, or None
    when its loader maps no such key ("lora key not loaded")."""
    if not key.startswith((COMFYUI_PREFIX, "transformer.")):
        return None
    found = _BLOCK.match(key.split(".", 1)[1])
    if found is None:
        return None
    block, module = f"{found[1]}.{found[2]}", found[3]
    parts = {"attention.to_q": 0, "attention.to_k": 1, "attention.to_v": 2}
    if module in parts:
        return f"{block}.attention.qkv.weight", parts[module] * width, width
    if module == "attention.to_out.0":
        return f"{block}.attention.out.weight", 0, None
    if module in _SAME_NAME:
        return f"{block}.{module}.weight", 0, None
    return None


@pytest.fixture(scope="module")
def full_size() -> torch.nn.Module:
    from diffusers import ZImageTransformer2DModel

    return build_on_meta(ZImageTransformer2DModel, dict(configs.TRANSFORMER))


def _released_shapes(transformer: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The released checkpoint's block weights, as ComfyUI's rule lays diffusers' weights into them."""
    width = transformer.config.dim
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in transformer.named_parameters():
        target = comfyui_target(COMFYUI_PREFIX + name.removesuffix(".weight"), width) if name.endswith(".weight") \
            else None
        if target is not None:
            rows = 3 * width if target[0].endswith("qkv.weight") else param.shape[0]
            shapes[target[0]] = (rows, *param.shape[1:])
    return shapes


@pytest.mark.parametrize("preset", list(Z_IMAGE_LORA_PRESETS))
def test_every_comfyui_key_lands_on_a_slice_of_the_released_weight_at_full_size(full_size: torch.nn.Module,
                                                                                 preset: str) -> None:
    transformer = build_on_meta(type(full_size), dict(configs.TRANSFORMER))
    targets = z_image_lora_targets(transformer, [preset])
    add_lora(transformer, targets, rank=16, alpha=16)
    released = _released_shapes(full_size)
    width = full_size.config.dim
    modules = {name.removesuffix(".lora_A.default.weight"): param for name, param in transformer.named_parameters()
               if name.endswith(".lora_A.default.weight")}
    assert len(modules) == len(targets) > 0
    ups = {name.removesuffix(".lora_B.default.weight"): param for name, param in transformer.named_parameters()
           if name.endswith(".lora_B.default.weight")}
    file_keys = comfyui_state_dict({f"transformer.{m}.lora_A.weight": 0 for m in modules})
    covered: dict[str, int] = {}
    for key in file_keys:
        module = key.removesuffix(".lora_A.weight")
        target = comfyui_target(module, width)
        assert target is not None, f"ComfyUI does not map {key}"
        weight, first, rows = target
        diffusers_name = module.removeprefix(COMFYUI_PREFIX)
        up, down = ups[diffusers_name], modules[diffusers_name]
        assert released[weight][1:] == tuple(down.shape[1:]), key
        assert (rows or released[weight][0]) == up.shape[0], key
        assert first + up.shape[0] <= released[weight][0], key
        covered[weight] = covered.get(weight, 0) + up.shape[0]
    # q, k and v together fill the fused weight's rows exactly.
    assert all(covered[w] == released[w][0] for w in covered if w.endswith("qkv.weight"))
    assert sum(w.startswith("layers.") for w in covered) >= 30 * (2 if preset == "attention" else 1)


def _released_layout(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's block weights laid out by ComfyUI's rule into the released checkpoint's weights."""
    width = transformer.config.dim
    released: dict[str, torch.Tensor] = {}
    for name, param in transformer.named_parameters():
        target = comfyui_target(COMFYUI_PREFIX + name.removesuffix(".weight"), width)
        if target is None or not name.endswith(".weight"):
            continue
        weight, first, rows = target
        fused = released.setdefault(weight, torch.zeros((3 * width if rows else param.shape[0], *param.shape[1:]),
                                                        device=param.device))
        if param.device.type != "meta":
            fused[first:first + param.shape[0]] = param.detach()
    return released


def test_diffusers_single_file_converter_splits_qkv_as_comfyui_maps_it(full_size: torch.nn.Module) -> None:
    """A released-layout checkpoint built by ComfyUI's rule converts, with diffusers' own converter, back to every
    weight it came from: in the full-size model's shapes, and on the tiny model value for value (the two agree on
    the order of q, k and v in the fused rows, and on the names)."""
    converted = convert_z_image_transformer_checkpoint_to_diffusers(_released_layout(full_size))
    shapes = dict(full_size.named_parameters())
    assert converted and all(tuple(v.shape) == tuple(shapes[k].shape) for k, v in converted.items())
    assert sum(k.endswith("attention.to_v.weight") for k in converted) == 34
    tiny = build_tiny_z_image(seed=0).transformer
    values = dict(tiny.named_parameters())
    for name, value in convert_z_image_transformer_checkpoint_to_diffusers(_released_layout(tiny)).items():
        torch.testing.assert_close(value, values[name].detach(), rtol=0, atol=0)


def test_diffusers_reads_the_comfyui_file_as_the_diffusers_one(tmp_path: Path) -> None:
    pipe = build_tiny_z_image(seed=0)
    add_lora(pipe.transformer, z_image_lora_targets(pipe.transformer, ["all-linear"]), rank=4, alpha=4)
    generator = torch.Generator().manual_seed(3)
    state = {}
    for name, param in pipe.transformer.named_parameters():
        if ".lora_" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
            state["transformer." + name.replace(".default.weight", ".weight")] = param.data.clone()
    save_file(comfyui_state_dict(state), str(tmp_path / "comfyui.safetensors"))
    loaded, _ = ZImagePipeline.lora_state_dict(str(tmp_path / "comfyui.safetensors"), return_lora_metadata=True)
    assert set(loaded) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value)
