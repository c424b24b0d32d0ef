"""Qwen-Image-Edit's training inputs, laid out as ``QwenImageEditPlusPipeline`` lays them out at inference.

The denoiser reads ``[target tokens | reference 1 tokens | ...]`` along the sequence, with ``img_shapes`` naming each
image's (frame, rows, columns) of 2x2 patches, the target first; the references' latents are their posterior's mode
in the normalised units; only the target's tokens are a prediction. The prompt is encoded by the Qwen2.5-VL
*with* the reference images ("Picture 1: <image> ..." before the instruction, each image resized to 384² of area as
the pipeline resizes it), so its embedding depends on them: the text cache keys an instruction with its references'
contents, and holds each sample's embedding at its own length (the image tokens make them long and the Edit
pipelines cut nothing); a batch pads them and masks the padding, as diffusers' training script joins prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
from PIL import Image

from dreamstep.data.cache import TensorCache, text_content_key
from dreamstep.data.images import load_rgb
from dreamstep.models.qwen_image import plumbing as qwen
from dreamstep.notices import CAPTION_CUT, hidden


def vl_images(pipeline: Any, images: Sequence[Image.Image]) -> list[Image.Image]:
    """The reference images as the Edit-Plus pipeline gives them to the Qwen2.5-VL: 384² of area at each one's
    aspect ratio (sides multiples of 32)."""
    out = []
    for image in images:
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        out.append(pipeline.image_processor.resize(image, height, width))
    return out


@torch.no_grad()
def encode_edit_prompt(pipeline: Any, instruction: str, images: Sequence[Image.Image]) -> dict[str, torch.Tensor]:
    """One instruction's embedding (L, D) encoded with its reference images by the pipeline's own
    ``encode_prompt``, at its own length, float32, on the CPU."""
    with hidden(CAPTION_CUT):
        embeds, _ = pipeline.encode_prompt(prompt=[instruction], image=vl_images(pipeline, images),
                                           device=pipeline.text_encoder.device)
    return {"prompt_embeds": embeds[0].float().cpu()}


def join_prompts(entries: Sequence[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor | None]:
    """Samples' embeddings (L_i, D) as a batch (B, max L_i, D), zero-padded, with the mask (B, max L_i), or ``None``
    when nothing is padding (diffusers' ``concat_prompt_embedding_batches``)."""
    lengths = [len(e["prompt_embeds"]) for e in entries]
    longest = max(lengths)
    embeds = torch.stack([torch.nn.functional.pad(e["prompt_embeds"], (0, 0, 0, longest - len(e["prompt_embeds"])))
                          for e in entries])
    mask = torch.stack([torch.arange(longest) < n for n in lengths]).long()
    return {"prompt_embeds": embeds.to(device, non_blocking=True),
            "prompt_mask": None if bool(mask.all()) else mask.to(device, non_blocking=True)}


def edit_text_key(instruction: str, references: Sequence[str]) -> str:
    """The text cache's key of an instruction encoded with references of these contents (sha256s)."""
    return "|".join([text_content_key(instruction), *(f"image:{sha}" for sha in references)])


class EditConditioner(qwen.QwenImageConditioner):
    """The Edit step's inputs: the target's and the reference's posteriors (same crop, flip and bucket) and the
    instruction's embedding encoded with the reference image, from the caches (encoded and stored when missing)."""

    def __init__(self, pipeline: Any, dataset: Any, *, latent_cache: TensorCache | None, text_cache: TensorCache,
                 device: torch.device, held_out: Any | None = None):
        super().__init__(pipeline, latent_cache=latent_cache, text_cache=text_cache, max_sequence_length=0,
                         device=device)
        self.references = {str(r.image.path): r.conditioning for part in (dataset, held_out) if part is not None
                           for r in part.records if r.conditioning is not None}

    def edit_prompt(self, instruction: str, image_path: str) -> dict[str, torch.Tensor]:
        """The instruction of the target at ``image_path`` with its reference: cached, or encoded and stored."""
        reference = self.references[image_path]
        key = edit_text_key(instruction, [reference.sha256])
        found = self.text_cache.get(key)
        if found is None:
            found = encode_edit_prompt(self.pipeline, instruction, [load_rgb(Path(reference.path))])
            self.text_cache.put(key, found)
        return found

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        entries = [self.edit_prompt(c, p) for c, p in zip(batch["captions"], batch["image_paths"], strict=True)]
        return {"latent_dist": self.latents(batch), "condition_dist": self.latents(batch, prefix="conditioning_"),
                **join_prompts(entries, self.device), "is_reg": batch["is_reg"]}


def fill_edit_texts(conditioner: EditConditioner, dataset: Any, epochs: int) -> None:
    """The "encode text" phase of an Edit run: every (instruction, reference) pair its ``epochs`` will use."""
    for epoch in range(epochs):
        for index in range(len(dataset)):
            caption, _ = dataset.caption(index, epoch)
            conditioner.edit_prompt(caption, str(dataset.records[dataset.samples[index]].image.path))


def joined_inputs(inputs: dict[str, Any], references: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The transformer's keyword arguments for a target (``hidden_states`` (B, N, 4C), ``img_shapes``) with reference
    latents (B, C, h_i, w_i) beside it: ``hidden_states`` (B, N + sum N_i, 4C) and every image's shape."""
    target = inputs["hidden_states"]
    shapes = [inputs["img_shapes"][0][0], *((1, r.shape[2] // 2, r.shape[3] // 2) for r in references)]
    packed = [qwen.pack(r.to(target.dtype)) for r in references]
    return {**inputs, "hidden_states": torch.cat([target, *packed], dim=1), "img_shapes": [shapes] * len(target)}
