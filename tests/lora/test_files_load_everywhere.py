"""Every LoRA file we write gives the trained delta in diffusers, ComfyUI and sd-scripts, at FLUX.1-dev and
SDXL base shapes built on the meta device, for ranks and alphas with alpha != rank. ComfyUI's and
sd-scripts' rules are in :mod:`loader_rules`; diffusers is its own reader (``lora_state_dict``), whose
full-size-only Kohya FLUX path cannot run on the tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from diffusers.configuration_utils import FrozenDict
from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, convert_unet_state_dict_to_peft
from diffusers.utils.peft_utils import _create_lora_config
from loader_rules import (
    Patch,
    Target,
    assert_same_deltas,
    comfy_flux_key_map,
    comfy_load,
    comfy_sdxl_key_map,
    flux_diffusers_targets,
    probe_deltas,
    sd_scripts_load,
)
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file

from dreamstep.lora.convert import (
    LoraWeights,
    convert_lora,
    diffusers_state_dict,
    kohya_state_dict,
)
from dreamstep.lora.formats import model_keys
from dreamstep.lora.inject import CLIP_LORA_TARGETS
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import diffusers_adapter_metadata
from dreamstep.models.full_size import weight_shapes
from dreamstep.models.published_configs import SDXL_UNET

ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")  # flux-lora's default preset
RANK_ALPHA = [(8, 4.0), (3, 7.0)]


def _random(names: list[str], shapes: dict, rank: int, alpha: float, seed: int = 0) -> dict[str, LoraWeights]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        weight = shapes[name.replace("text_encoder.encoder.", "text_encoder.text_model.encoder.")]
        out[name] = LoraWeights(torch.randn(rank, *weight[1:], generator=g) * 0.1,
                               torch.randn(weight[0], rank, *([1] * (len(weight) - 2)), generator=g) * 0.1, alpha)
    return out


def _flux_trained(rank: int, alpha: float, clip_prefix: str) -> dict[str, LoraWeights]:
    """What flux-lora trains by default with --train_text_encoder, named as PEFT names it under the installed
    transformers (``clip_prefix`` '' for transformers 5, 'text_model.' before)."""
    shapes = weight_shapes("flux")
    names = [n for n in shapes if n.startswith("transformer.") and n.endswith(ATTENTION)
             and ("transformer_blocks." in n)]
    names += [f"text_encoder.{clip_prefix}encoder.layers.{i}.self_attn.{m}" for i in range(12)
              for m in CLIP_LORA_TARGETS]
    return _random(names, shapes, rank, alpha)


def _flux_expected(modules: dict[str, LoraWeights]) -> dict[str, torch.Tensor]:
    """The trained delta on each BFL / ComfyUI weight."""
    targets = flux_diffusers_targets(19, 38, 3072)
    patches = []
    for name, m in modules.items():
        component, _, module = name.partition(".")
        target = (targets[module] if component == "transformer" else
                  Target("clip_l.transformer.text_model." + module.removeprefix("text_model.")))
        patches.append(Patch(target, m.up, m.down, m.scale))
    return probe_deltas(patches)


def _diffusers_input(tmp_path: Path, modules: dict[str, LoraWeights]) -> Path:
    """A diffusers-layout file as diffusers' own save_lora_weights writes it (adapter config in the header)."""
    path = tmp_path / "trained.safetensors"
    write_lora_file(path, diffusers_state_dict(modules), diffusers_adapter_metadata(modules), "safetensors")
    return path


def _diffusers_read(pipeline_class, path: Path) -> list[Patch]:
    """diffusers' own reading of a file, step by step as the pipeline's ``load_lora_weights`` does it:
    ``lora_state_dict`` with that loader's arguments (SDXL's UNet config, which maps sd-scripts' SGM block
    names; FLUX's alphas), then per
    component its key conversion and the ``LoraConfig`` it builds from the header or the alphas; each
    module's scale is the alpha / rank peft gives it from that config. CLIP names come as transformers 5
    has them (no 'text_model.')."""
    kwargs = ({"unet_config": FrozenDict(SDXL_UNET)} if pipeline_class is StableDiffusionXLPipeline
              else {"return_alphas": True})
    state, alphas, metadata = pipeline_class.lora_state_dict(str(path), return_lora_metadata=True, **kwargs)
    patches = []
    for component in ("unet", "transformer", "text_encoder", "text_encoder_2"):
        part = {k.removeprefix(f"{component}."): v for k, v in state.items() if k.startswith(f"{component}.")}
        if not part:
            continue
        part_alphas = {k.removeprefix(f"{component}."): v for k, v in (alphas or {}).items()
                       if k.split(".")[0] == component} or None
        part_metadata = ({k.removeprefix(f"{component}."): v for k, v in metadata.items()
                          if k.startswith(f"{component}.")} if metadata else None)
        if component.startswith("text_encoder"):
            part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
            part = {k.removeprefix("text_model."): v for k, v in part.items()}
        elif "lora_A" not in next(iter(part)):
            part = convert_unet_state_dict_to_peft(part)
        ranks = {f"^{k}": v.shape[1] for k, v in part.items() if "lora_B" in k and v.ndim > 1}
        config = _create_lora_config(part, part_alphas, part_metadata, ranks,
                                     is_unet=not component.startswith("text_encoder"))
        for key, down in part.items():
            if key.endswith(".lora_A.weight"):
                name = key.removesuffix(".lora_A.weight")
                rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), name), config.r)
                alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), name),
                                                 config.lora_alpha)
                patches.append(Patch(Target(f"{component}.{name}"), part[f"{name}.lora_B.weight"], down,
                                     alpha / rank))
    return patches


