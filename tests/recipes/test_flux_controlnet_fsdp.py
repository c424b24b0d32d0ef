"""flux-controlnet with its state sharded by FSDP2 (--zero_stage 3) over 2 CPU processes: it trains and
validates, a killed-and-resumed run ends where the straight run ends, and the saved ControlNet is one
ordinary save_pretrained folder that drives diffusers' FluxControlNetPipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxPipeline
from flux_testkit import launch_two, write_control_pairs
from safetensors.torch import load_file

from dreamstep.cli import main


def _args(model: Path, images: Path, controls: Path, out: Path, *extra: object) -> list[object]:
    return ["train", "flux-controlnet", "--pretrained_model_name_or_path", model, "--train_data_dir", images,
            "--conditioning_data_dir", controls, "--output_dir", out, "--resolution", "32",
            "--num_double_layers", "1", "--num_single_layers", "1", "--checkpointing_steps", "2",
            "--report_to", "none", "--zero_stage", "3", "--seed", "3", *extra]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> tuple[Path, Path]:
    return write_control_pairs(tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def straight(tiny_flux_dev_dir: Path, pairs, tmp_path_factory) -> Path:
    """4 steps in one go, with the frozen base sharded too and validation images (every process generates)."""
    out = tmp_path_factory.mktemp("straight") / "out"
    images, controls = pairs
    run = launch_two(*_args(tiny_flux_dev_dir, images, controls, out, "--max_train_steps", "4", "--shard_base",
                            "--validation_prompt", "an orange ball", "--validation_image", controls / "0.png",
                            "--validation_steps", "2", "--num_validation_images", "1",
                            "--validation_inference_steps", "1"))
    assert "processes   2 on 1 node (cpu); FSDP2 --zero_stage 3: each holds 1/2 of the trainable state" in run.stdout
    return out


def test_killed_and_resumed_run_ends_where_the_straight_run_ends(straight, tiny_flux_dev_dir, pairs, tmp_path):
    images, controls = pairs
    out = tmp_path / "out"
    launch_two(*_args(tiny_flux_dev_dir, images, controls, out, "--max_train_steps", "2"))
    launch_two(*_args(tiny_flux_dev_dir, images, controls, out, "--max_train_steps", "4",
                      "--resume_from_checkpoint", "latest"))
    resumed = load_file(out / "diffusion_pytorch_model.safetensors")
    expected = load_file(straight / "diffusion_pytorch_model.safetensors")
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(value, load_file(out / "checkpoint-2" / "trainable_weights.safetensors")[name])
               for name, value in resumed.items())  # the resumed half trained


def test_saved_controlnet_loads_and_drives_the_diffusers_pipeline(straight, tiny_flux_dev_dir, pairs):
    assert (straight / "samples" / "validation-000002.png").is_file()
    controlnet = FluxControlNetModel.from_pretrained(straight)
    base = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    pipe = FluxControlNetPipeline(**base.components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("an orange ball", control_image=pipe.image_processor.numpy_to_pil(
        torch.zeros(1, 32, 32, 3).numpy())[0], num_inference_steps=1, height=32, width=32,
        generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    assert image.shape == (32, 32, 3)


@pytest.mark.parametrize("flags, message", [
    (["--zero_stage", "3", "--mixed_precision", "bf16", "--controlnet_weights_dtype", "bf16"], "--zero_stage"),
    (["--shard_base"], "--shard_base needs --zero_stage"),
    (["--zero_stage", "1"], "--zero_stage"),
    (["--zero_stage", "3", "--shard_base", "--base_quantization", "int8"], "drop --shard_base"),
])
def test_bad_sharding_combinations_get_one_line_before_loading(flags, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", "flux-controlnet", "--pretrained_model_name_or_path", str(tmp_path / "no-model"),
                 "--train_data_dir", str(tmp_path), "--conditioning_data_dir", str(tmp_path),
                 "--output_dir", str(out), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()
