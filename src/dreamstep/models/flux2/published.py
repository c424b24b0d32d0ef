"""The published configs of the released FLUX.2 models (``config.json`` of each component on the Hugging Face hub,
as diffusers' ``scripts/convert_flux2_to_diffusers.py`` and the models' folders give them), for the memory plan
and the full-size shape checks when no model folder is given."""

from __future__ import annotations

_TRANSFORMER = dict(patch_size=1, in_channels=128, attention_head_dim=128, timestep_guidance_channels=256,
                    mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6)
KLEIN_4B_TRANSFORMER = dict(_TRANSFORMER, num_layers=5, num_single_layers=20, num_attention_heads=24,
                            joint_attention_dim=7680, guidance_embeds=False)
KLEIN_9B_TRANSFORMER = dict(_TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32,
                            joint_attention_dim=12288, guidance_embeds=False)
DEV_TRANSFORMER = dict(_TRANSFORMER, num_layers=8, num_single_layers=48, num_attention_heads=48,
                       joint_attention_dim=15360, guidance_embeds=True)

_QWEN3 = dict(model_type="qwen3", num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000,
              hidden_act="silu")
QWEN3_4B = dict(_QWEN3, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)  # [klein] 4B's encoder
QWEN3_8B = dict(_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)  # [klein] 9B's

# The released VAE is AutoencoderKLFlux2's defaults: 32 latent channels, 8x down-sampling, batch norm over 2x2 patches.
VAE: dict = {}

# [dev]'s text encoder: Mistral Small 3.1 24B (Mistral3ForConditionalGeneration, its Pixtral vision tower included).
MISTRAL_SMALL_3_1 = dict(
    model_type="mistral3", image_token_index=10, projector_hidden_act="gelu", spatial_merge_size=2,
    multimodal_projector_bias=False, vision_feature_layer=-1,
    text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000000.0,
                     tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14, num_channels=3,
                       rope_theta=10000.0))
