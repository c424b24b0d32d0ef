"""Tiny random FLUX.1 and SDXL pipelines, built offline (SPEC C7).

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
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors.torch import save_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from dreamstep.config.choices import TINY_ARCHS, TINY_SDXL_SINGLE_FILE
from dreamstep.errors import UserError
from dreamstep.files import honour_umask
from dreamstep.models import published_configs
from dreamstep.models.sdxl.sgm_keys import save_sdxl_single_file

ARCHS = TINY_ARCHS
SINGLE_FILE_NAME = TINY_SDXL_SINGLE_FILE

# Words whose BPE merges are in the tiny CLIP vocabulary and whose pieces are in the T5 vocabulary,
# so typical test prompts tokenize into a few tokens instead of one token per byte.
_WORDS = ("a", "photo", "of", "sks", "dog", "cat", "person", "the", "in", "on", "style", "red",
          "blue", "painting", "portrait", "with", "and", "high", "quality")

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
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

def _clip_config(tokenizer: CLIPTokenizer, hidden_act: str, hidden_size: int,
                 projection_dim: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=_CLIP_MAX_LENGTH, hidden_act=hidden_act,
        projection_dim=projection_dim, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer: T5TokenizerFast) -> T5EncoderModel:
    # gated-gelu as in T5 v1.1 XXL, the encoder FLUX.1 uses.
    return T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    ))


def _vae(latent_channels: int, scaling_factor: float, shift_factor: float | None,
         quant_conv: bool) -> AutoencoderKL:
    """Four levels (8x down-sampling) like the real FLUX and SDXL VAEs, at 8-16 channels."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


# ---------------------------------------------------------------- FLUX

def _flux_scheduler(guidance_embeds: bool) -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's scheduler (resolution-dependent shift) or FLUX.1-schnell's (no shift)."""
    return FlowMatchEulerDiscreteScheduler(**(published_configs.FLUX_DEV_SCHEDULER if guidance_embeds
                                              else published_configs.FLUX_SCHNELL_SCHEDULER))


def _to_eval(pipe: DiffusionPipeline) -> None:
    """Inference mode, as ``from_pretrained`` returns models (T5's dropout would otherwise be active)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()


def build_tiny_flux(seed: int = 0, guidance_embeds: bool = False) -> FluxPipeline:
    """A random FLUX.1 pipeline with every block type of the real one, in fp32 on the CPU."""
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_t5_tokenizer()
    with _seeded(seed):
        text_encoder = CLIPTextModel(_clip_config(tokenizer, "quick_gelu", 32, projection_dim=32))
        text_encoder_2 = _t5_encoder(tokenizer_2)
        vae = _vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False)
        # Rotary axes (text/time, height, width) must add up to the head dimension: 4 + 6 + 6 = 16.
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1,
            num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=text_encoder_2.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
        )
    pipe = FluxPipeline(scheduler=_flux_scheduler(guidance_embeds), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
                        transformer=transformer)
    _to_eval(pipe)
    return pipe