def _flux_on_bfl(patches: list[Patch]) -> dict[str, torch.Tensor]:
    targets = flux_diffusers_targets(19, 38, 3072)
    moved = []
    for p in patches:
        component, _, module = p.target.weight.partition(".")
        target = (targets[module] if component == "transformer" else
                  Target("clip_l.transformer.text_model." + module.removeprefix("text_model.")))
        moved.append(Patch(target, p.up, p.down, p.scale))
    return probe_deltas(moved)


@pytest.mark.parametrize("clip_prefix", ["", "text_model."])
@pytest.mark.parametrize(("rank", "alpha"), RANK_ALPHA)
def test_flux_diffusers_file_gives_the_trained_delta_in_comfyui_and_diffusers(tmp_path: Path, rank: int,
                                                                            alpha: float, clip_prefix: str) -> None:
    trained = _flux_trained(rank, alpha, clip_prefix)
    out = tmp_path / "ours.safetensors"
    convert_lora(_diffusers_input(tmp_path, trained), out, to="diffusers", model="flux")
    tensors = load_file(out)
    expected = _flux_expected(trained)

    patches, not_loaded = comfy_load(tensors, comfy_flux_key_map())
    assert not_loaded == []
    assert_same_deltas(probe_deltas(patches), expected)
    assert_same_deltas(_flux_on_bfl(_diffusers_read(FluxPipeline, out)), expected)


@pytest.mark.parametrize("clip_prefix", ["", "text_model."])
@pytest.mark.parametrize(("rank", "alpha"), RANK_ALPHA)
def test_flux_kohya_export_gives_the_trained_delta_in_sd_scripts_comfyui_and_diffusers(
        tmp_path: Path, rank: int, alpha: float, clip_prefix: str) -> None:
    trained = _flux_trained(rank, alpha, clip_prefix)
    out = tmp_path / "kohya.safetensors"
    convert_lora(_diffusers_input(tmp_path, trained), out, to="kohya", model="flux")
    tensors = load_file(out)
    expected = _flux_expected(trained)

    key_map = comfy_flux_key_map()
    patches, not_loaded = comfy_load(tensors, key_map)
    assert not_loaded == []
    assert_same_deltas(probe_deltas(patches), expected)
    sd_scripts_names = {k: t for k, t in key_map.items() if k.startswith(("lora_unet_", "lora_te1_"))}
    patches, unknown = sd_scripts_load(tensors, sd_scripts_names)
    assert unknown == []
    assert_same_deltas(probe_deltas(patches), expected)
    assert_same_deltas(_flux_on_bfl(_diffusers_read(FluxPipeline, out)), expected)


def test_flux_kohya_export_of_the_attention_preset_splits_back_to_each_module_in_diffusers(tmp_path: Path) -> None:
    """Single-block q, k, v fuse into BFL's linear1, which also holds the MLP input. diffusers' Kohya reader
    always makes four modules of a linear1 (q, k, v, proj_mlp); in sd-scripts' split layout it gives q, k
    and v back exactly at their own rank, and proj_mlp all zero, instead of every part at three times
    the rank with a copy of the whole down (and a zero up for proj_mlp)."""
    trained = _flux_trained(4, 4.0, "")
    out = tmp_path / "kohya.safetensors"
    convert_lora(_diffusers_input(tmp_path, trained), out, to="kohya", model="flux")
    read = {p.target.weight: p for p in _diffusers_read(FluxPipeline, out)}
    for i in (0, 37):
        for part in ("attn.to_q", "attn.to_k", "attn.to_v"):
            name = f"transformer.single_transformer_blocks.{i}.{part}"
            torch.testing.assert_close(read[name].up @ read[name].down, trained[name].up @ trained[name].down)
            assert read[name].down.shape[0] == 4
        mlp = read[f"transformer.single_transformer_blocks.{i}.proj_mlp"]
        assert mlp.down.shape[0] == 4 and not mlp.down.any() and not mlp.up.any()


