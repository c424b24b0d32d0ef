"""The released Krea 2's published configs (RAW, the base for training, and Turbo, 8-step distilled for inference,
share them), the hub ids, and how to tell Turbo from RAW."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

RAW_ID: Final = "krea/Krea-2-Raw"
TURBO_ID: Final = "krea/Krea-2-Turbo"

# transformer/config.json (Krea2Transformer2DModel): 28 blocks of width 6144 (48 heads of 128, 12 key/value heads),
# a text fusion of 12 Qwen3-VL layers' features (2 layer-wise and 2 refiner blocks).
TRANSFORMER: Final = {
    "in_channels": 64, "num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 48,
    "num_key_value_heads": 12, "intermediate_size": 16384, "timestep_embed_dim": 256, "text_hidden_dim": 2560,
    "num_text_layers": 12, "text_num_attention_heads": 20, "text_num_key_value_heads": 20,
    "text_intermediate_size": 6912, "num_layerwise_text_blocks": 2, "num_refiner_text_blocks": 2,
    "axes_dims_rope": [32, 48, 48], "rope_theta": 1000.0, "norm_eps": 1e-5,
}
# text_encoder/config.json: Qwen3-VL-4B-Instruct (Qwen3VLModel: the language model and the vision tower).
TEXT_ENCODER: Final = {
    "text_config": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                        "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [5, 11, 17]},
    "tie_word_embeddings": True,
}
# vae/config.json: Qwen-Image's autoencoder (AutoencoderKLQwenImage's defaults).
VAE: Final = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
              "temperal_downsample": [False, True, True], "dropout": 0.0}
# scheduler/scheduler_config.json: the resolution-aware shift.
SCHEDULER: Final = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                    "base_image_seq_len": 256, "max_image_seq_len": 6400}
# The decoder layers whose hidden states the transformer reads (Krea2Pipeline's default).
SELECT_LAYERS: Final = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)

# Sampling: Turbo 8 steps without guidance (a fixed shift, mu 1.15); RAW 28 steps at 4.5 (the pipeline's example).
TURBO_SAMPLING: Final = {"steps": 8, "guidance_scale": 0.0}
RAW_SAMPLING: Final = {"steps": 28, "guidance_scale": 4.5}


def is_distilled(source: str | Path | None) -> bool:
    """Whether ``source`` is Krea 2 Turbo: a folder's ``model_index.json`` says so (``is_distilled``, which
    Krea2Pipeline reads to fix its shift), else the name ("turbo" in the hub id or folder name)."""
    if source is None:
        return False
    index = Path(str(source)).expanduser() / "model_index.json"
    if index.is_file():
        try:
            return bool(json.loads(index.read_text(encoding="utf-8")).get("is_distilled", False))
        except ValueError:
            return False
    return "turbo" in str(source).lower()
