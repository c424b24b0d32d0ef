"""The subject- and prompt-fidelity scores of DreamBooth (Ruiz et al. 2023, §4.1 and Table 1).

- DINO: mean pairwise cosine similarity between the DINO ViT CLS embeddings of generated images and of
  the subject's real images. The paper names the model: ViT-S/16 DINO (``facebook/dino-vits16``).
- CLIP-I: the same mean pairwise cosine with CLIP image embeddings.
- CLIP-T: mean cosine between each generated image's CLIP embedding and its prompt's, with the
  subject's identifier token taken out of the prompt.

We found no CLIP variant named in the paper's text, so the default is the common public ViT-B/32,
``openai/clip-vit-base-patch32``. Both ids are settings.
Reference values from Table 1: real images DINO 0.774, CLIP-I 0.885; DreamBooth on Stable Diffusion
DINO 0.668, CLIP-I 0.803, CLIP-T 0.305.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from dreamstep.config.evaluation import DEFAULT_CLIP_MODEL, DEFAULT_DINO_MODEL
from dreamstep.errors import UserError, cannot_load, refusing_pickled_code

DEFAULT_MODELS = {"vit": DEFAULT_DINO_MODEL, "clip": DEFAULT_CLIP_MODEL}
SUBJECT_METRICS = ("dino", "clip_i")
PROMPT_METRICS = ("clip_t",)


def _load(loader: Any, model_id: str, flag: str, model_type: str | None = None, **kwargs: Any) -> Any:
    """``loader.from_pretrained(model_id)``, or one line naming the id, the flag and the fix. ``model_type``:
    the architecture the loader needs, checked in the model's config first (a DINO ViT given as --clip_model
    would otherwise load half-initialised and fail later with a traceback)."""
    try:
        if model_type is not None:
            from transformers import AutoConfig

            try:
                found = AutoConfig.from_pretrained(model_id).model_type
            except ValueError:  # a folder of something else: a diffusers pipeline, images, a config without a type
                raise UserError(f"{flag} {model_id}: not a transformers {model_type.upper()} model (no config.json "
                                f"with a model type there); give one like {DEFAULT_MODELS[model_type]}") from None
            if found != model_type:
                raise UserError(f"{flag} {model_id}: a '{found}' model, not the '{model_type}' model this metric "
                                f"needs; give one like {DEFAULT_MODELS[model_type]}")
        with refusing_pickled_code(model_id, flag):
            return loader.from_pretrained(model_id, **kwargs)
    except OSError as error:
        raise cannot_load(flag, model_id, "evaluation model", error, "give a local folder (dreamstep tiny-model "
                          "evaluators OUT writes tiny offline ones)") from None


def pairwise_mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity over every pair (row of ``a``, row of ``b``): (N, D), (M, D) -> float."""
    cosines = F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T
    return float(cosines.clamp(-1.0, 1.0).mean())


def matched_mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of row i of ``a`` with row i of ``b``: (N, D), (N, D) -> float."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).clamp(-1.0, 1.0).mean())


def remove_identifier(prompt: str, identifier: str | None) -> str:
    """The prompt without the identifier token ('a photo of sks dog' -> 'a photo of dog') for CLIP-T."""
    if not identifier:
        return prompt
    return " ".join(re.sub(rf"\b{re.escape(identifier)}\b", " ", prompt).split())


