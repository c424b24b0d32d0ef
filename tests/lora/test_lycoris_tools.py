"""``lora info`` and ``convert lora`` on LyCORIS files written by the trainers' code: the report names each
algorithm with its settings (factor, rank, full matrix, Tucker, DoRA), counts parameters and checks the modules
against the model; ``convert`` refuses in one line what no layout holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from lora_testkit import inference_mode
from test_cli import _error, _run

from dreamstep.lora.formats import model_keys, pipeline_configs
from dreamstep.lora.inject import flux_lora_targets
from dreamstep.lora.lycoris_network import LycorisOptions, create_network, file_names, sdxl_targets


def _write(pipe, model: str, options: LycorisOptions, path: Path) -> tuple[Path, int]:
    """The trainers' network over the tiny pipeline, saved; and its trainable parameter count."""
    if model == "flux":
        components = {"transformer": pipe.transformer}
        targets = {f"transformer.{p}": pipe.transformer.get_submodule(p)
                   for p in flux_lora_targets(pipe.transformer, ["attention"])}
    else:
        components = {"unet": pipe.unet, "text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
        encoders = {k: v for k, v in components.items() if k != "unet"}
        targets = sdxl_targets(pipe.unet, encoders, "full", conv=options.conv_dim != 0)
    network = create_network(file_names(model_keys(model, pipeline_configs(pipe)), components), targets, options)
    network.save_weights(path, None, {"ss_network_module": "lycoris.kohya"})
    network.detach()
    return path, sum(p.numel() for p in network.parameters())


@pytest.fixture(scope="module")
def flux_dev(tiny_flux_dev_dir: Path):
    return inference_mode(FluxPipeline.from_pretrained(tiny_flux_dev_dir))


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_dir: Path):
    return inference_mode(StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir))


def test_lora_info_names_the_lokr_and_its_settings(capsys, flux_dev, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    lokr = LycorisOptions("lokr", dim=2, alpha=1.0, factor=4)
    path, params = _write(flux_dev, "flux", lokr, tmp_path / "k.safetensors")
    code, out, _ = _run(capsys, "lora", "info", path, "--base", tiny_flux_dev_dir)
    assert code == 0, out
    assert "format:    lycoris-flux: LyCORIS layout (LoKr; ComfyUI, Forge, LyCORIS on diffusers' FLUX" in out
    assert f"params:    {params:,}" in out
    assert "yes, every module exists with its shape" in out
    groups = {line.split()[0]: line.split(None, 3)[3] for line in out.split("groups:\n")[1].split("metadata:")[0]
              .splitlines()}
    assert groups["lycoris_transformer_blocks"] == "LoKr (factor 4, rank 2)  alpha 1  192 params"
    assert groups["lycoris_single_transformer_blocks"] == "LoKr (factor 4, rank 2)  alpha 1  144 params"
    assert "ss_network_module: lycoris.kohya" in out

    code, out, _ = _run(capsys, "lora", "info", path)  # against FLUX.1-dev: the tiny file's widths do not fit
    assert code == 0 and "fits:      NO: module 'lycoris_" in out and "give the model folder with --base" in out


def test_lora_info_on_sdxl_loha_dora_and_locon(capsys, sdxl, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    cases = {"loha": (LycorisOptions("loha", dim=2, alpha=1.0, conv_dim=0), "LoHa (rank 2)"),
             "dora": (LycorisOptions("lora", dim=2, alpha=1.0, conv_dim=0, dora_wd=True), "LoRA (rank 2, DoRA)"),
             "tucker": (LycorisOptions("lora", dim=4, alpha=1.0, conv_dim=2, use_tucker=True), "LoRA (rank 2, Tucker)")}
    for name, (options, expected) in cases.items():
        path, params = _write(sdxl, "sdxl", options, tmp_path / f"{name}.safetensors")
        code, out, _ = _run(capsys, "lora", "info", path, "--base", tiny_sdxl_dir)
        assert code == 0 and "format:    lycoris-sdxl" in out
        assert "target:    SDXL: text_encoder, text_encoder_2, unet" in out
        assert f"params:    {params:,}" in out and "yes, every module exists" in out
        assert expected in out, out


def test_convert_refuses_a_lokr_in_one_line(capsys, flux_dev, tmp_path: Path) -> None:
    path, _ = _write(flux_dev, "flux", LycorisOptions("lokr", dim=2, alpha=1.0, factor=4), tmp_path / "k.safetensors")
    for to in ("diffusers", "kohya"):
        line = _error(capsys, "convert", "lora", path, tmp_path / "out.safetensors", "--to", to)
        assert "a LoKr file in LyCORIS' layout, which no --to layout holds" in line and str(path) in line
    assert not (tmp_path / "out.safetensors").exists()
