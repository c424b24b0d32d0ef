"""FLUX.1 ControlNet: built from the base transformer or loaded, checked against the base,
run beside it, and saved in the ``save_pretrained`` layout that ``FluxControlNetModel.from_pretrained``
and ``FluxControlNetPipeline`` read.

A ControlNet built from the transformer copies its embedders and its first double- and single-stream
blocks (diffusers' ``from_transformer``); the projections that feed the base (``controlnet_blocks``,
``controlnet_single_blocks``) and the input projection of the control latents (``controlnet_x_embedder``)
start at zero, so at step 0 the base's prediction is unchanged.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxControlNetModel, FluxTransformer2DModel
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from dreamstep.engine.logging import LAYOUT_KEY
from dreamstep.errors import UserError, refusing_pickled_code
from dreamstep.files import atomic_files
from dreamstep.models.quantization import dequantized

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
# Config keys a ControlNet must share with the base transformer for its residuals to fit.
# The repeated blocks: one FSDP unit each when the ControlNet (or the base) is sharded.
BLOCK_CLASSES = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
_SHARED_KEYS = ("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                "pooled_projection_dim")


def check_layers(num_double_layers: int, num_single_layers: int, transformer_config: Any) -> None:
    """Refuse block counts the base transformer (its config: ``num_layers``, ``num_single_layers``) cannot give."""
    have = (transformer_config["num_layers"], transformer_config["num_single_layers"])
    wrong = [f"{flag} {wanted}: the base transformer has {available} such blocks; choose 0 to {available}"
             for flag, wanted, available in (("--num_double_layers", num_double_layers, have[0]),
                                             ("--num_single_layers", num_single_layers, have[1]))
             if not 0 <= wanted <= available]
    if wrong:  # both at once, not one per run
        raise UserError("; ".join(wrong))
    if num_double_layers + num_single_layers == 0:
        raise UserError("--num_double_layers and --num_single_layers are both 0; the ControlNet needs a block")


def build_from_transformer(transformer: FluxTransformer2DModel, num_double_layers: int,
                           num_single_layers: int) -> FluxControlNetModel:
    """A new fp32 ControlNet with the transformer's first ``num_double_layers`` / ``num_single_layers``
    blocks; its output projections and control-input projection are zero (see the module docstring)."""
    config = transformer.config
    check_layers(num_double_layers, num_single_layers, config)
    controlnet = FluxControlNetModel.from_transformer(
        transformer, num_layers=num_double_layers, num_single_layers=num_single_layers,
        attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
        load_weights_from_transformer=False)
    _copy_from_transformer(controlnet, transformer)
    return controlnet


def meta_builder(num_double_layers: int, num_single_layers: int) -> Callable[[nn.Module], FluxControlNetModel]:
    """What the memory plan builds beside a transformer on the meta device: a ControlNet of these blocks, without
    copying weights (the plan counts its parameters and prices its passes)."""

    def build(transformer: nn.Module) -> FluxControlNetModel:
        config = transformer.config
        return FluxControlNetModel.from_transformer(
            transformer, num_layers=num_double_layers, num_single_layers=num_single_layers,
            attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
            load_weights_from_transformer=False)

    return build


# The parts a ControlNet built from the transformer starts from (what diffusers' from_transformer copies).
_COPIED = ("pos_embed.", "time_text_embed.", "context_embedder.", "x_embedder.", "transformer_blocks.",
           "single_transformer_blocks.")


@torch.no_grad()
def _copy_from_transformer(controlnet: FluxControlNetModel, transformer: FluxTransformer2DModel) -> None:
    """Copy the shared parts' weights; a quantized transformer (``--base_quantization``) gives its
    dequantized values, the weights it computes with. The control-input projection starts at zero."""
    source = dict(transformer.named_parameters()) | dict(transformer.named_buffers())
    for name, target in [*controlnet.named_parameters(), *controlnet.named_buffers()]:
        if name.startswith(_COPIED) and name in source:
            target.copy_(dequantized(source[name]).to(target.dtype))
    torch.nn.init.zeros_(controlnet.controlnet_x_embedder.weight)
    torch.nn.init.zeros_(controlnet.controlnet_x_embedder.bias)


def load(path: str, transformer: FluxTransformer2DModel) -> FluxControlNetModel:
    """A trained ControlNet (a ``save_pretrained`` folder or a hub id) in its saved dtype, its config checked
    against the base first (:func:`check_trained`)."""
    folder = check_trained(path, transformer.config)
    try:
        with refusing_pickled_code(path, "--controlnet_model_name_or_path"):
            controlnet = FluxControlNetModel.from_pretrained(str(folder) if folder.exists() else path)
    except (OSError, ValueError) as e:
        raise UserError(f"--controlnet_model_name_or_path {path}: cannot load the ControlNet ({e})") from None
    return controlnet


def check_trained(path: str, transformer_config: Any) -> Path:
    """Refuse, from its config alone and before anything loads or is written, a trained ControlNet that cannot be
    read or does not fit the base transformer (its config); returns the folder (a hub id's may not exist)."""
    where = f"--controlnet_model_name_or_path {path}"
    folder = Path(path).expanduser()
    if folder.exists() and not (folder / CONFIG_NAME).is_file():
        raise UserError(f"{where}: no {CONFIG_NAME} there; give the folder that train flux-controlnet (or "
                        "save_pretrained) wrote")
    try:
        config = FluxControlNetModel.load_config(str(folder) if folder.exists() else path)
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: cannot load the ControlNet ({e})") from None
    if not all(key in config for key in _SHARED_KEYS):
        raise UserError(f"{where}: {CONFIG_NAME} there is not a FLUX ControlNet's (no {_SHARED_KEYS[0]} or "
                        "widths); give the folder that train flux-controlnet wrote")
    check_matches({"guidance_embeds": False, **config}, transformer_config, where)
    if folder.exists() and not any(folder.glob("diffusion_pytorch_model*")):
        raise UserError(f"{where}: no weights (diffusion_pytorch_model.safetensors) beside its {CONFIG_NAME}; give "
                        "the folder that train flux-controlnet wrote")
    return folder


def check_matches(controlnet_config: Any, transformer_config: Any, where: str) -> None:
    """Refuse a ControlNet (its config) whose widths, inputs or guidance embedding differ from the base
    transformer's (its config)."""
    for key in (*_SHARED_KEYS, "guidance_embeds"):
        ours, theirs = controlnet_config[key], transformer_config[key]
        if ours != theirs:
            raise UserError(f"{where}: the ControlNet has {key}={ours} but the base transformer has {theirs}; "
                            "use a ControlNet trained for this base model")
    if controlnet_config.get("conditioning_embedding_channels") is not None or \
            controlnet_config.get("num_mode") is not None:
        raise UserError(f"{where}: XLabs-style (input_hint_block) and Union ControlNets are not supported "
                        "for training; give an InstantX-style ControlNet or build one from the transformer")


def cast(controlnet: FluxControlNetModel, dtype: torch.dtype) -> FluxControlNetModel:
    """Cast the weights to fp32 or bf16 (``.to(dtype)`` would print a spurious diffusers warning)."""
    return controlnet.float() if dtype == torch.float32 else controlnet.bfloat16()


def residuals(controlnet: torch.nn.Module, **inputs: Any) -> dict[str, list[torch.Tensor] | None]:
    """Run the ControlNet; return its per-block residuals under the names the transformer takes them.

    Double-stream residuals: one (B, N, D) tensor per ControlNet double block, single-stream: one per
    single block; the transformer adds residual ``i // ceil(blocks / residuals)`` after block ``i``.
    """
    block_samples, single_block_samples = controlnet(return_dict=False, **inputs)
    return {"controlnet_block_samples": block_samples, "controlnet_single_block_samples": single_block_samples}


def save(controlnet: FluxControlNetModel, output_dir: str | Path,
         state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """``config.json`` + ``diffusion_pytorch_model.safetensors`` in ``output_dir``; returns the weights path.
    ``state_dict`` replaces the model's own tensors (a sharded model's full state, gathered beforehand).

    Written into a temporary folder beside them and renamed into place, so a crash never leaves a
    half-written model where a complete one was."""
    with atomic_files(output_dir) as tmp:
        if state_dict is None:
            controlnet.save_pretrained(tmp, safe_serialization=True)
        else:
            controlnet.save_config(tmp)
            save_file({name: t.contiguous() for name, t in state_dict.items()}, str(tmp / WEIGHTS_NAME),
                      metadata={"format": "pt"})
        _drop_foreign_config_keys(tmp / CONFIG_NAME)
    return Path(output_dir) / WEIGHTS_NAME


def _drop_foreign_config_keys(config_file: Path) -> None:
    """A ControlNet built from a transformer inherits its config keys, some of which (``out_channels``)
    FluxControlNetModel does not take: every later load would warn that they are ignored. Keep only its own."""
    accepted = set(inspect.signature(FluxControlNetModel.__init__).parameters)
    config = json.loads(config_file.read_text())
    config = {k: v for k, v in config.items() if k.startswith("_") or k in accepted}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def side_by_side(rows: list[list[Image.Image]]) -> Image.Image:
    """One image: each row (a control image, then its results) left to right, rows top to bottom. The
    results' generation parameters (``info["dreamstep"]``) are carried over as a list, with where each result is
    (:data:`~dreamstep.engine.logging.LAYOUT_KEY`) for its label."""
    cell_w = max(im.width for row in rows for im in row)
    cell_h = max(im.height for row in rows for im in row)
    grid = Image.new("RGB", (max(len(r) for r in rows) * cell_w, len(rows) * cell_h), "white")
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            grid.paste(image.convert("RGB").resize((cell_w, cell_h)), (x * cell_w, y * cell_h))
    placed = [(im.info["dreamstep"], x * cell_w) for row in rows for x, im in enumerate(row)
              if isinstance(im.info.get("dreamstep"), dict)]
    grid.info["dreamstep"] = [cell for cell, _ in placed]
    grid.info[LAYOUT_KEY] = [(x, cell_w) for _, x in placed]  # each result's label goes under it
    return grid
