"""``dreamstep train z-image-lora`` on the tiny Z-Image: learning, the files diffusers' ZImagePipeline loads (the
diffusers and the ComfyUI layout), samples drawn with --validation_model, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline
from PIL import Image
from safetensors.torch import load_file
from z_image_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, load_images, run_train

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
                     "--validation_model", tiny_turbo_dir)
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


def test_validation_samples_are_drawn_by_the_validation_model(trained: Path, tiny_turbo_dir: Path) -> None:
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
    assert "Tongyi-MAI/Z-Image," in said and f"--validation_model {tiny_turbo_dir}" in said


@pytest.mark.parametrize(("args", "message"), [
    (("--resolution", "40"), "--resolution must be a multiple of 16"),
    (("--validation_model", "nowhere/at-all/x"), "--validation_model nowhere/at-all/x: no such folder"),
    (("--lora_layers", "to_z"), "--lora_layers: 'to_z' matches no linear layer of the Z-Image transformer"),
    (("--validation_model", "x"), "--validation_model has no effect without --validation_prompt"),
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
