"""FLUX.2 LoRA files at full size, on the meta device: every key of the ComfyUI file that ``train flux2-lora`` writes
lands, by ComfyUI's rule, on a weight of the released [klein] 4B, [klein] 9B and [dev] checkpoints (Black Forest
Labs' names, which diffusers' own single-file converter turns into the full-size model's weights), with the shape
of the update; and lora info / convert tell a FLUX.2 file from FLUX.1's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file
from torch import nn

from dreamstep.lora.convert import convert_lora, read_lora
from dreamstep.lora.io import write_lora_file
from dreamstep.lora.layouts import LoraWeights, diffusers_file_contents
from dreamstep.models.flux2 import published
from dreamstep.models.flux2.family import FAMILY
from dreamstep.models.flux2.lora_targets import flux2_lora_targets

# Black Forest Labs' FLUX.2 checkpoint: the Linear weights of each double and single block and outside them.
BFL_DOUBLE = ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2",
              "txt_attn.qkv", "txt_attn.proj", "txt_mlp.0", "txt_mlp.2")
BFL_SINGLE = ("linear1", "linear2")
BFL_GLOBAL = ("img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear",
              "double_stream_modulation_img.lin", "double_stream_modulation_txt.lin", "single_stream_modulation.lin")
BFL_GUIDANCE = ("guidance_in.in_layer", "guidance_in.out_layer")
CONFIGS = {"klein-4B": published.KLEIN_4B_TRANSFORMER, "klein-9B": published.KLEIN_9B_TRANSFORMER,
           "dev": published.DEV_TRANSFORMER}


def _linears(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _bfl_shapes(config: dict, diffusers: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The BFL checkpoint's Linear weight shapes, from the diffusers model's (a fused qkv is three of them)."""
    shapes = {}
    for i in range(config["num_layers"]):
        for name in BFL_DOUBLE:
            if name.endswith("qkv"):
                out, width = diffusers[f"transformer_blocks.{i}.attn.to_q"]
                shapes[f"double_blocks.{i}.{name}.weight"] = (3 * out, width)
        shapes |= {f"double_blocks.{i}.{n}.weight": None for n in BFL_DOUBLE if not n.endswith("qkv")}
    shapes |= {f"single_blocks.{i}.{n}.weight": None for i in range(config["num_single_layers"]) for n in BFL_SINGLE}
    shapes |= {f"{n}.weight": None for n in BFL_GLOBAL + (BFL_GUIDANCE if config["guidance_embeds"] else ())}
    return shapes


@pytest.fixture(scope="module", params=list(CONFIGS))
def full_size(request: pytest.FixtureRequest) -> tuple[dict, nn.Module, dict[str, tuple[int, ...]]]:
    config = CONFIGS[request.param]
    transformer = FAMILY.released_components({"transformer": config})["transformer"]
    diffusers = _linears(transformer)
    # diffusers' BFL -> diffusers converter is the oracle of the BFL names: fill in each unfused weight's shape by
    # converting a checkpoint of placeholders, then check the whole conversion lands on the model's weights.
    shapes = _bfl_shapes(config, diffusers)
    probe = {k: torch.empty(s or (1,), device="meta") for k, s in shapes.items()}
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(probe))
    renamed = {k: v for k, v in converted.items() if v.shape == (1,)}
    by_ours = {v: k for k, v in zip(probe, probe.values())}
    for ours, tensor in renamed.items():
        shapes[by_ours[tensor]] = diffusers[ours.removesuffix(".weight")]
    bfl = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    converted = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert {k.removesuffix(".weight"): tuple(v.shape) for k, v in converted.items()} == \
        {k: s for k, s in diffusers.items() if k != "norm_out.linear"}
    return config, transformer, shapes