def _sdxl_trained(rank: int, alpha: float) -> dict[str, LoraWeights]:
    """sdxl-lora's default network: attention-block Linears of the UNet and both CLIP encoders' attention/MLP."""
    shapes = weight_shapes("sdxl")
    keys = model_keys("sdxl")
    names = [n for n in keys.by_diffusers if n in shapes and (n.startswith("text_encoder") or ".attentions." in n)]
    return _random(names, shapes, rank, alpha)


def _sdxl_expected(modules: dict[str, LoraWeights], key_map: dict[str, Target]) -> dict[str, torch.Tensor]:
    keys = model_keys("sdxl")
    return probe_deltas([Patch(key_map[keys.by_diffusers[n].kohya], m.up, m.down, m.scale) for n, m in modules.items()])


@pytest.mark.parametrize(("rank", "alpha"), RANK_ALPHA)
def test_sdxl_files_give_the_trained_delta_in_sd_scripts_comfyui_and_diffusers(tmp_path: Path, rank: int,
                                                                              alpha: float) -> None:
    trained = _sdxl_trained(rank, alpha)
    kohya_file, diffusers_file = tmp_path / "kohya.safetensors", tmp_path / "diffusers.safetensors"
    keys = model_keys("sdxl")
    write_lora_file(kohya_file, kohya_state_dict({keys.by_diffusers[n].kohya: m for n, m in trained.items()}), {},
                    "safetensors")
    convert_lora(kohya_file, diffusers_file, to="diffusers", model="sdxl")
    key_map = comfy_sdxl_key_map(SDXL_UNET)
    expected = _sdxl_expected(trained, key_map)

    kohya = load_file(kohya_file)
    for patches, left in (comfy_load(kohya, key_map), sd_scripts_load(kohya, key_map)):
        assert left == []
        assert_same_deltas(probe_deltas(patches), expected)
    # diffusers reads both files to the same deltas, on its own module names.
    on_unet = {n: Target(n) for n in trained}
    diffusers_expected = probe_deltas([Patch(on_unet[n], m.up, m.down, m.scale) for n, m in trained.items()])
    for path in (kohya_file, diffusers_file):
        read = [p for p in _diffusers_read(StableDiffusionXLPipeline, path)]
        assert_same_deltas(probe_deltas([Patch(Target(_text_model(p.target.weight)), p.up, p.down, p.scale)
                                         for p in read]), diffusers_expected)
    # ComfyUI maps SDXL attention layers only under diffusers' older 'processor.to_q' names, which the
    # diffusers-layout file therefore uses for its UNet: every key lands, at the trained delta.
    patches, not_loaded = comfy_load(load_file(diffusers_file), key_map)
    assert not_loaded == []
    assert_same_deltas(probe_deltas(patches), expected)


def _text_model(name: str) -> str:
    return name.replace("text_encoder.encoder.", "text_encoder.text_model.encoder.").replace(
        "text_encoder_2.encoder.", "text_encoder_2.text_model.encoder.")


def test_flux_kontext_lora_maps_fully_in_comfyui_and_diffusers_at_full_size(tmp_path: Path) -> None:
    """train flux-kontext-lora's targets (--lora_layers all-linear, which holds the default attention preset), chosen
    as the trainer chooses them on FLUX.1 Kontext [dev]'s transformer (FLUX.1-dev's architecture) built on the meta
    device, written in diffusers' layout then in sd-scripts' names: ComfyUI maps every key of both files, and they
    and diffusers' FluxKontextPipeline give the trained deltas."""
    from accelerate import init_empty_weights
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    from dreamstep.models.family import get_family
    from dreamstep.models.flux.lora_targets import flux_lora_targets

    config = {k: v for k, v in get_family("flux").released_configs()["transformer"].items() if not k.startswith("_")}
    with init_empty_weights():
        transformer = FluxTransformer2DModel.from_config({**config, "guidance_embeds": True})
    names = [f"transformer.{n}" for n in flux_lora_targets(transformer, ["all-linear"])]
    trained = _random(names, weight_shapes("flux"), 4, 8.0)
    expected = _flux_expected(trained)
    diffusers_file, kohya = tmp_path / "diffusers.safetensors", tmp_path / "kohya.safetensors"
    convert_lora(_diffusers_input(tmp_path, trained), diffusers_file, to="diffusers", model="flux")
    convert_lora(diffusers_file, kohya, to="kohya", model="flux")
    for path in (diffusers_file, kohya):
        patches, not_loaded = comfy_load(load_file(path), comfy_flux_key_map())
        assert not_loaded == [], path.name
        assert_same_deltas(probe_deltas(patches), expected)
        assert_same_deltas(_flux_on_bfl(_diffusers_read(FluxKontextPipeline, path)), expected)
