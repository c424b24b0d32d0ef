"""``lora info`` and ``convert lora`` on LyCORIS files written by the trainers' code: the report names each
algorithm with its settings (factor, rank, full matrix, Tucker, DoRA), counts parameters and checks the modules
against the model; ``convert`` refuses in one line what no layout holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from lora_testkit import inference_mode
from safetensors.torch import load_file
from test_cli import _error, _run

from dreamstep.config.lycoris import LycorisOptions
from dreamstep.generation.loras import LoraSpec, apply_loras
from dreamstep.lora.formats import model_keys, pipeline_configs
from dreamstep.lora.lycoris_network import create_network, file_names, sdxl_targets
from dreamstep.models.flux.lora_targets import flux_lora_targets


def _write(pipe, model: str, options: LycorisOptions, path: Path, noise: float = 0.0) -> tuple[Path, int]:
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
    with torch.no_grad():
        for p in network.parameters():  # as after training
            p.add_(torch.randn_like(p) * noise)
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
             "dora": (LycorisOptions("lora", dim=2, alpha=1.0, conv_dim=0, dora_wd=True),
                      "LoRA (rank 2, DoRA by input column)"),
             "dora-rows": (LycorisOptions("lora", dim=2, alpha=1.0, conv_dim=0, dora_wd=True, wd_on_output=True),
                           "LoRA (rank 2, DoRA)"),
             "tucker": (LycorisOptions("lora", dim=4, alpha=1.0, conv_dim=2, use_tucker=True), "LoRA (rank 2, Tucker)")}
    for name, (options, expected) in cases.items():
        path, params = _write(sdxl, "sdxl", options, tmp_path / f"{name}.safetensors")
        code, out, _ = _run(capsys, "lora", "info", path, "--base", tiny_sdxl_dir)
        assert code == 0 and "format:    lycoris-sdxl" in out
        assert "target:    SDXL: text_encoder, text_encoder_2, unet" in out
        assert f"params:    {params:,}" in out and "yes, every module exists" in out
        assert expected in out, out


def test_convert_refuses_a_dora_by_input_column_in_one_line(capsys, flux_dev, tmp_path: Path) -> None:
    options = LycorisOptions("lora", dim=2, alpha=1.0, dora_wd=True)  # dreamstep's default DoRA: peft has no such form
    path, _ = _write(flux_dev, "flux", options, tmp_path / "d.safetensors")
    line = _error(capsys, "convert", "lora", path, tmp_path / "out.safetensors", "--to", "diffusers")
    assert "only a DoRA by output row (wd_on_output=True) or a plain LoRA goes --to diffusers" in line, line
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_refuses_a_lokr_in_one_line(capsys, flux_dev, tmp_path: Path) -> None:
    path, _ = _write(flux_dev, "flux", LycorisOptions("lokr", dim=2, alpha=1.0, factor=4), tmp_path / "k.safetensors")
    for to in ("diffusers", "kohya"):
        line = _error(capsys, "convert", "lora", path, tmp_path / "out.safetensors", "--to", to)
        assert f"a LoKr file in LyCORIS' layout, which --to {to} cannot hold" in line and str(path) in line
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_dora_converted_to_diffusers_loads_in_diffusers_with_the_trained_layers(
        model: str, capsys, tiny_flux_dev_dir: Path, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    pipeline_class, folder = ((FluxPipeline, tiny_flux_dev_dir) if model == "flux"
                              else (StableDiffusionXLPipeline, tiny_sdxl_dir))
    torch.manual_seed(0)
    trainer_pipe = pipeline_class.from_pretrained(folder)
    options = LycorisOptions("lora", dim=2, alpha=1.0, conv_dim=0, dora_wd=True, wd_on_output=True)  # peft's form
    path, _ = _write(trainer_pipe, model, options, tmp_path / "dora.safetensors", noise=0.3)
    out = tmp_path / "peft.safetensors"
    code, stdout, _ = _run(capsys, "convert", "lora", path, out, "--to", "diffusers", "--base", folder)
    assert code == 0 and f"lycoris-{model} (safetensors) -> {out}: diffusers-{model}" in stdout

    base, in_diffusers, in_lycoris = (pipeline_class.from_pretrained(folder) for _ in range(3))
    in_diffusers.load_lora_weights(str(out))
    apply_loras(in_lycoris, [LoraSpec(path)], model, merge=False)
    main = "transformer" if model == "flux" else "unet"
    names = file_names(model_keys(model, pipeline_configs(base)), {main: getattr(base, main)})
    modules = {key.split(".")[0] for key in load_file(path)}
    adapted = {names[m][0].partition(".")[2] for m in modules if m in names}  # the UNet's or transformer's
    assert len(adapted) > 3
    for name in adapted:
        layers = [getattr(pipe, main).get_submodule(name) for pipe in (base, in_diffusers, in_lycoris)]
        x = (torch.randn(1, layers[0].in_channels, 4, 4) if isinstance(layers[0], torch.nn.Conv2d)
             else torch.randn(2, layers[0].in_features))
        with torch.no_grad():
            before, peft_out, lycoris_out = (layer(x) for layer in layers)
        torch.testing.assert_close(peft_out, lycoris_out, rtol=1e-4, atol=1e-5, msg=name)
        assert (lycoris_out - before).abs().max() > 1e-3, name
