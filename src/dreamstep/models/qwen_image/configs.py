"""The published configs of Qwen-Image (``Qwen/Qwen-Image``'s ``config.json`` files on the Hugging Face hub), for the
memory plan without a model folder, the full-size LoRA key checks on the meta device and the tiny model's
scheduler."""

from __future__ import annotations

QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
# The scheduler of inference: the shift follows the image's token count (exponential time shift) and ends at 0.02.
QWEN_IMAGE_SCHEDULER = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
)
# diffusers' training script reads its σ table from the scheduler with shift=3.0 over its config.
TRAINING_SHIFT = 3.0
# AutoencoderKLQwenImage's defaults are Qwen-Image's VAE (Wan 2.1's): 96 wide, 16 latent channels, 8x spatial.
QWEN_IMAGE_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0,
)
# Qwen2.5-VL-7B-Instruct (text model and vision tower), the text encoder of Qwen-Image and Qwen-Image-Edit.
QWEN2_5_VL_7B = dict(
    text_config=dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    ),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, out_hidden_size=3584,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu",
    ),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
)
