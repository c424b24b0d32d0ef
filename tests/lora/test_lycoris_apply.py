"""A LyCORIS file applied by generate and eval (LyCORIS' own modules rebuilt from the file, merged into the weight
or on the forward) gives the layer the trained module gave it, for every algorithm, on Linear and 3x3 Conv2d
layers of unequal widths, with alpha != rank, at weight 1 and 0.5."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dreamstep.config.lycoris import LycorisOptions
from dreamstep.lora.lycoris_network import apply_lycoris, create_network

TYPES = {
    "lokr": LycorisOptions("lokr", dim=2, alpha=3.0, factor=4),
    "lokr-full": LycorisOptions("lokr", dim=100, alpha=3.0, factor=4),
    "loha": LycorisOptions("loha", dim=2, alpha=3.0),
    "lora": LycorisOptions("lora", dim=2, alpha=3.0, conv_dim=2, conv_alpha=1.0),
    "dora": LycorisOptions("lora", dim=2, alpha=3.0, conv_dim=2, conv_alpha=1.0, dora_wd=True),
    "loha-dora": LycorisOptions("loha", dim=2, alpha=3.0, dora_wd=True),
}
LAYERS = {"linear": lambda: nn.Linear(64, 16), "conv": lambda: nn.Conv2d(8, 16, 3, padding=1)}


@pytest.mark.parametrize("layer_kind", list(LAYERS))
@pytest.mark.parametrize("kind", list(TYPES))
def test_applied_file_gives_the_trained_layer(kind: str, layer_kind: str) -> None:
    torch.manual_seed(0)
    layer = LAYERS[layer_kind]()
    fresh = copy.deepcopy(layer)
    network = create_network({"m": ("m", layer)}, {"m": layer}, TYPES[kind])
    with torch.no_grad():
        for p in network.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    tensors = {k: v.detach().clone() for k, v in network.state_dict().items()}
    x = torch.randn(2, 64) if layer_kind == "linear" else torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        base = fresh(x)
        trained = layer(x)
        for weight in (1.0, 0.5):
            forward, merged = copy.deepcopy(fresh), copy.deepcopy(fresh)
            apply_lycoris(tensors, {"m": ("m", forward)}, weight, False, "file")
            apply_lycoris(tensors, {"m": ("m", merged)}, weight, True, "file")
            if weight == 1.0:
                torch.testing.assert_close(forward(x), trained, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(merged(x), forward(x), rtol=1e-5, atol=1e-5)
            assert (forward(x) - base).abs().max() > 1e-2
