"""The Krea 2 ComfyUI file at full size, on the meta device: every key a LoRA of every --lora_layers preset writes
names a weight of the released checkpoint (``diffusion_model.`` + krea-ai's module names, which ComfyUI maps as they
are, ``comfy/utils.krea2_to_diffusers``) with the LoRA's shape, and diffusers' Krea 2 loader maps every one back
onto the module it was trained on."""

from __future__ import annotations

import pytest
import torch
from diffusers import Krea2Transformer2DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

from dreamstep.lora.inject import add_lora
from dreamstep.models.krea2 import configs
from dreamstep.models.krea2.lora_keys import COMFYUI_PREFIX, comfyui_state_dict, released_names
from dreamstep.models.krea2.lora_targets import KREA2_LORA_PRESETS, krea2_lora_targets
from dreamstep.models.memory_plan import build_on_meta


@pytest.mark.parametrize("preset", list(KREA2_LORA_PRESETS))
def test_every_comfyui_key_is_a_released_weight_of_the_lora_shape(preset: str) -> None:
    transformer = build_on_meta(Krea2Transformer2DModel, dict(configs.TRANSFORMER))
    shapes = {name.removesuffix(".weight"): tuple(p.shape) for name, p in transformer.named_parameters()}
    # The released checkpoint's weights, by the released names of diffusers' modules (nothing is fused).
    released = {COMFYUI_PREFIX + theirs: shapes[ours] for ours, theirs in released_names().items()}
    targets = krea2_lora_targets(transformer, [preset])
    add_lora(transformer, targets, rank=16, alpha=16)
    params = dict(transformer.named_parameters())
    state = {f"transformer.{m}.lora_{ab}.weight": params[f"{m}.lora_{ab}.default.weight"]
             for m in targets for ab in "AB"}
    comfy = comfyui_state_dict(state)
    assert len(comfy) == 2 * len(targets) > 0
    for key, value in comfy.items():
        module, _, role = key.rpartition(".lora_")
        weight = released[module]  # KeyError: ComfyUI has no such weight
        assert (value.shape[1] == weight[1]) if role.startswith("A") else (value.shape[0] == weight[0]), key
    back = _convert_non_diffusers_krea2_lora_to_diffusers(dict(comfy))
    assert set(back) == set(state)
    assert sum(k.startswith(f"{COMFYUI_PREFIX}blocks.27.") for k in comfy) >= 8


def test_the_released_transformer_is_the_12b_of_the_issue() -> None:
    transformer = build_on_meta(Krea2Transformer2DModel, dict(configs.TRANSFORMER))
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 1) == 12.8
    assert isinstance(transformer.transformer_blocks[0].attn.to_q, torch.nn.Linear)


def test_an_attention_only_krea2_lora_is_told_from_flux1_by_its_full_size_shapes(tmp_path) -> None:
    from dreamstep.lora.convert import read_lora
    from dreamstep.lora.info import describe
    from dreamstep.lora.io import write_lora_file
    from dreamstep.models.full_size import weight_shapes

    shapes = weight_shapes("krea2", None)
    modules = [f"transformer.transformer_blocks.{i}.attn.{p}" for i in (0, 1) for p in ("to_q", "to_k", "to_v")]
    assert all(m in weight_shapes("flux", None) for m in modules)  # FLUX.1 has these names too, 3072 wide
    tensors = {}
    for module in modules:
        out_features, in_features = shapes[module]
        tensors[f"{module}.lora_A.weight"] = torch.zeros(2, in_features)
        tensors[f"{module}.lora_B.weight"] = torch.zeros(out_features, 2)
    path = tmp_path / "krea2_attention.safetensors"
    write_lora_file(path, tensors, {"format": "pt"}, "safetensors")
    assert read_lora(path).model == "krea2"
    assert "target:    Krea 2" in describe(str(path))
