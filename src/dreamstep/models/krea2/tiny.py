"""A tiny random Krea 2 pipeline built offline: every block type of the real transformer (text fusion's layer-wise
and refiner blocks, gated attention, the single-stream blocks), Qwen-Image's VAE at 8 channels, and a four-layer
Qwen3-VL (with a two-block vision tower) whose four layers' features the transformer reads, over Z-Image's tiny
Qwen tokenizer (Krea 2's system prompt is its 34 tokens there, as with Qwen's own)."""

from __future__ import annotations

from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLModel

from dreamstep.models.krea2 import configs
from dreamstep.models.tiny import seeded, to_eval
from dreamstep.models.z_image.tiny import build_qwen_tokenizer

TINY_SELECT_LAYERS = (1, 2, 3, 4)


def tiny_qwen3_vl(tokenizer: Qwen2Tokenizer, hidden_size: int = 32) -> Qwen3VLModel:
    """Four decoder layers (4 query heads over 2 key/value heads, interleaved multimodal rotary sections) and a
    two-block vision tower."""
    return Qwen3VLModel(Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
                     "num_hidden_layers": len(TINY_SELECT_LAYERS), "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": hidden_size // 4, "max_position_embeddings": 1024,
                     "pad_token_id": tokenizer.pad_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [1, 1, 2],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": hidden_size, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
    ))


def tiny_transformer(text_hidden_dim: int) -> Krea2Transformer2DModel:
    """Two blocks of width 32 (2 heads of 16 over 1 key/value head; rotary axes 4 + 6 + 6), one layer-wise and one
    refiner text block over four text layers."""
    return Krea2Transformer2DModel(
        in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=text_hidden_dim,
        num_text_layers=len(TINY_SELECT_LAYERS), text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=64, num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6))


def build_tiny_krea2(seed: int = 0, distilled: bool = False) -> Krea2Pipeline:
    """A random Krea 2 pipeline in fp32 on the CPU; ``distilled``: marked as Turbo (``is_distilled``)."""
    tokenizer = build_qwen_tokenizer()
    with seeded(seed):
        text_encoder = tiny_qwen3_vl(tokenizer)
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])
        transformer = tiny_transformer(text_encoder.config.text_config.hidden_size)
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**configs.SCHEDULER), vae=vae,
                         text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                         text_encoder_select_layers=TINY_SELECT_LAYERS, is_distilled=distilled)
    to_eval(pipe)
    return pipe