class FidelityScorer:
    """DINO / CLIP-I / CLIP-T on one device, in batches. Models load on first use of their metric.

    ``metrics``: any of ``dino``, ``clip_i``, ``clip_t``. Reference embeddings are computed once by
    :meth:`set_references` and reused at every validation point.
    """

    def __init__(self, metrics: Sequence[str], *, dino_model: str = DEFAULT_DINO_MODEL,
                 clip_model: str = DEFAULT_CLIP_MODEL, device: torch.device | str = "cpu", batch_size: int = 16,
                 dino_flag: str = "--dino_model", clip_flag: str = "--clip_model"):
        self.metrics = [m for m in metrics if m in SUBJECT_METRICS + PROMPT_METRICS]
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.dino = self.clip = None
        if "dino" in self.metrics:
            from transformers import AutoImageProcessor, ViTModel

            dino = _load(ViTModel, dino_model, dino_flag, "vit", add_pooling_layer=False)
            self.dino = (dino.to(self.device).eval(),
                         _load(AutoImageProcessor, dino_model, dino_flag))
        if {"clip_i", "clip_t"} & set(self.metrics):
            from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

            self.clip = (_load(CLIPModel, clip_model, clip_flag, "clip").to(self.device).eval(),
                         _load(AutoImageProcessor, clip_model, clip_flag), _load(AutoTokenizer, clip_model, clip_flag))
        self.references: dict[str, torch.Tensor] = {}

    def to(self, device: torch.device | str) -> FidelityScorer:
        """Move the evaluation models (e.g. onto the training device, once the run has one)."""
        self.device = torch.device(device)
        for parts in (self.dino, self.clip):
            if parts is not None:
                parts[0].to(self.device)
        return self

    @torch.no_grad()
    def dino_embeddings(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """(N, D) DINO CLS embeddings (the last layer's normalised CLS token, as DINO's kNN evaluation)."""
        model, processor = self.dino
        return self._batched(images, processor, lambda pixels: model(pixel_values=pixels).last_hidden_state[:, 0])

    @torch.no_grad()
    def clip_image_embeddings(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """(N, P) CLIP image embeddings (pooled vision output through the visual projection)."""
        model, processor, _ = self.clip

        def embed(pixels: torch.Tensor) -> torch.Tensor:
            return model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)

        return self._batched(images, processor, embed)

    @torch.no_grad()
    def clip_text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """(N, P) CLIP text embeddings (pooled EOS token through the text projection)."""
        model, _, tokenizer = self.clip
        out = []
        for start in range(0, len(prompts), self.batch_size):
            tokens = tokenizer(list(prompts[start:start + self.batch_size]), padding=True, truncation=True,
                               max_length=tokenizer.model_max_length if tokenizer.model_max_length < 10**6 else 77,
                               return_tensors="pt").to(self.device)
            pooled = model.text_model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).pooler_output
            out.append(model.text_projection(pooled).float().cpu())
        return torch.cat(out)

    def _batched(self, images: Sequence[Image.Image], processor: Any, embed: Any) -> torch.Tensor:
        out = []
        dtype = next(iter(self._models())).dtype
        for start in range(0, len(images), self.batch_size):
            chunk = [im.convert("RGB") for im in images[start:start + self.batch_size]]
            pixels = processor(images=chunk, return_tensors="pt")["pixel_values"].to(self.device, dtype)
            out.append(embed(pixels).float().cpu())
        return torch.cat(out)

    def _models(self) -> Any:
        for parts in (self.dino, self.clip):
            if parts is not None:
                yield from parts[0].parameters()

    def set_references(self, images: Sequence[Image.Image]) -> None:
        """Embed the subject's real images once (for DINO and CLIP-I)."""
        if not images and set(SUBJECT_METRICS) & set(self.metrics):
            raise UserError("DINO and CLIP-I need the subject's images (instance images); none were given")
        if "dino" in self.metrics:
            self.references["dino"] = self.dino_embeddings(images)
        if "clip_i" in self.metrics:
            self.references["clip_i"] = self.clip_image_embeddings(images)

    def score(self, images: Sequence[Image.Image], prompts: Sequence[str] | None = None,
              identifier: str | None = None) -> dict[str, float]:
        """The chosen metrics of ``images`` (prompts: one per image, for CLIP-T)."""
        scores: dict[str, float] = {}
        if "dino" in self.metrics:
            scores["dino"] = pairwise_mean_cosine(self.dino_embeddings(images), self.references["dino"])
        clip_images = self.clip_image_embeddings(images) if self.clip is not None else None
        if "clip_i" in self.metrics:
            scores["clip_i"] = pairwise_mean_cosine(clip_images, self.references["clip_i"])
        if "clip_t" in self.metrics:
            if prompts is None or len(prompts) != len(images):
                raise ValueError("CLIP-T needs one prompt per image")
            texts = self.clip_text_embeddings([remove_identifier(p, identifier) for p in prompts])
            scores["clip_t"] = matched_mean_cosine(clip_images, texts)
        return scores
