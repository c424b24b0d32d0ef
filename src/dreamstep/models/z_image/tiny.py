"""A tiny random Z-Image pipeline built offline: every block type of the real transformer (main blocks, noise and
context refiners, a 2x2 patch embedder), FLUX.1's 8x VAE layout with 16 latent channels, and a two-layer Qwen3
text encoder over a small byte-level BPE tokenizer with Qwen's chat markers (the pipeline wraps every prompt in a
chat template and reads the encoder's second-to-last hidden state)."""

from __future__ import annotations

from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from tokenizers import AddedToken
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model

from dreamstep.models.tiny import seeded, tiny_vae, to_eval
from dreamstep.models.z_image import configs

# Words merged whole in the tiny vocabulary (with and without a leading space), so prompts tokenize into a few
# tokens.
WORDS = ("a", "photo", "of", "sks", "dog", "cat", "person", "the", "in", "on", "style", "red", "blue", "with", "and",
         "robot")
# Whole tokens as in Qwen's vocabulary: the chat roles, and the words of Krea 2's system prompt, so that it is the 34
# tokens (and the assistant's opening the 5) its pipeline cuts off, as with Qwen's own tokenizer.
WHOLE_TOKENS = ("system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color", " shape",
                " size", " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
                " background")
_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's chat layout (the part ZImagePipeline uses: one user turn, then the assistant's turn opened).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level symbols, the merges of :data:`WORDS` (those with a leading space first, so that a word after a
    space becomes one token too), then specials."""
    tokens = sorted(ByteLevel.alphabet())
    merges: list[tuple[str, str]] = []
    for text in [" " + word for word in WORDS] + list(WORDS):
        pieces = ["Ġ" if c == " " else c for c in text]
        while len(pieces) > 1:
            merge = (pieces[0], pieces[1])
            merged = pieces[0] + pieces[1]
            if merge not in merges:
                merges.append(merge)
            if merged not in tokens:
                tokens.append(merged)
            pieces = [merged] + pieces[2:]
    tokens += list(_SPECIALS)
    return {token: i for i, token in enumerate(tokens)}, merges


def build_qwen_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer (byte-level BPE, ``<|endoftext|>`` padding, Qwen's chat template) over a tiny vocabulary;
    any text encodes, unknown words byte by byte."""
    vocab, merges = _vocab_and_merges()
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                               model_max_length=32768)
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in WHOLE_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3(tokenizer: Qwen2Tokenizer, hidden_size: int = 32) -> Qwen3Model:
    """A two-layer Qwen3 encoder (grouped-query attention as Qwen3-4B: 4 query heads over 2 key/value heads)."""
    return Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id))


def tiny_transformer(cap_feat_dim: int) -> ZImageTransformer2DModel:
    """Two main blocks, one noise and one context refiner, width 32 (2 heads of 16; rotary axes 4 + 6 + 6)."""
    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=cap_feat_dim, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])


def build_tiny_z_image(seed: int = 0) -> ZImagePipeline:
    """A random Z-Image pipeline in fp32 on the CPU. The base and Turbo differ only in their weights, so one build
    serves both variants."""
    tokenizer = build_qwen_tokenizer()
    with seeded(seed):
        text_encoder = tiny_qwen3(tokenizer)
        vae = tiny_vae(latent_channels=16, scaling_factor=configs.VAE["scaling_factor"],
                       shift_factor=configs.VAE["shift_factor"], quant_conv=False)
        transformer = tiny_transformer(text_encoder.config.hidden_size)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**configs.SCHEDULER), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    to_eval(pipe)
    return pipe
