"""The diffusers <-> SGM map for SDXL: names known from sd_xl_base_1.0, and round trips."""

from __future__ import annotations

import pytest
import torch

from dreamstep.models.sdxl.sgm_keys import (
    KeyMappingError,
    sdxl_to_sgm,
    sgm_to_sdxl,
    unet_key_map,
    unet_module_map,
)
from dreamstep.models.sdxl.tiny import build_tiny_sdxl


@pytest.fixture(scope="module")
def tiny_sdxl():
    return build_tiny_sdxl(seed=0)


def _real_sdxl_unet_config(tiny_config) -> dict:
    """stabilityai/stable-diffusion-xl-base-1.0's UNet config (the values that shape the key map)."""
    return {**dict(tiny_config), "block_out_channels": [320, 640, 1280], "norm_num_groups": 32,
            "attention_head_dim": [5, 10, 20], "transformer_layers_per_block": [1, 2, 10],
            "cross_attention_dim": 2048, "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816}


def test_module_map_gives_kohya_names(tiny_sdxl) -> None:
    modules = unet_module_map(tiny_sdxl.unet.config)
    assert modules["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"] == \
        "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    assert modules["down_blocks.0.resnets.1.conv1"] == "input_blocks.2.0.in_layers.2"
    assert modules["mid_block.attentions.0.proj_in"] == "middle_block.1.proj_in"
    assert modules["up_blocks.0.resnets.2.time_emb_proj"] == "output_blocks.2.0.emb_layers.1"
    assert modules["add_embedding.linear_1"] == "label_emb.0.0"
    # Every module holding weights has a distinct SGM name.
    assert len(set(modules.values())) == len(modules)


def test_real_sdxl_names(tiny_sdxl) -> None:
    keys = unet_key_map(_real_sdxl_unet_config(tiny_sdxl.unet.config))
    sgm = set(keys.values())
    for known in ("input_blocks.8.1.transformer_blocks.9.attn2.to_k.weight",
                  "input_blocks.6.0.op.weight", "input_blocks.3.0.op.bias",
                  "middle_block.1.transformer_blocks.9.ff.net.0.proj.weight",
                  "output_blocks.2.2.conv.weight", "output_blocks.5.2.conv.weight",
                  "output_blocks.8.0.skip_connection.weight", "output_blocks.0.1.proj_out.weight",
                  "time_embed.2.weight", "label_emb.0.2.bias", "out.2.weight"):
        assert known in sgm, known
    assert len(keys) == len(sgm) == 1680  # the UNet tensor count of sd_xl_base_1.0


def test_round_trip_is_exact(tiny_sdxl) -> None:
    parts = {name: getattr(tiny_sdxl, name).state_dict()
             for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    checkpoint = sdxl_to_sgm(**parts, unet_config=tiny_sdxl.unet.config,
                             vae_config=tiny_sdxl.vae.config)
    assert checkpoint["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight" in checkpoint
    assert "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight" in checkpoint
    back = sgm_to_sdxl(checkpoint, tiny_sdxl.unet.config, tiny_sdxl.vae.config)
    for name, state in parts.items():
        assert back[name].keys() == state.keys(), name
        assert all(torch.equal(back[name][k], v) for k, v in state.items()), name


def test_unknown_keys_raise(tiny_sdxl) -> None:
    parts = {name: getattr(tiny_sdxl, name).state_dict()
             for name in ("unet", "vae", "text_encoder", "text_encoder_2")}
    parts["unet"] = {**parts["unet"], "extra_block.weight": torch.zeros(1)}
    with pytest.raises(KeyMappingError, match="extra_block.weight"):
        sdxl_to_sgm(**parts, unet_config=tiny_sdxl.unet.config, vae_config=tiny_sdxl.vae.config)
    with pytest.raises(KeyMappingError, match="cond_stage_model"):
        sgm_to_sdxl({"cond_stage_model.x": torch.zeros(1)}, tiny_sdxl.unet.config,
                    tiny_sdxl.vae.config)
