"""A tiny random Qwen-Image pipeline (and its Edit variant), built offline, that diffusers' ``QwenImagePipeline``
loads (see :mod:`dreamstep.models.tiny` for what tiny models keep from the real ones).

Kept from the released Qwen-Image: 16 latent channels and 2x2 packing (transformer ``in_channels = 4 * 16``,
``out_channels = 16``), the causal-video VAE with its 8x spatial factor (three down-sampling levels, two of them
temporal as in Wan 2.1's VAE) and its published latents mean / std, rotary axes of (frame, height, width),
double-stream blocks, the text encoder's last hidden state as the prompt embedding and the published scheduler.
The text encoder and its tokenizer are the tiny Qwen2.5-VL of :mod:`dreamstep.captioning.tiny` (the same model
class as Qwen2.5-VL-7B, with a vision tower; a byte-level tokenizer, so the pipelines' template prefixes are longer
in tokens than the 34 / 64 they drop: the tiny embeddings keep part of the system prompt, which changes nothing
the tests check).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer, Qwen2VLImageProcessorPil

from dreamstep.models.qwen_image.configs import QWEN_IMAGE_SCHEDULER
from dreamstep.models.qwen_image.vl_processor import ImageTextProcessor
from dreamstep.models.tiny import seeded, to_eval, write_tiny_qwen2_5_vl


def tiny_text_encoder(seed: int) -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer,
                                          Qwen2VLImageProcessorPil]:
    """The tiny Qwen2.5-VL (32 wide, 2 layers, a vision tower), its tokenizer and its (PIL) image processor, written
    by the captioning kit and read back as a pipeline reads them."""
    with tempfile.TemporaryDirectory(prefix="dreamstep-tiny-qwen-vl-") as out:
        folder = write_tiny_qwen2_5_vl(Path(out), seed=seed)
        return (Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval(),
                Qwen2Tokenizer.from_pretrained(folder), Qwen2VLImageProcessorPil.from_pretrained(folder))


def tiny_vae() -> AutoencoderKLQwenImage:
    """The causal-video VAE at 8-32 channels: 8x spatial, 16 latent channels, the published latents mean / std."""
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True, True])


def tiny_transformer(joint_attention_dim: int) -> QwenImageTransformer2DModel:
    # Rotary axes (frame, height, width) must add up to the head dimension: 4 + 6 + 6 = 16.
    return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2,
                                       joint_attention_dim=joint_attention_dim, axes_dims_rope=(4, 6, 6))


def build_tiny_qwen_image(seed: int = 0) -> QwenImagePipeline:
    """A random Qwen-Image pipeline with every block type of the real one, in fp32 on the CPU."""
    text_encoder, tokenizer, _ = tiny_text_encoder(seed)
    return _tiny_pipeline(QwenImagePipeline, seed, text_encoder=text_encoder, tokenizer=tokenizer)


def _tiny_pipeline(pipeline_class: type, seed: int, **encoders: Any) -> Any:
    with seeded(seed):
        vae = tiny_vae()
        transformer = tiny_transformer(encoders["text_encoder"].config.text_config.hidden_size)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = pipeline_class(scheduler=scheduler, vae=vae, transformer=transformer, **encoders)
    to_eval(pipe)
    return pipe


def build_tiny_qwen_image_edit(seed: int = 0) -> QwenImageEditPlusPipeline:
    """A random Qwen-Image-Edit-Plus pipeline (one to three reference images): the tiny Qwen-Image's components
    with the tiny Qwen2.5-VL's image processor in the torchvision-free processor
    (:mod:`~dreamstep.models.qwen_image.vl_processor`)."""
    text_encoder, tokenizer, image_processor = tiny_text_encoder(seed)
    processor = ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer)
    pipe = _tiny_pipeline(QwenImageEditPlusPipeline, seed, text_encoder=text_encoder, tokenizer=tokenizer,
                          processor=processor)
    # model_index.json names the processor as the published folders do (transformers' Qwen2VLProcessor, which
    # diffusers loads where torchvision is installed); dreamstep passes its own (``processor=``) everywhere.
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    return pipe
