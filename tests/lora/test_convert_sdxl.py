"""SDXL LoRA conversion Kohya (SGM names, lora_te1/lora_te2) <-> diffusers <-> MindSpore on the tiny model:
exact round trips, and diffusers' loader gives the hand-merged reference image for our files."""

from __future__ import annotations

import torch
from lora_testkit import inference_mode, loaded_image, merge_into, module_of, random_lora
from safetensors.torch import load_file

from dreamstep.lora.convert import (
    convert_lora,
    diffusers_state_dict,
    load_lora_as_diffusers,
    read_lora,
)
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import diffusers_adapter_metadata
from dreamstep.models.sdxl.tiny import build_tiny_sdxl

PROMPT = "a photo of sks robot"


def _names(pipe, keys) -> list[str]:
    """What sd-scripts adapts by default (the Linear layers of the UNet's attention blocks, CLIP attention
    and MLP), plus the first resnet's 3x3 convolutions (its conv LoRA)."""
    return [n for n in keys.by_diffusers
            if (".attentions." in n or n.startswith("text_encoder")) and isinstance(module_of(pipe, n), torch.nn.Linear)
            or n in ("unet.down_blocks.0.resnets.0.conv1", "unet.down_blocks.0.resnets.0.conv2")]


def _image(pipe) -> torch.Tensor:
    return pipe(PROMPT, num_inference_steps=2, height=64, width=64, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def test_round_trips_through_kohya_and_mindspore_are_exact(sdxl_pipe, sdxl_keys, tmp_path):
    ours = random_lora(sdxl_pipe, sdxl_keys, _names(sdxl_pipe, sdxl_keys), seed=0)
    src = tmp_path / "diffusers.safetensors"
    write_lora_file(src, diffusers_state_dict(ours), diffusers_adapter_metadata(ours), "safetensors")
    convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    kohya = read_lora(tmp_path / "kohya.safetensors")
    assert kohya.format == "kohya-sdxl"
    sgm = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    assert kohya.modules["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"] is not None
    assert {"lora_te1_text_model_encoder_layers_0_self_attn_q_proj", "lora_te2_text_model_encoder_layers_0_mlp_fc1",
            "lora_unet_input_blocks_1_0_in_layers_2"} <= set(kohya.modules)

    convert_lora(tmp_path / "kohya.safetensors", tmp_path / "mindspore.ckpt", "mindspore")
    mindspore = read_lora(tmp_path / "mindspore.ckpt")
    assert mindspore.format == "mindspore-sdxl" and mindspore.container == "mindspore"
    assert f"lora_unet.{sgm.removeprefix('unet.')}" in mindspore.modules

    convert_lora(tmp_path / "mindspore.ckpt", tmp_path / "back.safetensors", "diffusers")
    back = read_lora(tmp_path / "back.safetensors").modules
    assert sorted(back) == sorted(ours)
    for name, m in ours.items():  # a diffusers-layout file holds alpha / rank folded into lora_B (exact here)
        assert torch.equal(back[name].down, m.down) and torch.equal(back[name].up, m.up * m.scale), name
        assert back[name].alpha == m.rank, name


def _reference_image(modules) -> torch.Tensor:
    reference = inference_mode(build_tiny_sdxl(seed=0))
    merge_into(reference, modules)
    return _image(reference)


def test_diffusers_loads_our_files_as_the_merged_reference(sdxl_pipe, sdxl_keys, tmp_path):
    ours = random_lora(sdxl_pipe, sdxl_keys, _names(sdxl_pipe, sdxl_keys), seed=1)
    src = tmp_path / "diffusers.safetensors"
    write_lora_file(src, diffusers_state_dict(ours), diffusers_adapter_metadata(ours), "safetensors")
    convert_lora(src, tmp_path / "kohya.ckpt", "kohya")
    state_dict, _ = load_lora_as_diffusers(tmp_path / "kohya.ckpt", "sdxl")
    # Our diffusers-layout file: the UNet in diffusers' older attention-processor names (ComfyUI's only map).
    converted = tmp_path / "converted.safetensors"
    convert_lora(tmp_path / "kohya.ckpt", converted, "diffusers")
    assert any(k.endswith(".processor.to_q_lora.down.weight") for k in load_file(converted))

    base = _image(sdxl_pipe)
    expected = _reference_image(ours)
    assert (expected - base).abs().max() > 1e-2  # the LoRA changes the image
    for source in (src, state_dict, converted):
        torch.testing.assert_close(loaded_image(sdxl_pipe, source, _image), expected, atol=2e-4, rtol=0)


def test_diffusers_loads_our_kohya_file_as_the_merged_reference(sdxl_pipe, sdxl_keys, tmp_path):
    # One rank and alpha for every module, as sd-scripts writes them (--network_dim, --network_alpha):
    # diffusers 0.42's own Kohya SDXL reader drops per-module alphas (its alpha_pattern keys match nothing).
    ours = random_lora(sdxl_pipe, sdxl_keys, _names(sdxl_pipe, sdxl_keys), seed=2,
                       scale_of=lambda kohya_index, part: 0.5, rank=4)
    src = tmp_path / "diffusers.safetensors"
    write_lora_file(src, diffusers_state_dict(ours), diffusers_adapter_metadata(ours), "safetensors")
    convert_lora(src, tmp_path / "kohya.safetensors", "kohya")
    torch.testing.assert_close(loaded_image(sdxl_pipe, tmp_path / "kohya.safetensors", _image), _reference_image(ours),
                               atol=2e-4, rtol=0)
