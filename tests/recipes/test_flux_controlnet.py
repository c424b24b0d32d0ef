"""`dreamstep train flux-controlnet` on the tiny FLUX model: it learns the pairs, writes a ControlNet that
diffusers loads and whose output follows the control image, resumes exactly, reads every data layout,
keeps the bf16-weights mode's loss curve with the fp32 run's, and reports bad input in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FluxControlNetModel, FluxControlNetPipeline, FluxPipeline
from flux_testkit import run_cli
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dreamstep.config.flux_controlnet import FluxControlNetConfig
from dreamstep.config.schema import build_config
from dreamstep.diffusion import flow_matching as fm
from dreamstep.engine.logging import LABEL_WIDTH
from dreamstep.models.flux import controlnet as cn
from dreamstep.models.flux import plumbing as flux

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROMPT = "a red square"
RESOLUTION = 32
CORNERS = ((2, 2), (14, 2), (2, 14), (14, 14))  # top-left of the 16x16 square in each pair
COMMON = ("--resolution", RESOLUTION, "--num_double_layers", "1", "--num_single_layers", "1",
          "--report_to", "none", "--checkpointing_steps", "0")


def _pair(corner: tuple[int, int], size: int = RESOLUTION) -> tuple[Image.Image, Image.Image]:
    """A target (red square on blue) and its control image (the square's white outline on black)."""
    x, y = corner
    box = [x, y, x + size // 2 - 1, y + size // 2 - 1]
    target = Image.new("RGB", (size, size), (30, 60, 160))
    ImageDraw.Draw(target).rectangle(box, fill=(220, 40, 40))
    control = Image.new("RGB", (size, size), "black")
    ImageDraw.Draw(control).rectangle(box, outline="white", width=2)
    return target, control


def make_pairs(root: Path) -> Path:
    """``root/images`` (targets + .txt captions), ``root/conditioning`` (same names) and a
    ``root/metadata.jsonl`` over the same files."""
    images, controls = root / "images", root / "conditioning"
    images.mkdir(parents=True)
    controls.mkdir()
    rows = []
    for i, corner in enumerate(CORNERS):
        target, control = _pair(corner)
        target.save(images / f"pair_{i}.png")
        control.save(controls / f"pair_{i}.png")
        (images / f"pair_{i}.txt").write_text(PROMPT)
        rows.append({"image": f"images/pair_{i}.png", "conditioning_image": f"conditioning/pair_{i}.png",
                     "text": PROMPT})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _pixels(images: list[Image.Image]) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1]."""
    return torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 127.5 - 1.0 for im in images])


@torch.no_grad()
def fixed_noise_loss(pipe: FluxPipeline, controlnet: FluxControlNetModel | None, shift_controls: int = 0,
                     sigmas: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8), seed: int = 0) -> float:
    """Mean flow-matching MSE on the pairs over the given σ with seeded noise, with the ControlNet's
    residuals added (or the base alone for ``None``); the posterior means, not samples, as inputs.
    ``shift_controls=k`` gives each target the control image of pair i + k: mismatched pairs."""
    targets = [_pair(c)[0] for c in CORNERS]
    controls = [_pair(CORNERS[(i + shift_controls) % len(CORNERS)])[1] for i in range(len(CORNERS))]
    latents, _ = flux.encode_posterior(pipe.vae, _pixels(targets)).chunk(2, dim=1)
    control, _ = flux.encode_posterior(pipe.vae, _pixels(controls)).chunk(2, dim=1)
    n, _, h, w = latents.shape
    embeds = flux.encode_prompts(pipe, [PROMPT] * n, max_sequence_length=512)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for sigma in sigmas:
        noise = torch.randn(latents.shape, generator=generator)
        s = torch.full((n, 1, 1, 1), sigma)
        inputs = dict(hidden_states=flux.pack(fm.noisy_latents(latents, noise, s)), timestep=s.flatten(),
                      guidance=torch.full((n,), 3.5) if pipe.transformer.config.guidance_embeds else None,
                      pooled_projections=embeds["pooled"], encoder_hidden_states=embeds["prompt_embeds"],
                      txt_ids=flux.text_ids(embeds["prompt_embeds"].shape[1], "cpu", torch.float32),
                      img_ids=flux.latent_image_ids(h, w, "cpu", torch.float32))
        residuals = cn.residuals(controlnet, controlnet_cond=flux.pack(control), **inputs) if controlnet else {}
        pred = flux.unpack(pipe.transformer(**inputs, **residuals, return_dict=False)[0], h, w)
        losses.append(fm.weighted_mse(pred, fm.velocity_target(latents, noise), s, "none").mean().item())
    return sum(losses) / len(losses)


def _train_args(model: Path, data: Path, out: Path, *extra: object) -> list[object]:
    return ["train", "flux-controlnet", "--pretrained_model_name_or_path", model, "--output_dir", out,
            "--train_data_dir", data / "images", "--conditioning_data_dir", data / "conditioning", *COMMON, *extra]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pairs(tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def flux_dir(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny guidance-distilled FLUX with its random VAE made to behave as a trained one does where it
    matters here: a posterior std far below the spread of the latents (the log-variance bias lowered) and
    latents of unit spread (shift and scaling factor fitted to the test images). With the random VAE's own
    values a posterior sample's noise (std 0.36) swamps the differences between the pairs (0.07), so no
    ControlNet could learn anything from the control images."""
    folder = tmp_path_factory.mktemp("flux") / "tiny-flux-dev"
    shutil.copytree(tiny_flux_dev_dir, folder)
    vae = AutoencoderKL.from_pretrained(folder / "vae")
    with torch.no_grad():
        vae.encoder.conv_out.bias[vae.config.latent_channels:] -= 12.0  # log σ² about -12: σ about 0.0025
        images = [image for corner in CORNERS for image in _pair(corner)]
        spread = vae.encode(_pixels(images)).latent_dist.mean
    vae.register_to_config(shift_factor=spread.mean().item(), scaling_factor=1.0 / spread.std().item())
    vae.save_pretrained(folder / "vae")
    return folder


# Uniform timesteps and little weight decay (not diffusers' ControlNet defaults, logit-normal and 1e-2): what
# 40 steps on four tiny pairs need to show that the control images matter.
LEARNING = ("--mixed_precision", "bf16", "--learning_rate", "1e-2", "--max_train_steps", "40",
            "--train_batch_size", "2", "--report_to", "tensorboard", "--weighting_scheme", "none",
            "--adam_weight_decay", "1e-4")


@pytest.fixture(scope="module")
def trained(flux_dir: Path, pairs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-003 policy: base bf16, ControlNet fp32, bf16 compute; validation at step 20 and the end."""
    out = tmp_path_factory.mktemp("controlnet") / "out"
    code = run_cli(*_train_args(flux_dir, pairs, out, *LEARNING, "--validation_prompt", PROMPT,
                                "--validation_image", pairs / "conditioning" / "pair_0.png",
                                pairs / "conditioning" / "pair_3.png", "--num_validation_images", "2",
                                "--validation_steps", "20", "--validation_inference_steps", "2"))
    assert code == 0
    return out


@pytest.fixture(scope="module")
def trained_bf16(flux_dir: Path, pairs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run with bf16 ControlNet weights and the stochastic-rounding AdamW."""
    out = tmp_path_factory.mktemp("controlnet_bf16") / "out"
    assert run_cli(*_train_args(flux_dir, pairs, out, *LEARNING, "--controlnet_weights_dtype", "bf16")) == 0
    return out


def _load(out: Path) -> FluxControlNetModel:
    return FluxControlNetModel.from_pretrained(out).float()


def _logged_losses(out: Path) -> np.ndarray:
    events = EventAccumulator(str(out))
    events.Reload()
    return np.array([e.value for e in events.Scalars("train/loss")])


def test_a_new_controlnet_leaves_the_base_unchanged(flux_dir: Path) -> None:
    pipe = FluxPipeline.from_pretrained(flux_dir)
    controlnet = cn.build_from_transformer(pipe.transformer, 1, 1)
    for name in ("controlnet_x_embedder", "controlnet_blocks.0", "controlnet_single_blocks.0"):
        assert not controlnet.get_submodule(name).weight.any(), name
    torch.testing.assert_close(controlnet.transformer_blocks[0].attn.to_q.weight,
                               pipe.transformer.transformer_blocks[0].attn.to_q.weight)
    assert fixed_noise_loss(pipe, controlnet) == fixed_noise_loss(pipe, None)


def test_loss_on_the_pairs_falls_and_the_control_images_matter(trained: Path, flux_dir: Path) -> None:
    pipe = FluxPipeline.from_pretrained(flux_dir)
    controlnet = _load(trained)
    before = fixed_noise_loss(pipe, None)
    after = fixed_noise_loss(pipe, controlnet)
    mismatched = min(fixed_noise_loss(pipe, controlnet, shift_controls=k) for k in (1, 2, 3))
    assert after < 0.8 * before, (before, after)
    assert mismatched > 1.02 * after, (after, mismatched)


def test_outputs_are_the_save_pretrained_layout(trained: Path) -> None:
    for name in ("config.json", "diffusion_pytorch_model.safetensors", "loss_curve.png", "config.toml",
                 "samples/validation-000020.png", "samples/final-000040.png"):
        assert (trained / name).is_file(), name
    assert json.loads((trained / "config.json").read_text())["_class_name"] == "FluxControlNetModel"
    weights = load_file(trained / "diffusion_pytorch_model.safetensors")
    assert weights["controlnet_blocks.0.weight"].dtype == torch.float32
    assert weights["controlnet_blocks.0.weight"].abs().max() > 0
    # 2 rows of (control image, 2 samples) of 32x32 cells, with the label band (prompt, step, seed) below, in a cell
    # widened for the labels
    width, height = Image.open(trained / "samples" / "final-000040.png").size
    assert width == max(3 * RESOLUTION, LABEL_WIDTH) and height > 2 * RESOLUTION
    assert not list(trained.glob("checkpoint-*"))


def test_diffusers_pipeline_runs_and_follows_the_control_image(trained: Path, flux_dir: Path) -> None:
    """Generated latents (the tiny random VAE decodes everything to near grey) for two control images:
    the same with a new, zero-initialised ControlNet, different with the trained one."""
    top_left, bottom_right = _pair(CORNERS[0])[1], _pair(CORNERS[3])[1]

    def difference(controlnet: FluxControlNetModel) -> float:
        pipe = FluxControlNetPipeline.from_pretrained(flux_dir, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        a, b = (pipe(prompt=PROMPT, control_image=control, num_inference_steps=4, height=RESOLUTION,
                     width=RESOLUTION, generator=torch.Generator().manual_seed(0), output_type="latent").images
                for control in (top_left, bottom_right))
        return ((a - b).abs().mean() / a.abs().mean()).item()

    untrained = cn.build_from_transformer(FluxPipeline.from_pretrained(flux_dir).transformer, 1, 1)
    assert difference(untrained) == 0.0
    assert difference(_load(trained)) > 0.05


def test_bf16_weights_learn_and_keep_the_fp32_loss_curve(trained: Path, trained_bf16: Path,
                                                         flux_dir: Path) -> None:
    weights = load_file(trained_bf16 / "diffusion_pytorch_model.safetensors")
    assert weights["controlnet_blocks.0.weight"].dtype == torch.bfloat16
    pipe = FluxPipeline.from_pretrained(flux_dir)
    before, fp32, bf16 = (fixed_noise_loss(pipe, None), fixed_noise_loss(pipe, _load(trained)),
                          fixed_noise_loss(pipe, _load(trained_bf16)))
    assert bf16 < 0.8 * before and abs(bf16 - fp32) < 0.1 * (before - fp32), (before, fp32, bf16)
    # Same data, noise and σ each step (the rounding has its own generator): the curves stay together.
    curve32, curve16 = _logged_losses(trained), _logged_losses(trained_bf16)
    assert len(curve32) == len(curve16) == 40
    assert np.abs(curve16 - curve32).mean() < 0.05 * curve32.mean(), np.abs(curve16 - curve32).max()


def test_resume_equals_an_uninterrupted_run(flux_dir: Path, pairs: Path, tmp_path: Path) -> None:
    """bf16 weights (the rounding generator is in the optimizer state), random flip (latents cached per
    image and flip, so the resumed half reads what the first half wrote), empty prompts, accumulation and a
    warm-up schedule."""
    extra = ("--mixed_precision", "bf16", "--controlnet_weights_dtype", "bf16", "--random_flip",
             "--proportion_empty_prompts", "0.5", "--gradient_accumulation_steps", "2",
             "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "2", "--learning_rate", "1e-3",
             "--weighting_scheme", "logit_normal", "--checkpointing_steps", "2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(*_train_args(flux_dir, pairs, straight, *extra, "--max_train_steps", "4")) == 0
    assert run_cli(*_train_args(flux_dir, pairs, split, *extra, "--max_train_steps", "2")) == 0
    assert run_cli(*_train_args(flux_dir, pairs, split, *extra, "--max_train_steps", "4",
                                "--resume_from_checkpoint", "latest")) == 0
    assert list((split / "cache" / "latents").rglob("*.safetensors"))
    expected = load_file(straight / "diffusion_pytorch_model.safetensors")
    resumed = load_file(split / "diffusion_pytorch_model.safetensors")
    assert expected.keys() == resumed.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], atol=0, rtol=0)


def test_swapping_the_base_blocks_trains_the_same_controlnet(flux_dir: Path, pairs: Path, tmp_path: Path) -> None:
    extra = ("--learning_rate", "1e-2", "--max_train_steps", "2", "--gradient_checkpointing")
    resident, swapped = tmp_path / "resident", tmp_path / "swapped"
    assert run_cli(*_train_args(flux_dir, pairs, resident, *extra)) == 0
    assert run_cli(*_train_args(flux_dir, pairs, swapped, *extra, "--blocks_to_swap", "2")) == 0
    expected = load_file(resident / "diffusion_pytorch_model.safetensors")
    got = load_file(swapped / "diffusion_pytorch_model.safetensors")
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=0, rtol=0)
    assert expected["controlnet_blocks.0.weight"].abs().max() > 0  # zero at the start: training moved it


def _kohya_toml(pairs: Path, path: Path) -> Path:
    path.write_text(f"[general]\ncaption_extension = \".txt\"\n\n[[datasets]]\nresolution = {RESOLUTION}\n\n"
                    f"[[datasets.subsets]]\nimage_dir = \"{pairs / 'images'}\"\n"
                    f"conditioning_data_dir = \"{pairs / 'conditioning'}\"\n")
    return path


@pytest.mark.parametrize("layout", ["jsonl", "kohya_toml"])
def test_metadata_jsonl_and_kohya_toml_train(layout: str, tiny_flux_dir: Path, pairs: Path, tmp_path: Path) -> None:
    data = (["--jsonl_for_train", pairs / "metadata.jsonl"] if layout == "jsonl"
            else ["--dataset_config", _kohya_toml(pairs, tmp_path / "dataset.toml")])
    out = tmp_path / "out"
    code = run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   *data, *COMMON, "--max_train_steps", "2", "--gradient_checkpointing")
    assert code == 0
    controlnet = _load(out)
    assert controlnet.config.guidance_embeds is False and len(controlnet.transformer_blocks) == 1
    assert len(list((out / "cache" / "latents").rglob("*"))) > 0  # center crop, no flip: latents cached


