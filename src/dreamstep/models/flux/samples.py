"""Sample images of a FLUX trainer from sd-scripts' prompt files: per line ``--w --h`` (default 512), ``--s`` steps
(20), ``--d`` seed, ``--g`` the distilled guidance fed to FLUX.1-dev (3.5), ``--l`` a true classifier-free guidance
scale (1.0: none) with ``--n`` the negative prompt, as sd-scripts' FLUX sampler reads them. The prompts are encoded
in the "encode text" phase (the text encoders need not come back); a CLIP-L that trains gives its pooled output
anew, a T5 that trains (``train_t5xxl``) its embeddings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPipeline
from PIL import Image

from dreamstep.errors import UserError
from dreamstep.models.flux.plumbing import FluxConditioner, joint_attention_mask, t5_embeddings, without_text_encoders
from dreamstep.models.parking import ParkedModules
from dreamstep.models.sample_prompts import (
    FLUX_OPTIONS,
    SamplePrompt,
    parse_prompt_line,
    read_prompt_lines,
    save_samples,
)
from dreamstep.png_text import JSON_KEY, sample_parameters

# sd-scripts' FLUX sampling defaults of a line's options.
FLUX_SAMPLE_DEFAULTS = {"width": 512, "height": 512, "steps": 20, "scale": 1.0, "guidance": 3.5}


def read_flux_sample_prompts(path: str) -> list[SamplePrompt]:
    """A FLUX prompt file, every line checked (FLUX's latents pack 2x2 patches: sides are multiples of 16)."""
    prompts = []
    for where, line in read_prompt_lines(path):
        sample = parse_prompt_line(line, where, FLUX_SAMPLE_DEFAULTS, FLUX_OPTIONS)
        if sample.width % 16 or sample.height % 16:
            raise UserError(f"{where}: FLUX needs --w and --h in multiples of 16 (got {sample.width}x{sample.height})")
        prompts.append(sample)
    return prompts


def _texts(prompts: list[SamplePrompt]) -> list[str]:
    """Every text to encode: each prompt, and the negative prompt of each line with true guidance."""
    return list(dict.fromkeys(t for p in prompts for t in ((p.prompt, p.negative_prompt) if p.scale != 1.0
                                                          else (p.prompt,))))


class FluxSampleWriter:
    """Samples with the training network applied (``network``: its train/eval mode is switched around them), saved
    as ``folder/<name>_<step>_<i>.png`` with their parameters; returns the images for the log's grid."""

    def __init__(self, pipeline: FluxPipeline, network: torch.nn.Module, prompts: list[SamplePrompt],
                 embeddings: dict[str, dict[str, torch.Tensor]], *, folder: Path, name: str, seed: int,
                 autocast: Callable[[], Any], encoders: ParkedModules, clip_trains: bool, t5_trains: bool = False):
        self.pipeline, self.network, self.prompts, self.embeddings = pipeline, network, prompts, embeddings
        self.folder, self.name, self.seed = folder, name, seed
        self.autocast, self.encoders, self.clip_trains, self.t5_trains = autocast, encoders, clip_trains, t5_trains
        self.written: list[Path] = []

    @staticmethod
    def encode(conditioner: FluxConditioner, prompts: list[SamplePrompt]) -> dict[str, dict[str, torch.Tensor]]:
        """The embeddings of every text of ``prompts``, made in the "encode text" phase (encoders on the device)."""
        return {text: conditioner.prompts([text]) for text in _texts(prompts)}

    def __call__(self, global_step: int) -> list[Image.Image]:
        modules = [self.network, self.pipeline.text_encoder_2] if self.t5_trains else [self.network]
        modes = [module.training for module in modules]
        for module in modules:  # no dropout in samples (T5-XXL's own is 0.1)
            module.eval()
        try:
            parts = ("vae", "text_encoder") if self.clip_trains else ("vae",)
            with self.encoders.on_device(*parts), self.autocast():
                images = [self._sample(sample, i) for i, sample in enumerate(self.prompts)]
        finally:
            for module, mode in zip(modules, modes):
                module.train(mode)
        self.written += save_samples(images, self.folder, self.name, global_step)
        return images

    @torch.no_grad()
    def _sample(self, sample: SamplePrompt, index: int) -> Image.Image:
        seed = sample.seed if sample.seed is not None else self.seed + index
        text = self._embeds(sample.prompt, "")
        if sample.scale != 1.0:
            text |= self._embeds(sample.negative_prompt, "negative_") | {"true_cfg_scale": sample.scale}
        pipeline = without_text_encoders(self.pipeline)
        with _text_masks(pipeline.transformer, self._masks(sample, text)):
            image = pipeline(**text, num_inference_steps=sample.steps, guidance_scale=sample.guidance,
                             width=sample.width, height=sample.height,
                             generator=torch.Generator("cpu").manual_seed(seed)).images[0]
        image.info[JSON_KEY] = sample_parameters(
            self.pipeline, prompt=sample.prompt, negative_prompt=sample.negative_prompt or None, seed=seed,
            steps=sample.steps, guidance_scale=sample.guidance, true_cfg_scale=sample.scale, width=sample.width,
            height=sample.height)
        return image

    def _masks(self, sample: SamplePrompt, text: dict[str, Any]) -> dict[int, torch.Tensor]:
        """T5's attention mask of each prompt's embeddings (``--apply_t5_attn_mask``), by the embeddings tensor the
        pipeline passes the transformer (the positive and negative prompts' differ); empty without masks."""
        masks = {}
        for prompt, prefix in ((sample.prompt, ""), (sample.negative_prompt, "negative_")):
            found = self.embeddings.get(prompt, {})
            if f"{prefix}prompt_embeds" in text and "text_mask" in found:
                masks[id(text[f"{prefix}prompt_embeds"])] = found["text_mask"]
        return masks

    def _embeds(self, text: str, prefix: str) -> dict[str, torch.Tensor]:
        dtype = self.pipeline.transformer.dtype
        found = self.embeddings[text]
        pooled, embeds = found["pooled"], found["prompt_embeds"]
        if self.clip_trains:
            pooled = self.pipeline._get_clip_prompt_embeds(text, device=self.pipeline.text_encoder.device)
        if self.t5_trains:  # found holds T5's token ids (and mask): the embeddings are the trained T5's now
            embeds = t5_embeddings(self.pipeline.text_encoder_2, found["t5_input_ids"], found.get("text_mask"))
        return {f"{prefix}prompt_embeds": embeds.to(dtype), f"{prefix}pooled_prompt_embeds": pooled.to(dtype)}


@contextlib.contextmanager
def _text_masks(transformer: torch.nn.Module, masks: dict[int, torch.Tensor]) -> Iterator[None]:
    """While sampling, give each transformer call the attention mask of the prompt embeddings it reads
    (``masks``: ``id`` of the embeddings tensor -> T5's mask (1, S)), as sd-scripts' sampler masks T5's padding
    for the prompt and the negative prompt alike; ``FluxPipeline`` passes one ``joint_attention_kwargs`` to both
    calls of true classifier-free guidance, so the mask is chosen per call here."""
    if not masks:
        yield
        return

    def add_mask(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        text = kwargs["encoder_hidden_states"]
        mask = masks.get(id(text))
        if mask is None:
            raise RuntimeError("sampling with --apply_t5_attn_mask: the transformer got prompt embeddings "
                               "without a T5 mask")
        image_tokens = kwargs["hidden_states"].shape[1]
        joint = joint_attention_mask(mask.to(text.device), image_tokens).expand(len(text), -1, -1, -1)
        return args, {**kwargs, "joint_attention_kwargs": {**(kwargs.get("joint_attention_kwargs") or {}),
                                                           "attention_mask": joint}}

    handle = transformer.register_forward_pre_hook(add_mask, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
