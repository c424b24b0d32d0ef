"""The Kohya LoRA network: sd-scripts' module set and key names on the tiny SDXL, the module maths
(scale, dropouts), files and their hashes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch import nn

from dreamstep.errors import UserError
from dreamstep.lora.io import read_lora_file
from dreamstep.lora.kohya_network import (
    LoRAModule,
    NetworkOptions,
    create_network,
    parse_network_args,
    weight_hashes,
)
from dreamstep.models.sdxl.tiny import build_tiny_sdxl


@pytest.fixture(scope="module")
def tiny():
    pipe = build_tiny_sdxl(seed=0)
    for module in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2):
        module.requires_grad_(False)
    return pipe


def _network(pipe, options: NetworkOptions | None = None, **kwargs):
    encoders = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    return create_network(pipe.unet, encoders, options or NetworkOptions(dim=4, alpha=2.0), **kwargs)


def _transformer_layers(unet) -> int:
    return sum(1 for m in unet.modules() if type(m).__name__ == "Transformer2DModel"
               for c in m.modules() if isinstance(c, nn.Linear))


def test_modules_and_keys_are_sd_scripts(tiny):
    network = _network(tiny)
    try:
        keys = network.state_dict()
        assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
        assert "lora_unet_middle_block_1_proj_in.lora_up.weight" in keys
        assert "lora_unet_output_blocks_0_1_transformer_blocks_0_ff_net_0_proj.alpha" in keys
        assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight" in keys
        assert "lora_te2_text_model_encoder_layers_1_mlp_fc2.lora_up.weight" in keys
        assert {k.rsplit(".", 2)[-2] if k.endswith("weight") else "alpha" for k in keys} == {
            "lora_down", "lora_up", "alpha"}
        unet_modules = network.names("lora_unet")
        assert len(unet_modules) == _transformer_layers(tiny.unet)
        # 2 text encoders x 2 layers x (q, k, v, out, fc1, fc2)
        assert len(network.names("lora_te1")) == len(network.names("lora_te2")) == 12
        assert not any("in_layers" in n or "emb_layers" in n for n in unet_modules)  # no conv LoRA by default
        assert keys["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.alpha"].item() == 2.0
    finally:
        network.detach()


def test_conv_dim_adds_the_resnet_and_sampler_convolutions(tiny):
    network = _network(tiny, NetworkOptions(dim=4, alpha=1.0, conv_dim=2, conv_alpha=0.5), train_text_encoder=False)
    try:
        keys = network.state_dict()
        # down_blocks.0.resnets.0.conv1 (3x3) at conv_dim; its time_emb_proj (Linear) at dim
        assert keys["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape[:2] == (2, 16)
        assert keys["lora_unet_input_blocks_1_0_in_layers_2.alpha"].item() == 0.5
        assert keys["lora_unet_input_blocks_1_0_emb_layers_1.lora_down.weight"].shape[0] == 4
        assert "lora_unet_input_blocks_3_0_op.lora_down.weight" in keys  # Downsample2D
        assert "lora_unet_output_blocks_2_2_conv.lora_down.weight" in keys  # Upsample2D after attention
        assert not network.names("lora_te")
    finally:
        network.detach()


def test_unet_only_and_text_encoder_only(tiny):
    unet_only = _network(tiny, train_text_encoder=False)
    te_only = _network(tiny, train_unet=False)
    try:
        assert unet_only.names("lora_unet") and not unet_only.names("lora_te")
        assert te_only.names("lora_te") and not te_only.names("lora_unet")
    finally:
        unet_only.detach()
        te_only.detach()


def test_zero_initialised_up_leaves_the_model_unchanged_and_hooks_apply_the_scale():
    layer = nn.Linear(6, 5)
    x = torch.randn(3, 7, 6)
    base = layer(x)
    lora = LoRAModule(layer, dim=2, alpha=8.0)
    lora.attach()
    torch.testing.assert_close(layer(x), base)
    with torch.no_grad():
        lora.lora_up.weight.normal_()
    expected = base + (x @ lora.lora_down.weight.T @ lora.lora_up.weight.T) * (8.0 / 2)
    torch.testing.assert_close(layer(x), expected)
    lora.detach()
    torch.testing.assert_close(layer(x), base)


def test_conv_module_matches_hand_computed_output():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    lora = LoRAModule(conv, dim=2, alpha=1.0)
    with torch.no_grad():
        lora.lora_up.weight.normal_()
    x = torch.randn(2, 3, 8, 8)
    expected = nn.functional.conv2d(nn.functional.conv2d(x, lora.lora_down.weight, padding=1),
                                    lora.lora_up.weight) * 0.5
    torch.testing.assert_close(lora(x), expected)


def _trained_module(**dropouts) -> tuple[LoRAModule, torch.Tensor]:
    torch.manual_seed(0)
    lora = LoRAModule(nn.Linear(8, 8), dim=4, alpha=4.0, **dropouts)
    with torch.no_grad():
        lora.lora_up.weight.normal_()
    return lora.train(), torch.randn(2, 5, 8)


def test_rank_dropout_masks_rank_channels_per_sample_and_rescales():
    lora, x = _trained_module(rank_dropout=0.5)
    torch.manual_seed(1)
    out = lora(x)
    torch.manual_seed(1)
    keep = (torch.rand(2, 4) > 0.5).float()[:, None, :]  # (B, 1, rank): one mask per sample
    hidden = lora.lora_down(x) * keep
    torch.testing.assert_close(out, lora.lora_up(hidden) * (1.0 / (1 - 0.5)))
    assert not torch.allclose(out, lora.eval()(x))


def test_module_dropout_skips_the_whole_module_in_training_only():
    lora, x = _trained_module(module_dropout=0.999)
    assert torch.count_nonzero(lora(x)) == 0
    assert torch.count_nonzero(lora.eval()(x)) > 0


def test_network_dropout_acts_on_the_down_output_in_training_only():
    lora, x = _trained_module(dropout=0.5)
    evaluated = lora.eval()(x)
    torch.testing.assert_close(evaluated, lora.lora_up(lora.lora_down(x)))
    assert not torch.allclose(lora.train()(x), evaluated)


def test_network_args_are_typed_and_checked():
    assert parse_network_args(["conv_dim=4", "conv_alpha=1", "rank_dropout=0.1"]) == {
        "conv_dim": 4, "conv_alpha": 1.0, "rank_dropout": 0.1}
    with pytest.raises(UserError, match="did you mean 'conv_dim'"):
        parse_network_args(["conv_dims=4"])
    with pytest.raises(UserError, match="does not support"):
        parse_network_args(["block_dims=2,2,2"])
    with pytest.raises(UserError, match="not key=value"):
        parse_network_args(["conv_dim"])
    with pytest.raises(UserError, match=r"--network_args rank_dropout must be in \[0, 1\)"):
        NetworkOptions(rank_dropout=1.5)


def test_weights_round_trip_and_mismatches_are_named(tiny, tmp_path):
    network = _network(tiny, train_text_encoder=False)
    other = _network(tiny, NetworkOptions(dim=8), train_text_encoder=False)
    te_only = _network(tiny, train_unet=False)
    try:
        with torch.no_grad():
            for p in network.parameters():
                p.normal_()
        path = network.save_weights(tmp_path / "a.safetensors", None, {"ss_network_dim": "4"})
        # The hash in the header is sd-scripts' sha256 of the file's own tensor data (what A1111 checks).
        data = path.read_bytes()
        header = int.from_bytes(data[:8], "little")
        assert read_lora_file(path).metadata["sshs_model_hash"] == hashlib.sha256(data[8 + header:]).hexdigest()
        fresh = _network(tiny, train_text_encoder=False)
        fresh.load_weights(path)
        for key, value in network.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), key
        fresh.detach()
        with pytest.raises(UserError, match="has shape .* use the file's --network_dim"):
            other.load_weights(path)
        with pytest.raises(UserError, match="do not belong to this network"):
            te_only.load_weights(path)
    finally:
        for n in (network, other, te_only):
            n.detach()


def test_weight_hash_is_sd_scripts_sha256_of_the_tensor_data():
    tensors = {"a.lora_down.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    hashes = weight_hashes(tensors, {"ss_steps": "5", "user_note": "ignored"})
    # A one-tensor file's data region is that tensor's little-endian bytes: sd-scripts' model hash is
    # their sha256, and its legacy hash reads 64 KiB at offset 1 MiB, which a small file does not reach.
    raw = np.arange(6, dtype="<f4").tobytes()
    assert hashes == {"sshs_model_hash": hashlib.sha256(raw).hexdigest(),
                      "sshs_legacy_hash": hashlib.sha256(b"").hexdigest()[:8]}
    assert hashes == weight_hashes(tensors, {"ss_steps": "5", "user_note": "changed"})
