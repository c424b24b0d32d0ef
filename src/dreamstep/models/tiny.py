"""Tiny random pipelines of every family, built offline (SPEC C7): the parts they share here (tokenizers, CLIP and T5
encoders, a VAE), each family's pipeline in its package (``models/<family>/tiny.py``), written by
:func:`write_tiny_model`.

Every block type of the real architectures is present, at a width of a few dozen channels, so the
loading, LoRA-injection, key-mapping and training paths that run against real weights run here on a
CPU in seconds. What is kept from the real models, and why:

- FLUX: 16 latent channels and 2x2 packing (transformer ``in_channels = 4 * 16``), an 8x VAE (four
  levels) so image sizes and latent sizes relate exactly as for FLUX.1, one double-stream and one
  single-stream block, CLIP-L-style pooled text and a T5 encoder. ``guidance_embeds=True`` gives the
  guidance-distilled variant (like FLUX.1-dev) with FLUX.1-dev's dynamic-shift scheduler; without it
  the scheduler is FLUX.1-schnell's. FLUX.1 Kontext is the guidance-distilled FLUX in a
  ``FluxKontextPipeline`` (same components; the pipeline feeds the condition image's tokens beside the target's).
- SDXL: the real UNet topology in miniature (DownBlock2D, CrossAttnDownBlock2D, CrossAttnDownBlock2D;
  ``layers_per_block=2``; ``text_time`` added conditioning; linear attention projections), so the
  original SGM / Kohya module names (``input_blocks.4.1.transformer_blocks.0.attn1.to_q``) exist
  exactly as in ``sd_xl_base_1.0``; CLIP-L (``CLIPTextModel``) and CLIP-G
  (``CLIPTextModelWithProjection``) whose hidden sizes add up to the UNet's cross-attention width.

Tokenizers are built with the ``tokenizers`` library: a byte-level BPE vocabulary (256 byte symbols,
their end-of-word forms and a few merges) for CLIP, and a small Unigram vocabulary for T5.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    CLIPTextConfig,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from dreamstep.errors import UserError, did_you_mean
from dreamstep.files import check_folder_can_be_made, honour_umask
from dreamstep.models.family import all_variants, variant_family

# Words whose BPE merges are in the tiny CLIP vocabulary and whose pieces are in the T5 vocabulary,
# so typical test prompts tokenize into a few tokens instead of one token per byte.
_WORDS = ("a", "photo", "of", "sks", "dog", "cat", "person", "the", "in", "on", "style", "red",
          "blue", "painting", "portrait", "with", "and", "high", "quality")

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed module initialisation without disturbing the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------- tokenizers

def _clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary layout: byte symbols, byte symbols + '</w>', merge results, then specials."""
    alphabet = sorted(ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            merged = pieces[0] + pieces[1]
            if pair not in merges:
                merges.append(pair)
                if merged not in tokens:
                    tokens.append(merged)
            pieces = [merged] + pieces[2:]
    tokens += [_CLIP_BOS, _CLIP_EOS]
    return {token: i for i, token in enumerate(tokens)}, merges


def build_clip_tokenizer(pad_token: str = _CLIP_EOS) -> CLIPTokenizer:
    """A CLIP tokenizer over a tiny byte-level BPE vocabulary (any text encodes; unknown words by byte).

    SDXL's second tokenizer pads with "!" rather than "<|endoftext|>", hence ``pad_token``.
    """
    vocab, merges = _clip_vocab_and_merges()
    return CLIPTokenizer(vocab=vocab, merges=merges, bos_token=_CLIP_BOS, eos_token=_CLIP_EOS,
                         unk_token=_CLIP_EOS, pad_token=pad_token, model_max_length=_CLIP_MAX_LENGTH)


def _write_clip_vocab_files(tokenizer_dir: Path) -> None:
    """Also write vocab.json and merges.txt, which slow CLIP tokenizers (transformers 4.x) require."""
    vocab, merges = _clip_vocab_and_merges()
    (tokenizer_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (tokenizer_dir / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_t5_tokenizer() -> T5TokenizerFast:
    """A T5 tokenizer over a tiny Unigram vocabulary: whole words, then letters as fallback."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, -3.0) for word in _WORDS]
    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"
    vocab += [(c, -5.0) for c in letters] + [("▁" + c, -5.5) for c in letters]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)


# ---------------------------------------------------------------- text encoders and VAE

def clip_config(tokenizer: CLIPTokenizer, hidden_act: str, hidden_size: int,
                 projection_dim: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=_CLIP_MAX_LENGTH, hidden_act=hidden_act,
        projection_dim=projection_dim, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def t5_encoder(tokenizer: T5TokenizerFast) -> T5EncoderModel:
    # gated-gelu as in T5 v1.1 XXL, the encoder FLUX.1 uses.
    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    ))


def tiny_vae(latent_channels: int, scaling_factor: float, shift_factor: float | None,
         quant_conv: bool) -> AutoencoderKL:
    """Four levels (8x down-sampling) like the real FLUX and SDXL VAEs, at 8-16 channels."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def to_eval(pipe: DiffusionPipeline) -> None:
    """Inference mode, as ``from_pretrained`` returns models (T5's dropout would otherwise be active)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()


# ---------------------------------------------------------------- writing

def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, a non-empty folder unless ``overwrite``, or a folder that cannot be made."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} is a file, not a folder; choose a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"output folder {out_dir} is not empty; choose a new folder or pass "
                        "--overwrite to write over it")
    check_folder_can_be_made(out_dir, "OUT")


def write_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, guidance_embeds: bool = False,
                     single_file: bool = False, overwrite: bool = False) -> Path:
    """Write a tiny pipeline folder of ``arch`` (one of a family's ``variants``: "flux", "flux-kontext",
    "sdxl", ...) and return its path; with ``single_file`` also the single files users of that family have (the
    family's ``write_single_files``). ``guidance_embeds``: a guidance-distilled variant, where the family has one."""
    family = variant_family(arch)
    if family is None:
        raise UserError(f"unknown architecture '{arch}'{did_you_mean(arch, all_variants())}; choose one of "
                        f"{', '.join(all_variants())}")
    out_dir = Path(out_dir)
    if single_file:
        family.check_single_files(arch)
    check_out_dir(out_dir, overwrite)
    pipe = family.build_tiny(arch, seed=seed, guidance_embeds=guidance_embeds)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(out_dir)
    for name in ("tokenizer", "tokenizer_2"):
        if isinstance(getattr(pipe, name, None), CLIPTokenizer):
            _write_clip_vocab_files(out_dir / name)
    if single_file:
        family.write_single_files(pipe, out_dir)
    return out_dir


def param_count(pipe: DiffusionPipeline) -> dict[str, int]:
    """Number of parameters of each model component of a pipeline."""
    return {name: sum(p.numel() for p in module.parameters())
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


def byte_vocab(specials: list[str]) -> dict[str, int]:
    """A byte-level BPE vocabulary with no merges: every text encodes, one token per byte."""
    return {token: i for i, token in enumerate(specials + sorted(ByteLevel.alphabet()))}


# Initial weights of the tiny vision-language models: wide enough that their outputs differ from prompt to prompt.
_VL_INIT = 0.5
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_qwen2_5_vl(out: Path, seed: int = 0) -> Path:
    """``out/qwen2_5_vl``: a tiny Qwen2.5-VL with its tokenizer, PIL image processor and chat template, the
    captioner ``caption --captioner qwen-vl`` reads and the text encoder of the tiny Qwen-Image."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLImageProcessorPil,
    )

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    tokenizer = Qwen2Tokenizer(vocab=byte_vocab([]), merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, initializer_range=_VL_INIT,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, window_size=32, fullatt_block_indexes=[1],
                  initializer_range=_VL_INIT)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    with seeded(seed):
        model = Qwen2_5_VLForConditionalGeneration(config).eval()
    pixels = dict(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
    folder = out / "qwen2_5_vl"
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN_CHAT_TEMPLATE, encoding="utf-8")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 8, "merge_size": 2,
             "temporal_patch_size": 2, "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video) + "\n")
    return folder
