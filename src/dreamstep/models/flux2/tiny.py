"""A tiny random FLUX.2 [klein] pipeline (Qwen3 text encoder and a byte-level BPE tokenizer with Qwen's chat
template, built offline), which ``Flux2KleinPipeline.from_pretrained`` loads.

What is kept from the released model: the VAE's 8x down-sampling and its batch-norm statistics over 2x2 patches
(the transformer reads ``4 x latent_channels`` per token, as 128 = 4 x 32 at full size), the double- and
single-stream blocks with their shared modulation, four rotary axes, and a Qwen3 with enough layers that the
pipeline's default hidden-state layers (9, 18, 27) exist, so the prompt embeddings are three layers wide as in the
released model (``joint_attention_dim = 3 x hidden_size``).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Qwen2TokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dreamstep.models.tiny import seeded, to_eval

# Words whose byte-level merges are in the tiny vocabulary (with and without the leading space), so test
# prompts become a few tokens.
_WORDS = ("a", "photo", "of", "sks", "dog", "cat", "person", "the", "in", "on", "style", "red", "blue",
          "painting", "portrait", "with", "and", "robot", "make", "it", "night", "add", "hat", "user", "assistant")
_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Mistral's control tokens (Pixtral's image tokens among them), for the [dev] processor.
_MISTRAL_SPECIAL = ("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                    "[IMG_BREAK]", "[IMG_END]")
_SPACE = "Ġ"  # byte-level BPE's symbol of a leading space

# The chat template's text for one user message with thinking off, as Qwen3's template renders it
# (``apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)``).
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

# FLUX.2's scheduler: the shift depends on the image's token count (the pipeline passes it as ``mu``).
FLUX2_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                       max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")

# Hidden-state layers the pipelines stack into the prompt embedding (their defaults).
KLEIN_TEXT_LAYERS = (9, 18, 27)
DEV_TEXT_LAYERS = (10, 20, 30)

# Mistral Small 3.1's chat layout for a system message and a user turn of text (and image) parts.
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]{% else %}[INST]"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}"
    "{% endfor %}[/INST]{% endif %}{% endfor %}")


def _merge(left: str, right: str, tokens: list[str], merges: list[tuple[str, str]]) -> str:
    if (left, right) not in merges:
        merges.append((left, right))
        if left + right not in tokens:
            tokens.append(left + right)
    return left + right


def _vocab_and_merges(special: tuple[str, ...] = _SPECIAL) -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = sorted(ByteLevel.alphabet())
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        pieces = list(word)
        while len(pieces) > 1:
            pieces = [_merge(pieces[0], pieces[1], tokens, merges)] + pieces[2:]
        _merge(_SPACE, word, tokens, merges)  # the spaced word: the word's merges first, then the space
    tokens += list(special)
    return {token: i for i, token in enumerate(tokens)}, merges


def build_qwen_tokenizer() -> Qwen2TokenizerFast:
    """A Qwen2 tokenizer over a tiny byte-level BPE vocabulary (any text encodes, unknown words by byte), with
    Qwen's special tokens and Qwen3's chat template; it pads with ``<|endoftext|>`` as Qwen's does."""
    vocab, merges = _vocab_and_merges()
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges, model_max_length=512,
                                   additional_special_tokens=list(_SPECIAL[1:]))
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_mistral_tokenizer() -> Qwen2TokenizerFast:
    """A byte-level BPE tokenizer with Mistral's control tokens and a chat template of Mistral Small 3.1's layout,
    padding with ``<pad>``. The released [dev] has a Pixtral processor there (which needs torchvision); the pipeline
    calls only its chat template and tokenizer, which this one has."""
    vocab, merges = _vocab_and_merges(_MISTRAL_SPECIAL)
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=merges, model_max_length=512, unk_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=list(_MISTRAL_SPECIAL[3:]))
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def mistral3_encoder(tokenizer: Qwen2TokenizerFast, hidden_size: int = 32) -> Mistral3ForConditionalGeneration:
    """A Mistral 3 with a one-layer Pixtral vision tower and 30 narrow text layers: [dev]'s pipeline reads hidden
    states 10, 20 and 30."""
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=max(DEV_TEXT_LAYERS),
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1, tie_word_embeddings=False))


def qwen3_encoder(tokenizer: Qwen2TokenizerFast, hidden_size: int = 32) -> Qwen3ForCausalLM:
    """A Qwen3 of 27 narrow layers: the klein pipeline reads hidden states 9, 18 and 27."""
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=max(KLEIN_TEXT_LAYERS), num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    """Four levels (8x down-sampling) as the released VAE, 8 latent channels (32 released), batch-norm statistics
    over 2x2 patches set away from 0 and 1 so that normalising the latents is visible."""
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 16, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1,
        norm_num_groups=8, sample_size=64, use_quant_conv=True, use_post_quant_conv=True)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    return vae


def tiny_flux2_transformer(text_dim: int, latent_channels: int, guidance_embeds: bool) -> Flux2Transformer2DModel:
    """One double-stream and one single-stream block; rotary axes (4, 4, 4, 4) add up to the head dimension."""
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_dim, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)


def build_tiny_flux2_klein(seed: int = 0) -> Flux2KleinPipeline:
    """A random FLUX.2 [klein] pipeline (the base kind: no guidance embedding, not distilled), fp32 on the CPU."""
    tokenizer = build_qwen_tokenizer()
    with seeded(seed):
        text_encoder = qwen3_encoder(tokenizer)
        vae = tiny_flux2_vae()
        transformer = tiny_flux2_transformer(len(KLEIN_TEXT_LAYERS) * text_encoder.config.hidden_size,
                                             vae.config.latent_channels, guidance_embeds=False)
    pipe = Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    to_eval(pipe)
    return pipe


def build_tiny_flux2_dev(seed: int = 0) -> Flux2Pipeline:
    """A random FLUX.2 [dev] pipeline: guidance embedding, a Mistral 3 text encoder and its tokenizer."""
    tokenizer = build_mistral_tokenizer()
    with seeded(seed):
        text_encoder = mistral3_encoder(tokenizer)
        vae = tiny_flux2_vae()
        transformer = tiny_flux2_transformer(len(DEV_TEXT_LAYERS) * text_encoder.config.text_config.hidden_size,
                                             vae.config.latent_channels, guidance_embeds=True)
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    to_eval(pipe)
    return pipe
