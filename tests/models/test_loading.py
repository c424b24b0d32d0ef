"""load_flux / load_sdxl on the tiny folders and single file, and their one-line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dreamstep.errors import UserError
from dreamstep.models.loading import (
    FluxComponents,
    SDXLComponents,
    load_flux,
    load_sdxl,
)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


def test_load_flux_folder_in_weight_dtype(tiny_flux_dev_dir: Path) -> None:
    parts = load_flux(tiny_flux_dev_dir, weight_dtype=torch.bfloat16)
    assert isinstance(parts, FluxComponents)
    assert parts.transformer.dtype == torch.bfloat16 and parts.vae.dtype == torch.bfloat16
    assert parts.transformer.config.guidance_embeds is True
    assert type(parts.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert parts.tokenizer_2("a photo").input_ids[-1] == parts.tokenizer_2.eos_token_id


def test_load_flux_transformer_single_file(tiny_flux_dir: Path, tiny_flux_dev_dir: Path) -> None:
    # The dev transformer file replaces the folder's; its config comes from the folder given.
    file = tiny_flux_dev_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    parts = load_flux(tiny_flux_dev_dir, transformer_single_file=file)
    assert _same_weights(parts.transformer, load_flux(tiny_flux_dev_dir).transformer)
    with pytest.raises(UserError, match="no-such.safetensors does not exist"):
        load_flux(tiny_flux_dir, transformer_single_file=tiny_flux_dir / "no-such.safetensors")


def test_load_sdxl_folder_and_single_file_agree(tiny_sdxl_dir: Path,
                                                tiny_sdxl_single_file: Path) -> None:
    folder = load_sdxl(tiny_sdxl_dir)
    single = load_sdxl(tiny_sdxl_single_file, config=tiny_sdxl_dir)
    assert isinstance(single, SDXLComponents)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert _same_weights(getattr(folder, name), getattr(single, name)), name
    assert single.tokenizer_2.pad_token == "!"


@pytest.mark.parametrize("loader", [load_flux, load_sdxl])
def test_missing_path_is_named(loader, tmp_path: Path) -> None:
    missing = tmp_path / "models" / "nothing-here"
    with pytest.raises(UserError, match=f"'{missing}' does not exist; give a"):
        loader(missing)


def test_missing_single_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="sd_xl_base_1.0.safetensors does not exist"):
        load_sdxl(tmp_path / "sd_xl_base_1.0.safetensors")


def test_hub_id_offline_says_what_to_do() -> None:
    with pytest.raises(UserError, match=r"could not load 'nobody-xyz/no-such-model' from the Hugging Face hub: "
                                        r"it is not \(fully\) in the local cache and HF_HUB_OFFLINE is set"):
        load_flux("nobody-xyz/no-such-model")


def test_incomplete_folder_names_what_is_missing(tiny_flux_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "flux"
    shutil.copytree(tiny_flux_dir, copy)
    shutil.rmtree(copy / "vae")
    with pytest.raises(UserError, match=r"flux is incomplete: no vae/ folder"):
        load_flux(copy)
    (copy / "model_index.json").unlink()
    with pytest.raises(UserError, match="no model_index.json"):
        load_flux(copy)


def test_wrong_architecture_folder(tiny_sdxl_dir: Path, tiny_flux_dir: Path) -> None:
    with pytest.raises(UserError, match="holds StableDiffusionXLPipeline, not a FluxPipeline"):
        load_flux(tiny_sdxl_dir)
    with pytest.raises(UserError, match="holds FluxPipeline, not a StableDiffusionXLPipeline"):
        load_sdxl(tiny_flux_dir)


def test_files_that_are_not_checkpoints(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    text = tmp_path / "model.safetensors"
    text.write_text("not a checkpoint")
    with pytest.raises(UserError, match="model.safetensors is not a readable .safetensors file"):
        load_sdxl(text, config=tiny_sdxl_dir)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(UserError, match="notes.txt is not a checkpoint"):
        load_sdxl(notes)
    vae_only = tiny_sdxl_dir / "vae" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(UserError, match="is not an SDXL single-file checkpoint"):
        load_sdxl(vae_only, config=tiny_sdxl_dir)
    with pytest.raises(UserError, match="is a file, not a FluxPipeline folder"):
        load_flux(tiny_sdxl_dir / "model_index.json")


def test_a_lone_single_file_offline_names_the_model_config_flag(tiny_sdxl_single_file: Path, tmp_path: Path) -> None:
    lone = tmp_path / "sdxl.safetensors"
    shutil.copy(tiny_sdxl_single_file, lone)
    with pytest.raises(UserError, match="offline, give --model_config a diffusers SDXL folder"):
        load_sdxl(lone)
