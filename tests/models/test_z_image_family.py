"""The Z-Image family: ``tiny-model z-image`` writes a folder ZImagePipeline loads and samples from, its key tables
name layers of the released Z-Image at full size, and LoRA names tell it from the other families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import ZImagePipeline

from dreamstep.errors import UserError
from dreamstep.models.family import family_of_pipeline, get_family, guess_family
from dreamstep.models.full_size import built_released_shapes, weight_shapes
from dreamstep.models.tiny import write_tiny_model
from dreamstep.models.z_image import configs
from dreamstep.models.z_image.lora_keys import COMFYUI_PREFIX


def test_tiny_model_loads_in_z_image_pipeline_and_samples(tmp_path: Path) -> None:
    folder = write_tiny_model("z-image", tmp_path / "tiny")
    pipe = ZImagePipeline.from_pretrained(folder)
    embeds, _ = pipe.encode_prompt("a photo of sks dog", device="cpu", do_classifier_free_guidance=False,
                                   max_sequence_length=32)
    # The chat template wraps the prompt; the caption features are the unpadded tokens only.
    chat = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "a photo of sks dog"}], tokenize=False,
                                              add_generation_prompt=True)
    assert chat.startswith("<|im_start|>user\na photo of sks dog<|im_end|>")
    assert embeds[0].shape == (len(pipe.tokenizer(chat).input_ids), pipe.text_encoder.config.hidden_size)
    image = pipe("a photo of sks dog", height=32, width=48, num_inference_steps=2, guidance_scale=0.0,
                 max_sequence_length=32, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (48, 32)


def test_tiny_model_has_no_single_files_or_guidance_variant(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--single_file"):
        write_tiny_model("z-image", tmp_path / "a", single_file=True)
    with pytest.raises(UserError, match="--guidance_embeds"):
        write_tiny_model("z-image", tmp_path / "b", guidance_embeds=True)


def test_key_tables_name_every_adapted_layer_of_the_released_model() -> None:
    family = get_family("z-image")
    shapes = weight_shapes("z-image")
    assert shapes == built_released_shapes("z-image")  # the shipped table is the meta-device build's
    keys = family.lora_keys(None)
    named = {m for entry in keys.maps for m in entry.diffusers if not m.startswith(COMFYUI_PREFIX)}
    assert {m for entry in keys.maps for m in entry.diffusers} - named == {COMFYUI_PREFIX + m.removeprefix(
        "transformer.") for m in named if m.startswith("transformer.")}  # ComfyUI's names of the same modules
    assert named <= set(shapes), sorted(named - set(shapes))[:3]
    # Every Linear of every block has a row: 30 main + 2 noise refiner blocks with modulation, 2 context refiners
    # without; q, k, v fused in the released layout.
    blocks = [n for n in shapes if n.startswith(("transformer.layers.", "transformer.noise_refiner.",
                                                  "transformer.context_refiner."))]
    assert set(blocks) <= named
    assert len({e.kohya for e in keys.maps if e.kohya.endswith("attention_qkv")}) == 34
    assert keys.by_kohya["lora_unet_layers_0_attention_qkv"].diffusers[0] == "transformer.layers.0.attention.to_q"
    assert shapes["transformer.layers.0.attention.to_q"] == (configs.TRANSFORMER["dim"],) * 2
    # ComfyUI's file names the same layers (lora info checks it against these shapes).
    assert shapes[f"{COMFYUI_PREFIX}layers.0.feed_forward.w1"] == shapes["transformer.layers.0.feed_forward.w1"]


def test_pipeline_classes_and_lora_names_tell_z_image() -> None:
    assert family_of_pipeline("ZImagePipeline").name == "z-image"
    assert guess_family(["transformer.layers.0.attention.to_q", "transformer.noise_refiner.0.attention.to_k"])[0] \
        == "z-image"
    assert guess_family([f"{COMFYUI_PREFIX}layers.3.feed_forward.w1"])[0] == "z-image"
    assert guess_family(["lora_unet_layers_0_attention_qkv"])[0] == "z-image"
    assert guess_family(["transformer.transformer_blocks.0.attn.to_q"])[0] == "flux"
    assert guess_family(["lora_unet_double_blocks_0_img_attn_qkv"])[0] == "flux"