def build_tiny_flux_kontext(seed: int = 0) -> FluxKontextPipeline:
    """A random FLUX.1 Kontext [dev] pipeline: the guidance-distilled tiny FLUX (Kontext [dev] has guidance
    embedding and FLUX.1-dev's scheduler) in a ``FluxKontextPipeline``."""
    flux = build_tiny_flux(seed=seed, guidance_embeds=True)
    return FluxKontextPipeline(**{name: getattr(flux, name) for name in (
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")})


# ---------------------------------------------------------------- SDXL

def _sdxl_scheduler() -> EulerDiscreteScheduler:
    """The scheduler config shipped with stabilityai/stable-diffusion-xl-base-1.0."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False,
        timestep_spacing="leading", steps_offset=1,
    )


def _sdxl_unet(cross_attention_dim: int, pooled_dim: int) -> UNet2DConditionModel:
    """SDXL's UNet topology in miniature (real: channels 320/640/1280, heads 5/10/20, depth 1/2/10).

    The added conditioning takes the pooled CLIP-G embedding plus six Fourier-embedded size/crop
    numbers, hence ``projection_class_embeddings_input_dim = 6 * addition_time_embed_dim + pooled``.
    """
    addition_time_embed_dim = 8
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(16, 32, 32), norm_num_groups=8, attention_head_dim=(1, 2, 2),
        transformer_layers_per_block=(1, 1, 2), cross_attention_dim=cross_attention_dim,
        use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + pooled_dim,
    )


def build_tiny_sdxl(seed: int = 0) -> StableDiffusionXLPipeline:
    """A random SDXL base pipeline with the real UNet topology in miniature, in fp32 on the CPU."""
    tokenizer, tokenizer_2 = build_clip_tokenizer(), build_clip_tokenizer(pad_token="!")
    with _seeded(seed):
        # Widths differ (real: 768 and 1280) because diffusers' single-file loader tells CLIP-L and
        # CLIP-G apart by their position-embedding width; the projection is narrower than the
        # width so that a transposed text_projection cannot go unnoticed.
        text_encoder = CLIPTextModel(_clip_config(tokenizer, "quick_gelu", 32, projection_dim=32))
        text_encoder_2 = CLIPTextModelWithProjection(
            _clip_config(tokenizer_2, "gelu", 64, projection_dim=32))
        vae = _vae(latent_channels=4, scaling_factor=0.13025, shift_factor=None, quant_conv=True)
        # The UNet attends to the concatenated penultimate hidden states of both encoders.
        unet = _sdxl_unet(
            cross_attention_dim=text_encoder.config.hidden_size + text_encoder_2.config.hidden_size,
            pooled_dim=text_encoder_2.config.projection_dim,
        )
    pipe = StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder,
                                     text_encoder_2=text_encoder_2, tokenizer=tokenizer,
                                     tokenizer_2=tokenizer_2, unet=unet, scheduler=_sdxl_scheduler(),
                                     add_watermarker=False)
    _to_eval(pipe)
    return pipe


# ---------------------------------------------------------------- writing

def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty folder unless ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} is a file, not a folder; choose a folder path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"output folder {out_dir} is not empty; choose a new folder or pass "
                        "--overwrite to write over it")


def write_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, guidance_embeds: bool = False,
                     single_file: bool = False, overwrite: bool = False) -> Path:
    """Write a tiny pipeline folder for ``arch`` ("flux", "flux-kontext" or "sdxl") and return its path.

    With ``single_file`` it also writes, for SDXL, ``<out_dir>/tiny_sdxl.safetensors`` in the original SGM key
    layout, loadable by ``StableDiffusionXLPipeline.from_single_file(path, config=out_dir)``; for FLUX, the
    component files of :func:`write_flux_component_files`.
    """
    if arch not in ARCHS:
        raise UserError(f"unknown architecture '{arch}'; choose one of {', '.join(ARCHS)}")
    if guidance_embeds and arch != "flux":
        raise UserError("--guidance-embeds applies to flux only")
    if single_file and arch == "flux-kontext":
        raise UserError("--single-file applies to flux and sdxl")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    if arch == "flux":
        pipe = build_tiny_flux(seed=seed, guidance_embeds=guidance_embeds)
    elif arch == "flux-kontext":
        pipe = build_tiny_flux_kontext(seed=seed)
    else:
        pipe = build_tiny_sdxl(seed=seed)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(out_dir)
    for name in ("tokenizer", "tokenizer_2"):
        if isinstance(getattr(pipe, name), CLIPTokenizer):
            _write_clip_vocab_files(out_dir / name)
    if single_file and arch == "sdxl":
        save_sdxl_single_file(pipe, out_dir / SINGLE_FILE_NAME)
    elif single_file:
        write_flux_component_files(pipe, out_dir)
    return out_dir


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor as a file of ``dtype`` stores it: fp8 copies (sd-scripts', ComfyUI's) keep only matrices in fp8."""
    if dtype.itemsize == 1 and tensor.ndim != 2:
        dtype = torch.bfloat16
    return tensor.detach().to(dtype).contiguous()


# The storage dtypes of the files people download: flux1-dev and ae in bf16, clip_l and t5xxl_fp16 in fp16.
FLUX_FILE_DTYPES = {"transformer": torch.bfloat16, "ae": torch.bfloat16, "clip_l": torch.float16,
                    "t5xxl": torch.float16}


def write_flux_component_files(pipe: FluxPipeline, out_dir: str | Path,
                               dtypes: dict[str, torch.dtype] | None = None) -> dict[str, Path]:
    """Write a FLUX pipeline as the single files ComfyUI and sd-scripts users have, named like them:
    ``flux1.safetensors`` (the transformer in Black Forest Labs' layout), ``ae.safetensors`` (LDM layout),
    ``clip_l.safetensors`` and ``t5xxl.safetensors`` (transformers' keys, ``text_model.`` kept as ComfyUI's files
    have it), each stored in its :data:`FLUX_FILE_DTYPES` dtype unless ``dtypes`` says otherwise
    (``torch.float8_e4m3fn``: an fp8 copy). Returns the paths by sd-scripts' flag names (the transformer as
    "transformer")."""
    from dreamstep.models.flux.files import transformer_to_bfl
    from dreamstep.models.sdxl.sgm_keys import vae_to_ldm

    out_dir = Path(out_dir)
    clip = {k if k.startswith("text_model.") else f"text_model.{k}": v
            for k, v in pipe.text_encoder.state_dict().items()}
    dtypes = {**FLUX_FILE_DTYPES, **(dtypes or {})}
    parts = {
        "transformer": ("flux1.safetensors",
                        transformer_to_bfl(pipe.transformer.state_dict(), pipe.transformer.config)),
        "ae": ("ae.safetensors", vae_to_ldm(pipe.vae.state_dict(), pipe.vae.config)),
        "clip_l": ("clip_l.safetensors", clip),
        # The token embedding once ("shared"): transformers ties the encoder's to it on loading.
        "t5xxl": ("t5xxl.safetensors", {k: v for k, v in pipe.text_encoder_2.state_dict().items()
                                        if k != "encoder.embed_tokens.weight"}),
    }
    paths = {}
    for part, (name, state_dict) in parts.items():
        paths[part] = out_dir / name
        save_file({k: _stored(v, dtypes[part]) for k, v in state_dict.items()}, str(paths[part]),
                  metadata={"format": "pt"})
        honour_umask(paths[part])
    return paths


def param_count(pipe: DiffusionPipeline) -> dict[str, int]:
    """Number of parameters of each model component of a pipeline."""
    return {name: sum(p.numel() for p in module.parameters())
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
