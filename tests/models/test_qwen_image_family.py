"""Qwen-Image as a registered family: its facts, its key tables at full size, LoRA names that tell it from FLUX.1,
and its tiny pipelines (text-to-image and Edit) as diffusers loads and runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.models.family import ModelFamily, family_of_pipeline, get_family, guess_family
from dreamstep.models.full_size import built_released_shapes, weight_shapes
from dreamstep.models.qwen_image.vl_processor import ImageTextProcessor, image_text_processor
from dreamstep.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-qwen")
    return {variant: write_tiny_model(variant, root / variant) for variant in ("qwen-image", "qwen-image-edit")}


def test_the_family_is_registered_with_the_protocols_members() -> None:
    found = get_family("qwen-image")
    assert isinstance(found, ModelFamily)
    assert found.denoiser in found.component_labels and found.long_text_encoder in found.component_labels
    assert family_of_pipeline("QwenImageEditPlusPipeline") is found
    assert found.variants == {"qwen-image": 1, "qwen-image-edit": 2}


def test_key_tables_name_every_linear_of_the_released_transformer() -> None:
    keys = get_family("qwen-image").lora_keys(None)
    shapes = weight_shapes("qwen-image")
    assert {m for entry in keys.maps for m in entry.diffusers} == set(shapes)  # 60 blocks x 14 + 6, no more
    assert len(shapes) == 60 * 14 + 6
    assert shapes["transformer.transformer_blocks.59.img_mlp.net.0.proj"] == (4 * 3072, 3072)


def test_the_shipped_shapes_are_the_built_ones() -> None:
    assert weight_shapes("qwen-image") == built_released_shapes("qwen-image")


@pytest.mark.parametrize("name", [
    "transformer.transformer_blocks.0.img_mlp.net.2",  # diffusers / PEFT, feed-forward
    "transformer.transformer_blocks.42.attn.to_q",  # diffusers, attention only, past FLUX's 19 double blocks
    "diffusion_model.transformer_blocks.0.attn.to_q",  # ComfyUI's layout
    "lora_unet_transformer_blocks_0_attn_to_q",  # Kohya's (musubi-tuner's) layout
    "transformer_blocks.3.txt_mod.1",  # ai-toolkit without a prefix
])
def test_qwen_image_lora_names_tell_their_family(name: str) -> None:
    assert guess_family([name])[0] == "qwen-image"


@pytest.mark.parametrize("name", ["transformer.single_transformer_blocks.0.attn.to_q",
                                  "transformer.transformer_blocks.0.attn.to_q",
                                  "lora_unet_double_blocks_0_img_attn_qkv",
                                  "transformer.transformer_blocks.18.ff.net.2"])
def test_flux_lora_names_stay_flux(name: str) -> None:
    assert guess_family([name])[0] == "flux"


def test_what_qwen_image_has_not_is_one_line() -> None:
    found = get_family("qwen-image")
    with pytest.raises(UserError, match="--guidance_embeds: qwen-image has no guidance-distilled kind"):
        found.build_tiny("qwen-image", seed=0, guidance_embeds=True)
    with pytest.raises(UserError, match="--single_file"):
        write_tiny_model("qwen-image", Path("unused"), single_file=True)


def test_tiny_qwen_image_loads_in_diffusers_and_samples(tiny_folders: dict[str, Path]) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny_folders["qwen-image"])
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.z_dim == 64
    assert 2 ** len(pipe.vae.temperal_downsample) == 8
    image = pipe("a photo of sks dog", height=32, width=48, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 32, 48, 3) and np.isfinite(image).all()


def _picture(colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (48, 32), colour)


def test_tiny_qwen_image_edit_loads_with_the_processor_that_needs_no_torchvision(tiny_folders: dict[str, Path]) -> None:
    folder = tiny_folders["qwen-image-edit"]
    processor = image_text_processor(str(folder))
    assert isinstance(processor, ImageTextProcessor)
    pipe = QwenImageEditPlusPipeline.from_pretrained(folder, processor=processor)
    # The prompt is encoded with its images: each image's merged patches take the place of one <|image_pad|>.
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>x"], images=[_picture((9, 9, 9))],
                       return_tensors="pt")
    pads = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert pads == int(inputs["image_grid_thw"].prod()) // processor.image_processor.merge_size ** 2 > 1
    red = pipe.encode_prompt("make it blue", image=[_picture((200, 10, 10))], device="cpu")[0]
    green = pipe.encode_prompt("make it blue", image=[_picture((10, 200, 10))], device="cpu")[0]
    assert red.shape == green.shape and not torch.allclose(red, green)
    edited = pipe(image=[_picture((200, 10, 10))], prompt="make it blue", height=32, width=48, num_inference_steps=2,
                  output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert edited.shape == (1, 32, 48, 3) and np.isfinite(edited).all()
