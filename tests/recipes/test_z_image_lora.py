"""``dreamstep train z-image-lora`` on the tiny Z-Image: learning, the files diffusers' ZImagePipeline loads (the
diffusers and the ComfyUI layout), samples drawn with --validation_model_path, and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from PIL import Image
from safetensors.torch import load_file
from z_image_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, load_images, run_train

from dreamstep.cli import main
from dreamstep.lora.convert import load_lora_as_diffusers
from dreamstep.models.tiny import write_tiny_model
from dreamstep.png_text import read_parameters

BASE_ARGS = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
             "--report_to", "none", "--checkpointing_steps", "0", "--max_sequence_length", "64")


@pytest.fixture(scope="module")
def tiny_z_image_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model("z-image", tmp_path_factory.mktemp("tiny") / "z-image", seed=0)


@pytest.fixture(scope="module")
def tiny_turbo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another checkpoint of the same architecture, named as the distilled model's download is."""
    return write_tiny_model("z-image", tmp_path_factory.mktemp("tiny") / "Z-Image-Turbo", seed=1)


@pytest.fixture(scope="module")
def trained(tiny_z_image_dir: Path, tiny_turbo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("z_image_lora") / "out"
    code = run_train("--pretrained_model_name_or_path", tiny_z_image_dir, "--output_dir", out, *BASE_ARGS,
                     "--lora_layers", "all-linear", "--rank", "8", "--lora_alpha", "4", "--learning_rate", "5e-3",
                     "--max_train_steps", "120", "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "2",
                     "--validation_inference_steps", "2", "--validation_steps", "60",
                     "--validation_model_path", tiny_turbo_dir, "--save_kohya_format")
    assert code == 0
    return out


def _image(pipe: ZImagePipeline) -> np.ndarray:
    return np.asarray(pipe(ROBOT_PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                           max_sequence_length=64, generator=torch.Generator().manual_seed(0)).images[0], float)


def test_loss_on_the_instance_images_falls(trained: Path, tiny_z_image_dir: Path) -> None:
    pixels = load_images(ROBOT_DIR, 32)
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    after = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    print(f"fixed-noise loss on the instance images: {before:.4f} before, {after:.4f} after")
    assert after < 0.9 * before, (before, after)


def test_both_layouts_load_in_diffusers_and_give_the_same_output(trained: Path, tiny_z_image_dir: Path) -> None:
    diffusers_file = load_file(trained / "pytorch_lora_weights.safetensors")
    assert "transformer.layers.0.attention.to_q.lora_A.weight" in diffusers_file
    assert "transformer.noise_refiner.0.feed_forward.w2.lora_B.weight" in diffusers_file
    comfyui = load_file(trained / "pytorch_lora_weights_comfyui.safetensors")
    assert set(comfyui) == {"diffusion_model." + k.removeprefix("transformer.") for k in diffusers_file}
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    base = _image(pipe)
    outputs = []
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors"):
        pipe.load_lora_weights(trained / name, adapter_name=name.split(".")[0])
        pipe.set_adapters([name.split(".")[0]])
        outputs.append(_image(pipe))
    assert np.abs(outputs[0] - base).mean() > 1.0  # the trained LoRA changes the picture
    np.testing.assert_allclose(outputs[1], outputs[0], atol=1.0)  # the ComfyUI file is the same LoRA


def test_kohya_file_has_the_released_names_and_the_same_deltas(trained: Path) -> None:
    kohya = load_file(trained / "pytorch_lora_weights_kohya.safetensors")
    assert "lora_unet_layers_0_attention_qkv.lora_down.weight" in kohya
    assert "lora_unet_context_refiner_0_attention_out.lora_up.weight" in kohya
    assert not any("to_q" in key for key in kohya)
    back, _ = load_lora_as_diffusers(trained / "pytorch_lora_weights_kohya.safetensors", "z-image")
    original = load_file(trained / "pytorch_lora_weights.safetensors")
    for module in ("layers.1.attention.to_k", "noise_refiner.0.feed_forward.w3", "layers.0.adaLN_modulation.0"):
        key = f"transformer.{module}"
        delta = original[f"{key}.lora_B.weight"] @ original[f"{key}.lora_A.weight"]
        torch.testing.assert_close(back[f"{key}.lora_B.weight"] @ back[f"{key}.lora_A.weight"], delta)


def test_generate_with_the_lora_changes_the_image(trained: Path, tiny_z_image_dir: Path, tmp_path: Path) -> None:
    args = ("--model", tiny_z_image_dir, "--prompt", ROBOT_PROMPT, "--steps", "2", "--width", "32", "--height", "32",
            "--seed", "1")
    assert main(["generate", "z-image", *map(str, args), "--output_dir", str(tmp_path / "base")]) == 0
    assert main(["generate", "z-image", *map(str, args), "--output_dir", str(tmp_path / "lora"),
                 "--lora", str(trained / "pytorch_lora_weights_comfyui.safetensors")]) == 0
    text, params = read_parameters(tmp_path / "lora" / "00000-1.png")
    assert params["model_type"] == "z-image" and "CFG scale: 4" in text  # the base's default guidance
    base, lora = (np.asarray(Image.open(tmp_path / d / "00000-1.png"), float) for d in ("base", "lora"))
    assert np.abs(base - lora).mean() > 1.0


def test_turbo_generates_with_its_own_defaults(tiny_turbo_dir: Path, tmp_path: Path) -> None:
    assert main(["generate", "z-image", "--model", str(tiny_turbo_dir), "--prompt", ROBOT_PROMPT, "--width", "32",
                 "--height", "32", "--seed", "0", "--output_dir", str(tmp_path)]) == 0
    text, params = read_parameters(tmp_path / "00000-0.png")
    assert "Steps: 9" in text and "CFG scale: 0" in text


def test_eval_scores_the_lora_against_the_base(trained: Path, tiny_z_image_dir: Path,
                                               tiny_evaluators: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert main(["eval", "z-image", "--model", str(tiny_z_image_dir), "--weights",
                 str(trained / "pytorch_lora_weights.safetensors"), "--prompt", ROBOT_PROMPT, "--instance_data_dir",
                 str(ROBOT_DIR), "--metrics", "clip_i,clip_t", "--output_dir", str(out), "--num_images", "1",
                 "--steps", "2", "--resolution", "32", "--clip_model", str(tiny_evaluators["clip"])]) == 0
    rows = {r["label"]: r for r in json.loads((out / "scores.json").read_text())["candidates"]}
    assert set(rows) == {"base model", "pytorch_lora_weights.safetensors"}
    assert rows["base model"]["clip_t"] != rows["pytorch_lora_weights.safetensors"]["clip_t"]


def test_validation_samples_are_drawn_by_the_validation_model_path(trained: Path, tiny_turbo_dir: Path) -> None:
    for name in ("samples/validation-000060.png", "samples/final-000120.png", "loss_curve.png", "config.toml"):
        assert (trained / name).is_file(), name
    text, parameters = read_parameters(trained / "samples/validation-000060.png")
    assert "Model: Z-Image-Turbo" in text
    assert all(cell["model"] == str(tiny_turbo_dir) for cell in parameters["images"])
    with Image.open(trained / "samples/validation-000060.png") as grid:
        assert grid.height > 32  # the band under each sample that names the model


def test_turbo_as_the_base_is_named_once_with_the_base_to_use(tiny_turbo_dir: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    code = run_train("--pretrained_model_name_or_path", tiny_turbo_dir, "--output_dir", tmp_path / "out", *BASE_ARGS,
                     "--dry_run")
    assert code == 0
    err = capsys.readouterr()
    said = err.out + err.err
    assert said.count("breaks the distillation") == 1
    assert "Tongyi-MAI/Z-Image," in said and f"--validation_model_path {tiny_turbo_dir}" in said


@pytest.mark.parametrize(("args", "message"), [
    (("--resolution", "40"), "--resolution must be a multiple of 16"),
    (("--validation_model_path", "nowhere/at-all/x"), "--validation_model_path nowhere/at-all/x: no such folder"),
    (("--lora_layers", "to_z"), "--lora_layers: 'to_z' matches no linear layer of the Z-Image transformer"),
    (("--validation_model_path", "x"), "--validation_model_path has no effect without --validation_prompt"),
    (("--validation_model_path", "x", "--validation_prompt", "p", "--base_quantization", "int8"),
     "--validation_model_path swaps that model's weights into the transformer"),
])
def test_bad_flags_are_one_line_before_anything_is_written(tiny_z_image_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture, args: tuple[str, ...],
                                                           message: str) -> None:
    extra = ("--validation_prompt", "x") if "nowhere" in args[1] else ()
    code = run_train("--pretrained_model_name_or_path", tiny_z_image_dir, "--output_dir", tmp_path / "out",
                     *BASE_ARGS, *args, *extra)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_another_familys_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    flux = write_tiny_model("flux", tmp_path / "flux")
    code = run_train("--pretrained_model_name_or_path", flux, "--output_dir", tmp_path / "out", *BASE_ARGS)
    assert code == 2
    assert "holds a FluxPipeline (a FLUX.1 model: train it with 'dreamstep train flux-lora')" in \
        capsys.readouterr().err


def test_class_images_made_within_the_plan_are_the_whole_pipelines(tiny_z_image_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A run with one class image of three makes the other two from the class prompt's caption features (the text
    encoder off the device): the images the whole pipeline makes from the prompt with the base's own steps and
    guidance (its empty negative prompt), seed for seed; the plan has their phase."""
    from dreamstep.models.z_image.configs import BASE_SAMPLING

    classes = tmp_path / "class"
    classes.mkdir()
    Image.new("RGB", (32, 32), "gray").save(classes / "mine.png")
    assert run_train("--pretrained_model_name_or_path", tiny_z_image_dir, "--output_dir", tmp_path / "out",
                     *BASE_ARGS, "--max_train_steps", "2", "--with_prior_preservation", "--class_data_dir", classes,
                     "--class_prompt", "a photo of robot", "--num_class_images", "3", "--sample_batch_size", "2",
                     "--seed", "5") == 0
    assert sorted(p.name for p in classes.iterdir()) == ["class-00001.png", "class-00002.png", "mine.png"]
    assert "class images" in capsys.readouterr().out
    pipe = ZImagePipeline.from_pretrained(tiny_z_image_dir)
    for index in (1, 2):
        expected = pipe("a photo of robot", negative_prompt="", height=32, width=32, max_sequence_length=64,
                        num_inference_steps=BASE_SAMPLING["steps"], guidance_scale=BASE_SAMPLING["guidance_scale"],
                        generator=torch.Generator("cpu").manual_seed(5 + index), output_type="np").images[0]
        made = np.asarray(Image.open(classes / f"class-{index:05d}.png"), dtype=np.float32) / 255
        assert np.abs(made - expected).max() <= 1 / 255 + 1e-6
