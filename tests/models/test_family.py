"""The family registry: every family package is found and has the protocol's members, its key tables fit its
released model at full size, LoRA names tell their family, and the shared layers name no family."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from dreamstep.errors import UserError
from dreamstep.models.family import (
    ModelFamily,
    check_blocks_to_swap,
    families,
    family_of_pipeline,
    get_family,
    guess_family,
)
from dreamstep.models.full_size import weight_shapes

SRC = Path(__file__).resolve().parents[2] / "src" / "dreamstep"


def test_the_registry_finds_every_family_package() -> None:
    packages = {p.parent.name for p in (SRC / "models").glob("*/family.py")}
    assert {type(f).__module__.split(".")[-2] for f in families().values()} == packages
    assert {"flux", "sdxl"} <= set(families())
    for found in families().values():
        assert isinstance(found, ModelFamily)
        assert found.denoiser in found.component_labels


@pytest.mark.parametrize("name", sorted(families()))
def test_key_tables_name_layers_of_the_released_model(name: str) -> None:
    found = get_family(name)
    shapes = weight_shapes(name)
    keys = found.lora_keys(None)
    missing = [m for entry in keys.maps for m in entry.diffusers
               if m.startswith(f"{found.denoiser}.") and m not in shapes]
    # sd-scripts' SDXL table also names the UNet's norm layers (no weight matrix to adapt); nothing else is missing.
    assert all("norm" in m.rsplit(".", 1)[-1] for m in missing), [m for m in missing if "norm" not in m][:3]
    assert len(keys.maps) > len(missing)
    assert {entry.kohya.split("_")[0] + "_" + entry.kohya.split("_")[1] for entry in keys.maps} <= \
        set(found.kohya_prefixes)


def test_pipeline_classes_and_names_tell_the_family() -> None:
    assert family_of_pipeline("FluxKontextPipeline").name == "flux"
    assert family_of_pipeline("StableDiffusionXLPipeline").name == "sdxl"
    assert family_of_pipeline("WanPipeline") is None
    assert guess_family(["lora_unet_double_blocks_0_img_attn_qkv"])[0] == "flux"
    assert guess_family(["lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"])[0] == "sdxl"
    assert guess_family(["lycoris_transformer_blocks_0_attn_to_q"])[0] == "flux"
    assert guess_family(["lora_unet_down_blocks_0_attentions_0_proj_in"])[0] == "sd1"
    assert guess_family(["lora_te1_text_model_encoder_layers_0_mlp_fc1"]) == (None, None)


def test_an_unknown_family_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(UserError, match=r"--model fluxx: unknown model family \(did you mean 'flux'\?\); use one of "
                                         + ", ".join(families())):
        get_family("fluxx")


def test_one_blocks_to_swap_rule() -> None:
    check_blocks_to_swap(0, 4)
    check_blocks_to_swap(4, 4)
    for bad in (-1, 5):
        with pytest.raises(UserError, match=f"--blocks_to_swap {bad}: the model has 4 blocks; choose 0 to 4"):
            check_blocks_to_swap(bad, 4)


def _family_strings(path: Path) -> list[str]:
    """The string constants of a module that are a family's name or start one of its commands ('flux-...')."""
    names = set(families())
    return [f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and (node.value in names or any(node.value.startswith(f"{n}-") for n in names))]


@pytest.mark.parametrize("package", ["engine", "data", "lora", "dashboard", "generation"])
def test_the_shared_layers_name_no_family(package: str) -> None:
    found = [hit for path in sorted((SRC / package).rglob("*.py")) for hit in _family_strings(path)]
    # The dashboard's dataset check starts from a trainer when none is given: a default, not a branch.
    assert found == [] or (package == "dashboard" and all("dataset_check.py" in hit for hit in found)), found


@pytest.mark.parametrize("name", sorted(families()))
def test_every_family_command_resolves_and_names_a_variant(name: str) -> None:
    from dreamstep.cli import COMMANDS
    from dreamstep.config.generate import GenerateConfig

    found = get_family(name)
    assert found.commands, f"{name} has no commands"
    for key, (summary, runner, options) in found.commands.items():
        assert COMMANDS[key].runner == runner and summary
        module, _, function = runner.partition(":")
        assert not function or callable(getattr(importlib.import_module(module), function))
        if key[0] in ("generate", "eval"):
            assert key[1] in found.variants, key
        if key[0] == "generate":
            module, _, name_ = options.partition(":")
            config = getattr(importlib.import_module(module), name_)
            assert issubclass(config, GenerateConfig) and config.model_type == key[1] and config.lora_model == name
