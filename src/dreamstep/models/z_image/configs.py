"""The released Z-Image's published configs (``Tongyi-MAI/Z-Image`` and ``-Turbo`` share them but the scheduler's
use), the hub ids of the base and the distilled model, and how to tell one from the other."""

from __future__ import annotations

from pathlib import Path
from typing import Final

BASE_ID: Final = "Tongyi-MAI/Z-Image"
TURBO_ID: Final = "Tongyi-MAI/Z-Image-Turbo"

# transformer/config.json (ZImageTransformer2DModel): 30 main blocks, 2 noise and 2 context refiners, width 3840.
TRANSFORMER: Final = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
    "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True,
    "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
    "axes_lens": [1024, 512, 512],
}
# text_encoder/config.json: Qwen3-4B (its second-to-last hidden state is the caption feature).
TEXT_ENCODER: Final = {
    "architectures": ["Qwen3Model"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
}
# vae/config.json: FLUX.1's autoencoder (16 latent channels, 8x).
VAE: Final = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
    "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
    "use_post_quant_conv": False, "force_upcast": True,
}
SCHEDULER: Final = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}

# Sampling as each model card recommends: Turbo 9 steps (8 transformer calls) without guidance; the base 50 at 4.
TURBO_SAMPLING: Final = {"steps": 9, "guidance_scale": 0.0}
BASE_SAMPLING: Final = {"steps": 50, "guidance_scale": 4.0}


def is_distilled(source: str | Path | None) -> bool:
    """Whether ``source`` (a folder or hub id) is the distilled Z-Image Turbo. Its files are the base's in every
    config (same transformer, scheduler and encoder), so only the name tells: "turbo" in the hub id or in the
    folder's name (the folder ``hf download Tongyi-MAI/Z-Image-Turbo --local-dir`` makes, or the hub cache's
    ``models--Tongyi-MAI--Z-Image-Turbo``)."""
    if source is None:
        return False
    path = Path(str(source)).expanduser()
    name = str(source)
    if path.exists():
        path = path.resolve()
        name = path.parent.parent.name if path.parent.name == "snapshots" else path.name
    return "turbo" in name.lower()
