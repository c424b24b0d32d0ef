"""LoKr, LoHa, LoCon/LoRA and DoRA files that dreamstep writes load in ComfyUI (every key consumed, every delta
the shape of its weight) at FLUX.1-dev and SDXL base shapes on the meta device, carry the names sd-scripts'
``lycoris.kohya`` builds modules for and that LyCORIS' own reader rebuilds; and on full-width models of reduced
depth, with real values, the weight ComfyUI computes from the file is the weight the module trained with.
ComfyUI's rules are in :mod:`lycoris_rules`."""

from __future__ import annotations

import pytest
import torch
from loader_rules import comfy_flux_key_map, comfy_sdxl_key_map, flux_diffusers_targets
from lycoris.modules import get_module
from lycoris_rules import comfy_load_lycoris, comfy_weight, diff_shape
from torch import nn

from dreamstep.config.lycoris import LycorisOptions
from dreamstep.lora.formats import model_keys
from dreamstep.lora.inject import CLIP_LORA_TARGETS
from dreamstep.lora.lycoris_network import create_network, file_names, sdxl_targets
from dreamstep.models.family import get_family
from dreamstep.models.flux.lora_targets import flux_lora_targets
from dreamstep.models.published_configs import SDXL_UNET

TYPES = {
    "lokr": LycorisOptions("lokr", dim=16, alpha=8.0, factor=16),
    "lokr-both": LycorisOptions("lokr", dim=4, alpha=2.0, factor=8, decompose_both=True),
    "loha": LycorisOptions("loha", dim=16, alpha=8.0),
    "lora": LycorisOptions("lora", dim=16, alpha=8.0, conv_dim=8, conv_alpha=4.0),
}


def _comfy_flux_names() -> dict:
    """ComfyUI's FLUX map for LyCORIS names (``lycoris_<diffusers path>``, SimpleTuner's form) and CLIP-L."""
    names = {f"lycoris_{k.replace('.', '_')}": t for k, t in flux_diffusers_targets(19, 38, 3072).items()}
    return names | {k: t for k, t in comfy_flux_key_map().items() if k.startswith("lora_te1_")}


def _flux(configs: dict) -> tuple[dict, dict]:
    models = get_family("flux").released_components(configs)
    transformer, clip = models["transformer"], models["text_encoder"]
    names = file_names(model_keys("flux", configs), {"transformer": transformer, "text_encoder": clip})
    targets = {f"transformer.{p}": transformer.get_submodule(p) for p in flux_lora_targets(transformer, ["all-linear"])}
    targets |= {f"text_encoder.{p}": m for p, m in clip.named_modules() if p.endswith(CLIP_LORA_TARGETS)}
    return names, targets


def _sdxl(configs: dict) -> tuple[dict, dict]:
    models = get_family("sdxl").released_components(configs)
    encoders = {"text_encoder": models["text_encoder"], "text_encoder_2": models["text_encoder_2"]}
    names = file_names(model_keys("sdxl", configs), {"unet": models["unet"], **encoders})
    return names, sdxl_targets(models["unet"], encoders, "full", conv=True)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_full_size_files_load_in_comfyui_and_lycoris_with_every_key(model: str, kind: str) -> None:
    configs = get_family(model).released_configs()
    names, targets = (_flux if model == "flux" else _sdxl)(configs)
    network = create_network(names, targets, TYPES[kind])  # the modules move to their layers' meta device
    tensors = network.state_dict()
    comfy_names = _comfy_flux_names() if model == "flux" else comfy_sdxl_key_map(SDXL_UNET)

    patches, not_loaded = comfy_load_lycoris(tensors, comfy_names)

    assert not_loaded == []
    assert sorted(patches) == sorted(network.loras)
    for name, patch in patches.items():
        layer = names[name][1]
        assert diff_shape(patch) == (layer.weight.shape[0], layer.weight[0].numel()), name
        target = comfy_names[name]
        assert getattr(target, "rows", None) in (None, layer.weight.shape[0]), name
        assert get_module(tensors, name)[0] is not None, name
    if model == "sdxl":  # sd-scripts' lycoris.kohya builds modules named after its own (SGM) UNet paths
        keys = model_keys("sdxl")
        sd_scripts = {m.kohya for m in keys.maps}
        assert set(network.loras) <= sd_scripts
        assert any("_input_blocks_" in n for n in network.loras)
        assert any(n.startswith("lora_te2_") for n in network.loras)


def _materialise(layers: dict[str, nn.Module], seed: int) -> None:
    """Real random values in the chosen layers of a meta model (the rest stays on the meta device)."""
    g = torch.Generator().manual_seed(seed)
    for layer in layers.values():
        layer.to_empty(device="cpu")
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.02)
            if layer.bias is not None:
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=g) * 0.02)


