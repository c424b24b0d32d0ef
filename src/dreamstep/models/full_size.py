"""Each family's released model (FLUX.1-dev, SDXL base 1.0, ...) built empty: every layer's weight shape without
a byte of weights or a download, for checking that a LoRA fits the model it names. The configs are the family's
(:meth:`~dreamstep.models.family.ModelFamily.released_configs`), a model folder's over them."""

from __future__ import annotations

import gzip
import json
import re
import sys
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from dreamstep.models.family import get_family

# Beside each family's package: models/<family>/released_shapes.json.gz.
RELEASED_SHAPES_NAME = "released_shapes.json.gz"

# transformers >= 5 builds CLIPTextModel without its 'text_model.' level; LoRA files name it either way.
_FLAT_CLIP = re.compile(r"^(text_encoder(?:_2)?)\.encoder\.layers\.")


def with_text_model(name: str) -> str:
    """A diffusers-layout CLIP module name in the form every loader maps
    (``text_encoder.text_model.encoder.layers…``), whichever transformers version named it."""
    return _FLAT_CLIP.sub(r"\1.text_model.encoder.layers.", name)


def weight_shapes(model: str, configs: Mapping[str, Mapping] | None = None) -> dict[str, tuple[int, ...]]:
    """``{diffusers module name: weight shape}`` of every Linear and Conv2d of the model's trainable
    components (e.g. ``transformer.transformer_blocks.0.attn.to_q``: (3072, 3072)), built on the meta
    device from ``configs`` (a pipeline folder's component configs) or, without them, the released model's."""
    if configs is None:
        return dict(_released_shapes(model))
    released = get_family(model).released_configs()
    merged = {**released, **{k: v for k, v in configs.items() if k in released}}
    return _shapes(get_family(model).released_components(merged))


@lru_cache(maxsize=2)
def _released_shapes(model: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """From the table shipped in the family's package: building FLUX.1-dev with T5-XXL on the meta device takes
    seconds, and ``lora info`` should answer in less. ``tests/models`` checks the table against the build;
    :func:`write_released_shapes` makes it again."""
    with gzip.open(released_shapes_file(model), "rt", encoding="utf-8") as f:
        table = json.load(f)
    return tuple((name, tuple(shape)) for name, shape in table.items())


def built_released_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """The released model's shapes as the meta-device build gives them (what the shipped table must hold)."""
    found = get_family(model)
    return _shapes(found.released_components(found.released_configs()))


def released_shapes_file(model: str) -> Path:
    """Where family ``model`` ships its released model's layer shapes."""
    return Path(sys.modules[type(get_family(model)).__module__].__file__).with_name(RELEASED_SHAPES_NAME)


def write_released_shapes(model: str) -> None:
    table = built_released_shapes(model)
    released_shapes_file(model).write_bytes(gzip.compress(json.dumps(table, separators=(",", ":")).encode(), mtime=0))


def _shapes(components: Mapping[str, nn.Module]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for component, module in components.items():
        for name, layer in module.named_modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                shapes[with_text_model(f"{component}.{name}")] = tuple(layer.weight.shape)
    return shapes


def lora_shape_problem(name: str, down: torch.Tensor, up: torch.Tensor,
                       shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why a LoRA module (diffusers name, down (rank, in[, kh, kw]), up (out, rank[, 1, 1])) does not fit the
    layer of that name, or None when it does."""
    weight = shapes.get(name)
    if weight is None:
        return f"module '{name}' does not exist"
    if tuple(down.shape[1:]) != weight[1:]:
        return (f"module '{name}' takes inputs of shape {tuple(down.shape[1:])} (lora_down {tuple(down.shape)}), "
                f"the layer takes {weight[1:]}")
    if up.shape[0] != weight[0]:
        return f"module '{name}' has {up.shape[0]} outputs (lora_up {tuple(up.shape)}), the layer has {weight[0]}"
    return None
