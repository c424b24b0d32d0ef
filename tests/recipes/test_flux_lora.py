"""`dreamstep train flux-lora` on the tiny FLUX models: learning, outputs that diffusers loads, exact
resume, the optional features, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, generate, load_images, run_cli
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from dreamstep.files import default_file_mode
from dreamstep.lora.convert import load_lora_as_diffusers
from dreamstep.png_text import read_parameters

BASE_ARGS = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "64",
             "--report_to", "none", "--checkpointing_steps", "0")


@pytest.fixture(scope="module")
def trained(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flux_lora") / "out"
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--output_dir", out,
                   *BASE_ARGS, "--lora_layers", "all-linear", "--rank", "8", "--lora_alpha", "4",
                   "--learning_rate", "3e-3", "--max_train_steps", "150", "--save_kohya_format",
                   "--train_text_encoder", "--text_encoder_lr", "1e-3",
                   "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "2",
                   "--validation_inference_steps", "2", "--validation_steps", "100")
    assert code == 0
    return out


def test_loss_on_the_instance_images_falls(trained: Path, tiny_flux_dev_dir: Path) -> None:
    pixels = load_images(ROBOT_DIR, 64)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    after = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    assert after < 0.9 * before, (before, after)


def test_outputs_are_written(trained: Path) -> None:
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_kohya.safetensors", "loss_curve.png",
                 "config.toml", "samples/validation-000100.png", "samples/final-000150.png"):
        assert (trained / name).is_file(), name
    assert not list(trained.glob("checkpoint-*"))


def test_diffusers_file_keeps_alpha_and_changes_the_output(trained: Path, tiny_flux_dev_dir: Path) -> None:
    path = trained / "pytorch_lora_weights.safetensors"
    tensors = load_file(path)
    assert "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight" in tensors
    assert "transformer.transformer_blocks.0.norm1.linear.lora_B.weight" in tensors
    # alpha / rank (4 / 8) folded into lora_B, the form ComfyUI (no alpha key: scale 1) and diffusers agree on;
    # CLIP named as ComfyUI maps it, whatever transformers version named it.
    with safe_open(path, "pt") as f:
        adapter = json.loads(f.metadata()["lora_adapter_metadata"])
    assert adapter["transformer.r"] == 8 and adapter["transformer.lora_alpha"] == 8
    assert not any(k.endswith(".alpha") for k in tensors)
    assert tensors["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"].abs().sum() > 0
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    plain = generate(pipe)
    pipe.load_lora_weights(path)
    with_lora = generate(pipe)
    assert np.abs(with_lora - plain).max() > 1e-2


def test_kohya_file_has_sd_scripts_names_and_gives_the_same_image(trained: Path, tiny_flux_dev_dir: Path) -> None:
    kohya = trained / "pytorch_lora_weights_kohya.safetensors"
    keys = set(load_file(kohya))
    for name in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_mlp_0",
                 "lora_unet_double_blocks_0_img_mod_lin", "lora_unet_single_blocks_0_linear1"):
        assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= keys
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    reference = generate(pipe)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    state_dict, _ = load_lora_as_diffusers(kohya, "flux")
    pipe.load_lora_weights(state_dict)
    np.testing.assert_allclose(generate(pipe), reference, atol=2e-4)


def test_resume_equals_an_uninterrupted_run(tiny_flux_dev_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir", ROBOT_DIR,
              "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none",
              "--train_batch_size", "2", "--gradient_accumulation_steps", "2", "--random_flip",
              "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "2", "--learning_rate", "1e-3",
              "--weighting_scheme", "logit_normal", "--checkpointing_steps", "3", "--train_text_encoder")
    assert run_cli("train", "flux-lora", *common, "--output_dir", tmp_path / "straight", "--max_train_steps", "6") == 0
    split = tmp_path / "split"
    assert run_cli("train", "flux-lora", *common, "--output_dir", split, "--max_train_steps", "3") == 0
    capsys.readouterr()
    assert run_cli("train", "flux-lora", *common, "--output_dir", split, "--max_train_steps", "6",
                   "--resume_from_checkpoint", "latest", "--learning_rate", "5e-3") == 0
    # A changed learning rate is said, and (as said) the checkpoint's schedule goes on: the result is the same.
    assert (f"note: --learning_rate is 0.005 but {split / 'checkpoint-3'} was trained with 0.001: the checkpoint's "
            "learning-rate schedule continues from its own value; for a new learning rate start a new run"
            ) in capsys.readouterr().out
    straight = load_file(tmp_path / "straight" / "pytorch_lora_weights.safetensors")
    # config.toml says how many epochs ran (3 batches of 2 accumulated in 2s: 2 steps an epoch), not the default 1
    assert "\nnum_train_epochs = 3\n" in (tmp_path / "straight" / "config.toml").read_text()
    resumed = load_file(split / "pytorch_lora_weights.safetensors")
    assert straight.keys() == resumed.keys() and any(k.startswith("text_encoder.") for k in straight)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)
    # The loss history (and so loss_curve.png) covers the whole run, the part before the resume included.
    histories = [json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["extra"]["loss_history"]
                 for run in (tmp_path / "straight", split)]
    assert [step for step, _ in histories[1]] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(histories[1], histories[0], atol=1e-6)

    # Resuming with a flag that shapes the weights changed is refused before anything loads, naming the flag; so is
    # one the checkpoint's state depends on, with the reason.
    lora_before = (split / "pytorch_lora_weights.safetensors").read_bytes()
    for flag, value, was, reason in [
            ("--rank", "8", "4", None), ("--lora_layers", "all-linear", "attention", None),
            ("--train_text_encoder", "false", "true", None),
            ("--pretrained_model_name_or_path", tmp_path / "other", tiny_flux_dev_dir, None),
            ("--optimizer", "Prodigy", "AdamW", "its optimizer state is that optimizer's"),
            ("--resolution", "64", "32", "its data position and cached latents belong to that value"),
            ("--seed", "7", "0", "the order of its data and its held-out images follow that seed")]:
        capsys.readouterr()
        assert run_cli("train", "flux-lora", *common, "--output_dir", split, "--max_train_steps", "9",
                       "--resume_from_checkpoint", "latest", flag, value) == 2
        because = f": {reason}" if reason else ""
        assert capsys.readouterr().err == (f"error: {flag} is {value} but {split / 'checkpoint-6'} was trained with "
                                           f"{was}{because}; resume with {flag} {was}, or start a new run in "
                                           "another --output_dir\n")
    assert (split / "pytorch_lora_weights.safetensors").read_bytes() == lora_before


def test_prior_preservation_text_encoder_lora_and_checkpointing(tiny_flux_dir: Path, tmp_path: Path) -> None:
    class_dir = tmp_path / "class"
    out = tmp_path / "out"
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   *BASE_ARGS, "--with_prior_preservation", "--class_data_dir", class_dir,
                   "--class_prompt", "a photo of a robot", "--num_class_images", "3", "--sample_batch_size", "2",
                   "--train_text_encoder", "--text_encoder_lr", "5e-4", "--gradient_checkpointing",
                   "--max_train_steps", "4", "--train_batch_size", "2", "--lora_layers", "attention+ff")
    assert code == 0
    assert len(list(class_dir.glob("*.png"))) == 3
    keys = load_file(out / "pytorch_lora_weights.safetensors").keys()
    assert any(k.startswith("text_encoder.") for k in keys)
    assert any(k.startswith("transformer.") and "ff.net.2" in k for k in keys)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir)
    pipe.load_lora_weights(out / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("scheme", ["none", "logit_normal", "mode", "sigma_sqrt", "cosmap"])
def test_every_weighting_scheme_trains(scheme: str, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir,
                   "--output_dir", tmp_path, *BASE_ARGS, "--weighting_scheme", scheme, "--max_train_steps", "2",
                   "--mixed_precision", "bf16")
    assert code == 0
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()


def test_toml_config_sets_flags_and_the_command_line_wins(tiny_flux_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    out = tmp_path / "out"
    config.write_text(f'pretrained_model_name_or_path = "{tiny_flux_dir}"\ninstance_data_dir = "{ROBOT_DIR}"\n'
                      f'instance_prompt = "{ROBOT_PROMPT}"\noutput_dir = "{out}"\nresolution = 32\nrank = 2\n'
                      'max_train_steps = 1\nreport_to = "none"\n')
    assert run_cli("train", "flux-lora", "--config", config, "--rank", "3") == 0
    saved = (out / "config.toml").read_text()
    assert "rank = 3" in saved and "resolution = 32" in saved
    assert load_file(out / "pytorch_lora_weights.safetensors")[
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight"].shape[0] == 3


def _corrupt_copy(tmp_path: Path) -> Path:
    images = tmp_path / "images"
    shutil.copytree(ROBOT_DIR, images)
    (images / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 40)
    return images


@pytest.mark.parametrize("case", ["missing_dir", "empty_dir", "corrupt_image", "bad_choice", "bad_number",
                                  "toml_typo", "unknown_flag_value", "fp16_on_cpu", "bad_optimizer"])
def test_bad_input_gives_one_line_and_writes_nothing(case: str, tiny_flux_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out, "--instance_prompt", ROBOT_PROMPT,
            "--resolution", "32", "--max_train_steps", "1"]
    expected = {
        "missing_dir": (["--instance_data_dir", tmp_path / "nope"], "nope"),
        "empty_dir": (["--instance_data_dir", tmp_path], str(tmp_path)),
        "corrupt_image": (["--instance_data_dir", _corrupt_copy(tmp_path)], "broken.jpg"),
        "bad_choice": (["--instance_data_dir", ROBOT_DIR, "--weighting_scheme", "logit-normal"],
                       "did you mean 'logit_normal'"),
        "bad_number": (["--instance_data_dir", ROBOT_DIR, "--rank", "four"], "--rank"),
        "toml_typo": (["--instance_data_dir", ROBOT_DIR, "--config", _typo_toml(tmp_path)],
                      "did you mean 'learning_rate'"),
        "unknown_flag_value": (["--instance_data_dir", ROBOT_DIR, "--lora_layers", "to_qq"], "--lora_layers"),
        "fp16_on_cpu": (["--instance_data_dir", ROBOT_DIR, "--mixed_precision", "fp16"], "use bf16 or no"),
        # Found after the model loads: the cache folder must not be left behind either.
        "bad_optimizer": (["--instance_data_dir", ROBOT_DIR, "--optimizer", "Adamm"], "did you mean 'AdamW'"),
    }[case]
    args += expected[0]
    code = run_cli("train", "flux-lora", *args)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2
    assert len(errors) == 1 and expected[1] in errors[0] and "Traceback" not in err, err
    assert not out.exists()


def _typo_toml(tmp_path: Path) -> Path:
    path = tmp_path / "typo.toml"
    path.write_text("learning_rat = 1e-4\n")
    return path


def test_a_later_run_reuses_the_cached_latents_and_embeddings(tiny_flux_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ("--pretrained_model_name_or_path", tiny_flux_dir, *BASE_ARGS, "--max_train_steps", "6",
            "--cache_dir", cache, "--center_crop")
    assert run_cli("train", "flux-lora", *args, "--output_dir", tmp_path / "first") == 0
    files = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    # 6 images, one fixed crop each: 6 latent entries; one prompt: 1 text entry.
    assert len([p for p in files if "latents" in p.parts]) == 6 and len([p for p in files if "text" in p.parts]) == 1
    assert run_cli("train", "flux-lora", *args, "--output_dir", tmp_path / "second") == 0
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == files
    assert not list(ROBOT_DIR.glob("*.safetensors")) and not list(ROBOT_DIR.glob("*.npz"))


def test_kohya_dataset_toml_with_captions(tiny_flux_dir: Path, tmp_path: Path) -> None:
    images = tmp_path / "robot"
    shutil.copytree(ROBOT_DIR, images)
    for i, path in enumerate(sorted(images.glob("*.png"))):
        path.with_suffix(".txt").write_text(f"sks robot, picture {i}")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[general]\ncaption_extension = '.txt'\nshuffle_caption = true\n\n[[datasets]]\n"
                    f"resolution = 32\nbatch_size = 2\n\n  [[datasets.subsets]]\n  image_dir = '{images}'\n"
                    "  num_repeats = 2\n")
    out = tmp_path / "out"
    # --prior_loss_weight applies to a dataset TOML's is_reg subsets, so it is accepted here.
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--dataset_config", toml,
                   "--output_dir", out, "--max_train_steps", "3", "--report_to", "none",
                   "--prior_loss_weight", "0.5") == 0
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    texts = list((out / "cache" / "text").rglob("*.safetensors"))
    assert len(texts) >= 2  # per-image captions, shuffled: more than one prompt was encoded


@pytest.mark.parametrize("flags, message", [
    (["--class_prompt", "a robot"], "--class_prompt has no effect without --with_prior_preservation"),
    (["--text_encoder_lr", "1e-5"], "--text_encoder_lr has no effect without --train_text_encoder"),
    (["--dataset_config", "d.toml", "--random_flip"], "--random_flip has no effect with --dataset_config"),
    (["--prior_loss_weight", "0.5"], "--prior_loss_weight has no effect without --with_prior_preservation"),
])
def test_flags_without_effect_are_refused(flags: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    source = [] if "--dataset_config" in flags else ["--instance_data_dir", ROBOT_DIR, "--instance_prompt", "x"]
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tmp_path, "--output_dir", tmp_path / "o",
                   *source, *flags)
    assert code == 2 and message in capsys.readouterr().err


def test_sample_grids_carry_prompt_seed_and_step(trained: Path) -> None:
    """The grids are labelled in the image and carry their parameters as `generate`'s PNGs do."""
    grid_path = trained / "samples" / "validation-000100.png"
    text, params = read_parameters(grid_path)
    assert params["step"] == 100
    assert [(cell["prompt"], cell["seed"]) for cell in params["images"]] == [(ROBOT_PROMPT, 0), (ROBOT_PROMPT, 1)]
    assert text.startswith(ROBOT_PROMPT) and "Seed: 1" in text
    with Image.open(grid_path) as grid:
        assert grid.size[1] > 64  # the label band under the 64-pixel cells


def test_every_file_written_honours_the_umask(trained: Path) -> None:
    """safetensors writes 0600; a ComfyUI server account must be able to read what a run wrote."""
    wanted = default_file_mode()
    modes = {p.relative_to(trained): p.stat().st_mode & 0o777 for p in trained.rglob("*") if p.is_file()}
    assert Path("pytorch_lora_weights.safetensors") in modes
    assert {path: mode for path, mode in modes.items() if mode != wanted} == {}