def test_a_trained_controlnet_continues_from_its_folder(trained: Path, flux_dir: Path, pairs: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli(*_train_args(flux_dir, pairs, out, "--controlnet_model_name_or_path", trained,
                                "--max_train_steps", "1", "--learning_rate", "1e-12")) == 0
    start = load_file(trained / "diffusion_pytorch_model.safetensors")
    for key, value in load_file(out / "diffusion_pytorch_model.safetensors").items():
        torch.testing.assert_close(value, start[key], atol=1e-6, rtol=0)


def _broken_copy(pairs: Path, tmp_path: Path, case: str) -> Path:
    data = tmp_path / "data"
    shutil.copytree(pairs / "images", data / "images")
    shutil.copytree(pairs / "conditioning", data / "conditioning")
    if case == "missing_partner":
        (data / "conditioning" / "pair_2.png").unlink()
    elif case == "corrupt_target":
        (data / "images" / "pair_1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    elif case == "corrupt_control":
        (data / "conditioning" / "pair_3.png").write_bytes(b"not an image")
    return data


@pytest.mark.parametrize("case", ["missing_partner", "corrupt_target", "corrupt_control", "bf16_without_bf16",
                                  "validation_mismatch", "missing_validation_image", "dreambooth_toml",
                                  "too_many_layers", "too_many_layers_dry_run", "too_many_of_both"])
def test_bad_input_gives_one_line_and_writes_nothing(case: str, tiny_flux_dir: Path, pairs: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = _broken_copy(pairs, tmp_path, case)
    control = pairs / "conditioning" / "pair_0.png"
    extra, expected = {
        "missing_partner": ([], "pair_2.png"),
        "corrupt_target": ([], "pair_1.png"),
        "corrupt_control": ([], "pair_3.png"),
        "bf16_without_bf16": (["--controlnet_weights_dtype", "bf16"], "--mixed_precision bf16"),
        "validation_mismatch": (["--validation_prompt", "a", "b", "--validation_image", control, control, control],
                                "--validation_image"),
        "missing_validation_image": (["--validation_prompt", "a", "--validation_image", tmp_path / "nope.png"],
                                     "nope.png"),
        "dreambooth_toml": (["--dataset_config", _dreambooth_toml(pairs, tmp_path)], "conditioning_data_dir"),
        "too_many_layers": (["--num_double_layers", "3"], "--num_double_layers"),
        # --dry_run plans only what the run would train: the plan of a ControlNet the base cannot hold is refused
        "too_many_layers_dry_run": (["--num_double_layers", "3", "--dry_run"], "--num_double_layers"),
        "too_many_of_both": (["--num_double_layers", "3", "--num_single_layers", "9"],
                             "--num_double_layers 3: the base transformer has 1 such blocks; choose 0 to 1; "
                             "--num_single_layers 9: the base transformer has 1 such blocks; choose 0 to 1"),
    }[case]
    out = tmp_path / "out"
    args = _train_args(tiny_flux_dir, data, out, "--max_train_steps", "1", *extra)
    if case == "dreambooth_toml":
        args = [a for a in args if a not in (data / "images", data / "conditioning", "--train_data_dir",
                                             "--conditioning_data_dir")]
    code = run_cli(*args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2
    assert len(errors) == 1 and expected in errors[0] and "Traceback" not in err, err
    assert not out.exists()


def _dreambooth_toml(pairs: Path, tmp_path: Path) -> Path:
    path = tmp_path / "dreambooth.toml"
    path.write_text(f"[[datasets]]\nresolution = {RESOLUTION}\n\n[[datasets.subsets]]\n"
                    f"image_dir = \"{pairs / 'images'}\"\nclass_tokens = \"sks square\"\n")
    return path


def test_the_shipped_config_is_valid() -> None:
    config = build_config(FluxControlNetConfig, toml_path=CONFIGS / "flux_controlnet.toml")
    assert config.mixed_precision == "bf16" and config.controlnet_weights_dtype == "fp32"
    assert config.validation_pairs() == [("data/controlnet/validation/canny_car.png", "a red car on a mountain road")]
