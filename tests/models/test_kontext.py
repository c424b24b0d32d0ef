"""FLUX.1 Kontext plumbing against diffusers' own ``FluxKontextPipeline``: the tiny Kontext folder it loads, and
the token layout (condition tokens after the target's, position ids offset in the first axis) it samples with."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import FluxKontextPipeline
from PIL import Image, ImageDraw

from dreamstep.cli import main
from dreamstep.models.flux import kontext
from dreamstep.models.flux import plumbing as flux


def test_tiny_model_flux_kontext_is_a_kontext_pipeline_that_follows_its_image(
        tmp_path: Path, capsys) -> None:
    out = tmp_path / "kontext"
    assert main(["tiny-model", "flux-kontext", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    pipe = FluxKontextPipeline.from_pretrained(out)
    assert pipe.transformer.config.guidance_embeds is True  # Kontext [dev] is guidance-distilled

    def edit(image: Image.Image) -> np.ndarray:
        return pipe(image=image, prompt="a red dog", num_inference_steps=2, height=32, width=32, max_area=32 * 32,
                    _auto_resize=False, generator=torch.Generator().manual_seed(0), output_type="np").images[0]

    plain, drawn = Image.new("RGB", (32, 32), "navy"), Image.new("RGB", (32, 32), "navy")
    ImageDraw.Draw(drawn).ellipse((4, 4, 28, 28), fill="orange")
    assert edit(plain).shape == (32, 32, 3)
    assert np.abs(edit(plain) - edit(drawn)).max() > 1e-3  # the condition image reaches the prediction


def test_joined_tokens_are_the_pipelines_layout() -> None:
    pipe = FluxKontextPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                               tokenizer_2=None, transformer=None)
    generator = torch.Generator().manual_seed(0)
    target, condition = torch.randn(2, 16, 4, 6, generator=generator), torch.randn(2, 16, 6, 4, generator=generator)
    # What FluxKontextPipeline.prepare_latents hands the transformer for these latents (given as latents, so no
    # VAE runs): the condition's packed tokens and ids beside the target's.
    packed_target = flux.pack(target)
    _, condition_tokens, target_ids, condition_ids = pipe.prepare_latents(
        condition, 2, 16, 4 * pipe.vae_scale_factor, 6 * pipe.vae_scale_factor, torch.float32, "cpu",
        latents=packed_target)

    ids = flux.latent_image_ids(4, 6, "cpu", torch.float32)
    joined = kontext.joined_inputs({"hidden_states": packed_target, "img_ids": ids, "guidance": None}, condition)
    hidden_states, img_ids = joined["hidden_states"], joined["img_ids"]
    assert joined["guidance"] is None  # the other inputs pass through
    torch.testing.assert_close(hidden_states, torch.cat([packed_target, condition_tokens], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(img_ids, torch.cat([target_ids, condition_ids]), rtol=0, atol=0)
    assert (img_ids[:6, 0] == 0).all() and (img_ids[6:, 0] == 1).all()
    assert kontext.target_prediction(hidden_states, packed_target.shape[1]).shape == packed_target.shape


def test_without_a_condition_the_target_is_alone() -> None:
    inputs = {"hidden_states": flux.pack(torch.randn(1, 16, 4, 4)),
              "img_ids": flux.latent_image_ids(4, 4, "cpu", torch.float32)}
    assert kontext.joined_inputs(inputs, None) is inputs


def test_edit_size_is_the_pipelines_resize() -> None:
    assert kontext.edit_size((1000, 1000), keep=False) == (1024, 1024)
    assert kontext.edit_size((1920, 1080), keep=False) == (1392, 752)
    assert kontext.edit_size((70, 40), keep=True) == (64, 32)


def test_plan_flux_kontext_prices_the_condition_tokens(tiny_flux_kontext_dir: Path, capsys) -> None:
    def training_pass(model: str) -> float:
        assert main(["plan", model, "--pretrained_model_name_or_path", str(tiny_flux_kontext_dir), "--resolution",
                     "256", "--device_memory", "1GB"]) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "training pass: 256px" in x]
        return float(line.split()[-2])

    assert training_pass("flux-kontext") > 1.3 * training_pass("flux")  # a Kontext folder plans as FLUX too
