"""One qwen-image-edit-lora step's prediction against the Edit-Plus pipeline's own transformer call on the same
inputs (diffusers has no Qwen-Image-Edit training script): the pipeline's lines from "encode_prompt" (the
instruction encoded with its reference images) through ``prepare_latents`` (the references' latents, packed) to the
transformer call with ``img_shapes`` and the cut to the target's tokens, written out here as the pipeline writes them,
with one and two reference images, on the tiny Qwen-Image-Edit."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
from PIL import Image

from dreamstep.diffusion.flow_matching import FlowMatchingObjective
from dreamstep.engine.optim import build_optimizer
from dreamstep.engine.train_step import make_accelerator
from dreamstep.lora.inject import add_lora
from dreamstep.models.precision import cast_trainable_params_to_fp32
from dreamstep.models.qwen_image import edit
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.models.qwen_image.lora_targets import qwen_image_lora_targets
from dreamstep.models.qwen_image.tiny import build_tiny_qwen_image_edit
from dreamstep.models.vae import posterior_mean
from dreamstep.recipes.qwen_image_edit_lora import QwenImageEditStep

HEIGHT, WIDTH = 32, 48
INSTRUCTION = "make the ball blue"
SIGMA = 0.6


@pytest.fixture(scope="module")
def pipe() -> QwenImageEditPlusPipeline:
    pipe = build_tiny_qwen_image_edit(seed=0)
    add_lora(pipe.transformer, qwen_image_lora_targets(pipe.transformer, ["attention+ff"]), rank=4, alpha=4)
    cast_trainable_params_to_fp32(pipe.transformer)
    with torch.no_grad():
        for name, param in pipe.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return pipe


def _picture(seed: int) -> Image.Image:
    pixels = torch.randint(0, 256, (HEIGHT, WIDTH, 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


@torch.no_grad()
def _pipeline_prediction(pipe: QwenImageEditPlusPipeline, references: list[Image.Image],
                         noisy: torch.Tensor) -> torch.Tensor:
    """The pipeline's lines of one denoising step, with the reference images at the target's size (the trainer's
    bucket) where the pipeline would take 1024² of area."""
    condition_images = []
    for img in references:
        image_width, image_height = img.size
        condition_width, condition_height = calculate_dimensions(CONDITION_IMAGE_SIZE, image_width / image_height)
        condition_images.append(pipe.image_processor.resize(img, condition_height, condition_width))
    vae_images = [pipe.image_processor.preprocess(img, HEIGHT, WIDTH).unsqueeze(2) for img in references]
    prompt_embeds, prompt_embeds_mask = pipe.encode_prompt(image=condition_images, prompt=INSTRUCTION, device="cpu")
    packed = QwenImageEditPlusPipeline._pack_latents(noisy, 1, noisy.shape[1], noisy.shape[2], noisy.shape[3])
    latents, image_latents = pipe.prepare_latents(vae_images, 1, pipe.transformer.config.in_channels // 4, HEIGHT,
                                                  WIDTH, prompt_embeds.dtype, "cpu", None, packed)
    img_shapes = [[(1, HEIGHT // pipe.vae_scale_factor // 2, WIDTH // pipe.vae_scale_factor // 2),
                   *[(1, HEIGHT // pipe.vae_scale_factor // 2, WIDTH // pipe.vae_scale_factor // 2)
                     for _ in references]]]
    t = torch.tensor(SIGMA * 1000)
    timestep = t.expand(latents.shape[0]).to(latents.dtype)
    noise_pred = pipe.transformer(hidden_states=torch.cat([latents, image_latents], dim=1), timestep=timestep / 1000,
                                  guidance=None, encoder_hidden_states_mask=prompt_embeds_mask,
                                  encoder_hidden_states=prompt_embeds, img_shapes=img_shapes, attention_kwargs={},
                                  return_dict=False)[0]
    noise_pred = noise_pred[:, : latents.size(1)]
    return qwen.unpack(noise_pred, noisy.shape[2], noisy.shape[3])


@pytest.mark.parametrize("references", [1, 2])
def test_a_steps_prediction_is_the_edit_pipelines_transformer_call(pipe: QwenImageEditPlusPipeline,
                                                                   references: int) -> None:
    images = [_picture(i) for i in range(references)]
    noisy = torch.randn(1, 16, HEIGHT // 8, WIDTH // 8, generator=torch.Generator().manual_seed(3))
    expected = _pipeline_prediction(pipe, images, noisy)

    conditions = [posterior_mean(qwen.encode_posterior(pipe.vae, pipe.image_processor.preprocess(img, HEIGHT, WIDTH)))
                  for img in images]
    batch = edit.join_prompts([edit.encode_edit_prompt(pipe, INSTRUCTION, images)], torch.device("cpu"))
    params = [p for p in pipe.transformer.parameters() if p.requires_grad]
    step = QwenImageEditStep(pipe.transformer, optimizer=build_optimizer("AdamW", params, 1e-4),
                             accelerator=make_accelerator(mixed_precision="no"), sigmas=torch.linspace(1, 0, 1000),
                             objective=FlowMatchingObjective(), vae_encode_mode="mode")
    with torch.no_grad():
        prediction = step.velocity(pipe.transformer, noisy, torch.full((1, 1, 1, 1), SIGMA), batch, conditions)
    torch.testing.assert_close(prediction, expected, rtol=1e-5, atol=1e-5)