def test_every_comfyui_key_lands_on_a_full_size_bfl_weight(full_size: tuple, tmp_path: Path) -> None:
    config, transformer, bfl = full_size
    # An all-linear rank-1 LoRA in the diffusers layout, converted as train flux2-lora writes its ComfyUI file.
    linears = _linears(transformer)
    modules = {f"transformer.{name}": LoraWeights(torch.zeros(1, linears[name][1], dtype=torch.bfloat16),
                                                  torch.zeros(linears[name][0], 1, dtype=torch.bfloat16), 1.0)
               for name in flux2_lora_targets(transformer, ["all-linear"])}
    source, comfy = tmp_path / "lora.safetensors", tmp_path / "comfy.safetensors"
    write_lora_file(source, *diffusers_file_contents(modules), "safetensors")
    convert_lora(source, comfy, to="kohya", model="flux2", configs={"transformer": config})
    # ComfyUI's rule for a model's own weights: lora_unet_<checkpoint name with '_'> -> that weight.
    key_map = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in bfl}
    tensors = load_file(comfy)
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in tensors}
    blocks = config["num_layers"] * len(BFL_DOUBLE) + config["num_single_layers"] * len(BFL_SINGLE)
    assert len(names) == blocks and names <= set(key_map), sorted(names - set(key_map))[:3]
    for name in names:
        up, down = tensors[f"{name}.lora_up.weight"], tensors[f"{name}.lora_down.weight"]
        assert (up.shape[0], down.shape[1]) == bfl[key_map[name]], name


def test_a_flux2_file_is_read_as_flux2_when_asked(tmp_path: Path) -> None:
    transformer = FAMILY.released_components({"transformer": published.KLEIN_4B_TRANSFORMER})["transformer"]
    linears = _linears(transformer)
    modules = {f"transformer.{name}": LoraWeights(torch.zeros(2, linears[name][1]), torch.zeros(linears[name][0], 2), 2)
               for name in flux2_lora_targets(transformer, ["attention"])[:6]}
    path = tmp_path / "lora.safetensors"
    write_lora_file(path, *diffusers_file_contents(modules), "safetensors")
    assert read_lora(path, "flux2").model == "flux2"


def test_a_flux2_file_is_told_from_flux1_without_being_asked(tmp_path: Path) -> None:
    """Its names carry FLUX.1's hints (``single_transformer_blocks``), but only FLUX.2 has every module."""
    transformer = FAMILY.released_components({"transformer": published.KLEIN_4B_TRANSFORMER})["transformer"]
    linears = _linears(transformer)
    modules = {f"transformer.{name}": LoraWeights(torch.zeros(2, linears[name][1]), torch.zeros(linears[name][0], 2), 2)
               for name in flux2_lora_targets(transformer, ["all-linear"])}
    assert any(".single_transformer_blocks." in name for name in modules)
    path = tmp_path / "lora.safetensors"
    write_lora_file(path, *diffusers_file_contents(modules), "safetensors")
    assert read_lora(path).model == "flux2"


def test_lora_info_and_convert_know_flux2_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A [klein]-sized ComfyUI file fits the tiny base it names, and converts back to the diffusers layout with the
    same updates (q, k and v split out of the fused qkv)."""
    from dreamstep.cli import main
    from dreamstep.lora.convert import load_lora_as_diffusers
    from dreamstep.models.tiny import write_tiny_model

    base = write_tiny_model("flux2-klein", tmp_path / "klein")
    transformer = Flux2KleinPipeline.from_pretrained(base).transformer
    linears = _linears(transformer)
    generator = torch.Generator().manual_seed(0)
    modules = {f"transformer.{name}": LoraWeights(torch.randn(2, linears[name][1], generator=generator),
                                                  torch.randn(linears[name][0], 2, generator=generator), 1.0)
               for name in flux2_lora_targets(transformer, ["all-linear"])}
    source, comfy, back = tmp_path / "lora.safetensors", tmp_path / "comfy.safetensors", tmp_path / "back.safetensors"
    write_lora_file(source, *diffusers_file_contents(modules), "safetensors")
    assert main(["convert", "lora", str(source), str(comfy), "--to", "kohya", "--model", "flux2", "--base",
                 str(base)]) == 0
    assert main(["lora", "info", str(comfy), "--model", "flux2", "--base", str(base)]) == 0
    assert "fits:      yes" in capsys.readouterr().out
    assert main(["convert", "lora", str(comfy), str(back), "--to", "diffusers", "--model", "flux2", "--base",
                 str(base)]) == 0
    state, _ = load_lora_as_diffusers(back, "flux2", {"transformer": dict(transformer.config)})
    for name, m in modules.items():
        got = state[f"{name}.lora_B.weight"] @ state[f"{name}.lora_A.weight"]
        torch.testing.assert_close(got, m.up @ m.down * m.scale, rtol=1e-4, atol=1e-4)
