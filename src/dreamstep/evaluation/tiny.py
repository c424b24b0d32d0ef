"""Tiny random evaluators for offline tests and demos: a DINO-shaped ViT and a CLIP model, written as
``save_pretrained`` folders with their image processors (and the CLIP tokenizer), so the scoring code
loads them exactly as it loads ``facebook/dino-vits16`` and ``openai/clip-vit-base-patch32``.

Random ViTs map every picture to nearly the same CLS vector, which would make "identical images score
above noise" true by luck or not at all. The weights are therefore drawn with a wide initialiser
(``initializer_range``) and the models are kept shallow, so their features still depend on the pixels.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, ViTConfig, ViTImageProcessor, ViTModel

from dreamstep.files import honour_umask
from dreamstep.models.tiny import build_clip_tokenizer

IMAGE_SIZE = 32
_PATCH = 8
_INIT_RANGE = 0.5
# ImageNet statistics (DINO) and CLIP's own, as the real processors use them.
_IMAGENET_MEAN, _IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
DINO_FOLDER, CLIP_FOLDER = "dino", "clip"


def build_tiny_dino(seed: int = 0) -> tuple[ViTModel, ViTImageProcessor]:
    """A ViT with DINO ViT-S/16's layout in miniature (CLS token, pre-norm blocks, final layer norm)."""
    config = ViTConfig(image_size=IMAGE_SIZE, patch_size=_PATCH, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, initializer_range=_INIT_RANGE)
    torch.manual_seed(seed)
    model = ViTModel(config, add_pooling_layer=False).eval()
    processor = ViTImageProcessor(do_resize=True, size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                  image_mean=_IMAGENET_MEAN, image_std=_IMAGENET_STD)
    return model, processor


def build_tiny_clip(seed: int = 0) -> tuple[CLIPModel, CLIPImageProcessor, object]:
    """A CLIP model (vision and text towers with projections) and its processor and tokenizer."""
    tokenizer = build_clip_tokenizer()
    text = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(image_size=IMAGE_SIZE, patch_size=_PATCH, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16,
                        initializer_factor=_INIT_RANGE / 0.02)
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                   image_mean=_CLIP_MEAN, image_std=_CLIP_STD)
    return model, processor, tokenizer


def write_tiny_evaluators(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``OUT/dino`` and ``OUT/clip``; return the folder of each (give them as the model ids)."""
    out = Path(out_dir)
    dino, dino_processor = build_tiny_dino(seed)
    clip, clip_processor, tokenizer = build_tiny_clip(seed)
    folders = {"dino": out / DINO_FOLDER, "clip": out / CLIP_FOLDER}
    for parts, folder in (((dino, dino_processor), folders["dino"]),
                          ((clip, clip_processor, tokenizer), folders["clip"])):
        for part in parts:
            part.save_pretrained(folder)
        honour_umask(folder)
    return folders
