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