def _trained(network, seed: int) -> None:
    """Every adapter tensor away from its initial value, as after training (LoKr/LoHa/LoRA start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _bias(layer: nn.Module) -> torch.Tensor:
    return layer.bias.double() if layer.bias is not None else torch.zeros(layer.weight.shape[0], dtype=torch.float64)


def _layer_output(layer: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, nn.Conv2d):
        return nn.functional.conv2d(x, weight, _bias(layer), layer.stride, layer.padding)
    return nn.functional.linear(x, weight, _bias(layer))


def _probe(layer: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (1, layer.in_channels, 8, 8) if isinstance(layer, nn.Conv2d) else (2, layer.in_features)
    return torch.randn(shape, generator=g)


REDUCED = {
    "flux": lambda c: {**c, "transformer": {**c["transformer"], "num_layers": 1, "num_single_layers": 1}},
    "sdxl": lambda c: {**c, "unet": {**c["unet"], "transformer_layers_per_block": [1, 1, 1]},
                       "text_encoder_2": {**c["text_encoder_2"], "num_hidden_layers": 1}},
}
# A few layers of each kind at full width (materialising every layer of a full-width model would take GiBs).
SAMPLE = {
    "flux": ("transformer.transformer_blocks.0.attn.to_q", "transformer.single_transformer_blocks.0.attn.to_k",
             "transformer.transformer_blocks.0.ff.net.2", "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"),
    "sdxl": ("unet.mid_block.attentions.0.transformer_blocks.0.attn2.to_k", "unet.mid_block.resnets.0.conv1",
             "unet.down_blocks.1.resnets.0.conv_shortcut", "text_encoder_2.text_model.encoder.layers.0.mlp.fc1"),
}


def _sampled(model: str) -> tuple[dict, dict]:
    names, targets = (_flux if model == "flux" else _sdxl)(REDUCED[model](get_family(model).released_configs()))
    targets = {n: targets[n.replace("text_encoder.text_model.", "text_encoder.").replace(
        "text_encoder_2.text_model.", "text_encoder_2.")] if n not in targets else targets[n] for n in SAMPLE[model]}
    _materialise(targets, 0)
    return names, targets


DORA = {"dora": LycorisOptions("lora", dim=8, alpha=4.0, dora_wd=True),  # per input column, dreamstep's default
        "loha-dora": LycorisOptions("loha", dim=8, alpha=4.0, dora_wd=True)}
DORA_BY_ROW = LycorisOptions("lora", dim=8, alpha=4.0, dora_wd=True, wd_on_output=True)  # LyCORIS' default


def _trained_and_comfy(model: str, options: LycorisOptions):
    """For each sampled full-width layer: (diffusers name, layer, the network, the trained layer's output on a probe,
    ComfyUI's on the same probe, the base layer's)."""
    torch.manual_seed(0)  # LyCORIS initialises from the global generator
    names, targets = _sampled(model)
    network = create_network(names, targets, options)
    _trained(network, 1)
    tensors = network.state_dict()
    comfy_names = _comfy_flux_names() if model == "flux" else comfy_sdxl_key_map(SDXL_UNET)
    patches, not_loaded = comfy_load_lycoris(tensors, comfy_names)
    assert not_loaded == []
    by_layer = {id(layer): name for name, (_, layer) in names.items()}
    for diffusers, layer in targets.items():
        name = by_layer[id(layer)]
        x = _probe(layer, 2)
        with torch.no_grad():
            trained = layer(x).double()  # the forward the module trains through
            comfy = _layer_output(layer, comfy_weight(patches[name], layer.weight), x.double())
            base = _layer_output(layer, layer.weight.double(), x.double())
        assert (trained - base).abs().max() > 1e-4, diffusers  # the adapter changes the layer
        yield diffusers, layer, network.loras[name], trained, comfy


@pytest.mark.parametrize("kind", [*TYPES, *DORA])
@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_comfyui_computes_the_trained_weight_at_full_width(model: str, kind: str) -> None:
    for diffusers, _, _, trained, comfy in _trained_and_comfy(model, TYPES.get(kind) or DORA[kind]):
        torch.testing.assert_close(comfy, trained, rtol=1e-4, atol=1e-5 * float(trained.abs().max()), msg=diffusers)


@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_a_dora_by_output_row_differs_in_comfyui_by_the_row_norm_ratio(model: str) -> None:
    """wd_on_output=True (LyCORIS' default, peft's form): ComfyUI and Forge divide by the *base* weight's row norm
    where the module divides by the adapted one's, so their weight is the trained one times |W + dW| / |W| per row."""
    for diffusers, layer, module, trained, comfy in _trained_and_comfy(model, DORA_BY_ROW):
        adapted = layer.weight.double() + module.get_diff_weight(1.0)[0].double().reshape(layer.weight.shape)
        ratio = adapted.flatten(1).norm(dim=1) / layer.weight.double().flatten(1).norm(dim=1)
        bias = _bias(layer).reshape((1, -1, 1, 1) if isinstance(layer, nn.Conv2d) else (1, -1))
        shape = (1, -1, 1, 1) if isinstance(layer, nn.Conv2d) else (1, -1)
        torch.testing.assert_close((trained - bias) * ratio.reshape(shape), comfy - bias, rtol=1e-4,
                                   atol=1e-5 * float(comfy.abs().max()), msg=diffusers)
        assert (ratio - 1).abs().max() > 1e-3, diffusers  # a real difference, not rounding
