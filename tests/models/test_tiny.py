"""Tiny pipelines: the diffusers pipelines load and run them; the single file matches the folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline

from dreamstep.cli import main
from dreamstep.errors import UserError
from dreamstep.models.flux.tiny import build_tiny_flux
from dreamstep.models.sdxl.tiny import SINGLE_FILE_NAME, build_tiny_sdxl
from dreamstep.models.tiny import param_count, write_tiny_model

PROMPT = "a photo of sks dog"


def _generate(pipe, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = pipe(PROMPT, num_inference_steps=2, height=64, width=64, output_type="pt",
               generator=torch.Generator().manual_seed(0), **kwargs).images
    return out, time.perf_counter() - start


def _timed_load(cls, *args, **kwargs):
    start = time.perf_counter()
    pipe = cls.from_pretrained(*args, **kwargs) if not str(args[0]).endswith(".safetensors") \
        else cls.from_single_file(*args, **kwargs)
    return pipe, time.perf_counter() - start


@pytest.mark.parametrize("fixture", ["tiny_flux_dir", "tiny_flux_dev_dir"])
def test_flux_pipeline_loads_and_generates(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    pipe, load_s = _timed_load(FluxPipeline, folder)
    guidance_embeds = fixture == "tiny_flux_dev_dir"
    assert pipe.transformer.config.guidance_embeds is guidance_embeds
    assert len(pipe.transformer.transformer_blocks) >= 1
    assert len(pipe.transformer.single_transformer_blocks) >= 1
    # 2x2 packing: the transformer sees 4 latent channels per token.
    assert pipe.transformer.config.in_channels == 4 * pipe.vae.config.latent_channels
    images, gen_s = _generate(pipe, guidance_scale=3.5, max_sequence_length=64)
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
    print(f"\n{fixture}: load {load_s:.2f} s, 2-step 64x64 generation {gen_s:.2f} s")


def test_sdxl_pipeline_loads_and_generates(tiny_sdxl_dir: Path) -> None:
    pipe, load_s = _timed_load(StableDiffusionXLPipeline, tiny_sdxl_dir)
    unet = pipe.unet.config
    assert unet.down_block_types == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    assert unet.addition_embed_type == "text_time" and unet.layers_per_block == 2
    assert type(pipe.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    images, gen_s = _generate(pipe)
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()
    print(f"\ntiny_sdxl_dir: load {load_s:.2f} s, 2-step 64x64 generation {gen_s:.2f} s")


def test_sdxl_single_file_has_the_folder_weights(tiny_sdxl_dir: Path,
                                                 tiny_sdxl_single_file: Path) -> None:
    folder = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    single, load_s = _timed_load(StableDiffusionXLPipeline, str(tiny_sdxl_single_file),
                                 config=str(tiny_sdxl_dir))
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        expected, got = getattr(folder, name).state_dict(), getattr(single, name).state_dict()
        assert expected.keys() == got.keys(), name
        for key, tensor in expected.items():
            assert torch.equal(tensor, got[key]), f"{name}.{key}"
    print(f"\n{SINGLE_FILE_NAME}: from_single_file load {load_s:.2f} s")


def test_seed_makes_weights_deterministic() -> None:
    first, again, other = build_tiny_flux(seed=3), build_tiny_flux(seed=3), build_tiny_flux(seed=4)
    key = "transformer_blocks.0.attn.to_q.weight"
    assert torch.equal(first.transformer.state_dict()[key], again.transformer.state_dict()[key])
    assert not torch.equal(first.transformer.state_dict()[key], other.transformer.state_dict()[key])
    a, b = build_tiny_sdxl(seed=3).unet.state_dict(), build_tiny_sdxl(seed=3).unet.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_yet_every_block_type_is_present() -> None:
    flux = build_tiny_flux(guidance_embeds=True)
    transformer = flux.transformer
    assert len(transformer.transformer_blocks) >= 1 and len(transformer.single_transformer_blocks) >= 1
    assert transformer.time_text_embed.guidance_embedder is not None
    sdxl = build_tiny_sdxl()
    unet = sdxl.unet
    assert any(hasattr(b, "attentions") for b in unet.down_blocks)
    assert hasattr(unet.mid_block, "attentions") and any(hasattr(b, "attentions") for b in unet.up_blocks)
    # Small enough that every recipe test trains in seconds on two CPU cores.
    for pipe in (flux, sdxl):
        assert sum(param_count(pipe).values()) < 2_000_000


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-model", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--seed", "--guidance-embeds", "--single-file", "--overwrite"):
        assert flag in out


def test_cli_writes_a_loadable_folder_and_refuses_to_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "flux-dev"
    assert main(["tiny-model", "flux", str(out), "--seed", "7", "--guidance-embeds"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "transformer/diffusion_pytorch_model.safetensors" in printed
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert FluxPipeline.from_pretrained(out).transformer.config.guidance_embeds is True

    assert main(["tiny-model", "flux", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["tiny-model", "flux", str(out), "--overwrite"]) == 0


def test_options_that_do_not_apply_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--single_file: flux-kontext has no single files of its own; use it with "
                                         "flux"):
        write_tiny_model("flux-kontext", tmp_path / "a", single_file=True)
    with pytest.raises(UserError, match="--guidance_embeds applies to flux only"):
        write_tiny_model("sdxl", tmp_path / "b", guidance_embeds=True)
    with pytest.raises(UserError, match="--guidance_embeds: flux-kontext is guidance-distilled already"):
        write_tiny_model("flux-kontext", tmp_path / "d", guidance_embeds=True)
    with pytest.raises(UserError, match="unknown architecture 'sd3'"):
        write_tiny_model("sd3", tmp_path / "c")
    assert not any((tmp_path / name).exists() for name in "abcd")
