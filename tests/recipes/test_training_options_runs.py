"""Each trainer runs with the training options of issue 24 on the command line, and its config.toml says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import torch
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, run_cli
from safetensors.torch import load_file
from sdxl_testkit import write_method


def _resolved(out: Path) -> dict:
    return tomllib.loads((out / "config.toml").read_text())


def _same(a: Path, b: Path) -> bool:
    first, second = load_file(a), load_file(b)
    return first.keys() == second.keys() and all(torch.equal(first[k].float(), second[k].float()) for k in first)


def _checkpoint_as_lora(checkpoint: Path, out: Path, layout: str, *choice: str) -> Path:
    """``convert lora`` of a checkpoint-N folder (``choice``: --checkpoint_weights and its value, or nothing)."""
    assert run_cli("convert", "lora", checkpoint, out, "--to", layout, *choice) == 0
    return out


def test_flux_lora_trains_with_sd_scripts_sampling_huber_loss_and_caption_dropout(tiny_flux_dir: Path,
                                                                                 tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--max_train_steps", "2", "--report_to", "none", "--checkpointing_steps", "0",
                   "--timestep_sampling", "shift", "--discrete_flow_shift", "2.5", "--loss_type", "huber",
                   "--huber_schedule", "exponential", "--caption_dropout_rate", "0.5") == 0
    resolved = _resolved(out)
    assert (resolved["timestep_sampling"], resolved["discrete_flow_shift"], resolved["loss_type"],
            resolved["huber_schedule"], resolved["caption_dropout_rate"]) == ("shift", 2.5, "huber", "exponential", 0.5)
    assert (out / "pytorch_lora_weights.safetensors").is_file()


def test_sdxl_lora_trains_with_smooth_l1_debiased_loss_input_perturbation_and_shuffled_captions(
        tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   write_method(tmp_path, "class_tokens"), "--output_dir", out, "--max_train_steps", "2",
                   "--log_with", "none", "--loss_type", "smooth_l1", "--debiased_estimation_loss",
                   "--ip_noise_gamma", "0.1", "--shuffle_caption", "--caption_dropout_rate", "0.5",
                   "--ema_decay", "0.5", "--learning_rate", "1e-2", "--save_every_n_steps", "1", "--save_state") == 0
    resolved = _resolved(out)
    assert (resolved["loss_type"], resolved["debiased_estimation_loss"], resolved["ip_noise_gamma"],
            resolved["shuffle_caption"], resolved["ema_decay"]) == ("smooth_l1", True, 0.1, True, 0.5)
    raw, ema = load_file(out / "last.safetensors"), load_file(out / "last_ema.safetensors")
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    # The last checkpoint holds both: the EMA by default (the run validated with it), the raw weights when asked.
    last = out / "checkpoint-2"
    assert _same(_checkpoint_as_lora(last, tmp_path / "auto.safetensors", "kohya"), out / "last_ema.safetensors")
    assert _same(_checkpoint_as_lora(last, tmp_path / "raw.safetensors", "kohya", "--checkpoint_weights", "raw"),
                 out / "last.safetensors")


def _flux_lora(tiny_flux_dir: Path, out: Path, steps: int, *extra: object) -> int:
    return run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
                   "--max_train_steps", str(steps), "--report_to", "none", "--checkpointing_steps", "2",
                   "--learning_rate", "1e-2", "--ema_decay", "0.9", "--ema_warmup_power", "0.75",
                   "--caption_dropout_rate", "0.5", *extra)


def test_flux_lora_ema_file_is_saved_beside_the_raw_one_and_resume_continues_it_exactly(tiny_flux_dir: Path,
                                                                                      tmp_path: Path) -> None:
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _flux_lora(tiny_flux_dir, straight, 4) == 0
    assert _flux_lora(tiny_flux_dir, split, 2) == 0
    assert _flux_lora(tiny_flux_dir, split, 4, "--resume_from_checkpoint", "latest") == 0
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        expected, resumed = load_file(straight / name), load_file(split / name)
        assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)
    raw = load_file(straight / "pytorch_lora_weights.safetensors")
    ema = load_file(straight / "pytorch_lora_weights_ema.safetensors")
    assert any(not torch.equal(raw[k], ema[k]) for k in raw)
    assert any(k.startswith("ema.") for k in load_file(split / "checkpoint-2" / "trainable_weights.safetensors"))


def test_a_checkpoint_kept_with_an_ema_goes_wherever_a_lora_goes(tiny_flux_dir: Path, tiny_evaluators: dict[str, Path],
                                                               tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert _flux_lora(tiny_flux_dir, run, 4, "--ema_validation", "false") == 0
    last = run / "checkpoint-4"
    # The run validated with its raw weights, so those are the default; the EMA when asked.
    assert _same(_checkpoint_as_lora(last, tmp_path / "auto.safetensors", "diffusers"),
                 run / "pytorch_lora_weights.safetensors")
    assert _same(_checkpoint_as_lora(last, tmp_path / "ema.safetensors", "diffusers", "--checkpoint_weights", "ema"),
                 run / "pytorch_lora_weights_ema.safetensors")
    capsys.readouterr()
    assert run_cli("lora", "info", last, "--checkpoint_weights", "ema") == 0
    assert "format:    diffusers-flux" in capsys.readouterr().out
    assert run_cli("generate", "flux", "--model", tiny_flux_dir, "--lora", run / "checkpoint-2", "--prompt", "a",
                   "--steps", "1", "--width", "32", "--height", "32", "--output_dir", tmp_path / "images") == 0
    assert run_cli("eval", "flux", "--model", tiny_flux_dir, "--weights", run, "--checkpoint_weights", "ema",
                   "--prompt", "a", "--metrics", "clip_t", "--clip_model", tiny_evaluators["clip"], "--steps", "1",
                   "--resolution", "32", "--output_dir", tmp_path / "eval") == 0
    labels = [row["label"] for row in json.loads((tmp_path / "eval" / "scores.json").read_text())["candidates"]]
    assert labels[1:3] == ["run/checkpoint-2 (ema)", "run/checkpoint-4 (ema)"]


def test_flux_controlnet_saves_its_ema_as_a_controlnet_that_diffusers_loads(tiny_flux_dir: Path,
                                                                           tmp_path: Path) -> None:
    from diffusers import FluxControlNetModel
    from flux_testkit import write_control_pairs

    images, conditioning = write_control_pairs(tmp_path)
    out = tmp_path / "out"
    assert run_cli("train", "flux-controlnet", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir", out,
                   "--train_data_dir", images, "--conditioning_data_dir", conditioning, "--resolution", "32",
                   "--num_double_layers", "1", "--num_single_layers", "0", "--max_train_steps", "2",
                   "--report_to", "none", "--checkpointing_steps", "0", "--learning_rate", "1e-3",
                   "--ema_decay", "0.5", "--ema_on_cpu", "--loss_type", "l1") == 0
    raw = FluxControlNetModel.from_pretrained(out)
    ema = FluxControlNetModel.from_pretrained(out / "ema")
    differs = [not torch.equal(a, b) for a, b in zip(raw.state_dict().values(), ema.state_dict().values())]
    assert ema.state_dict().keys() == raw.state_dict().keys() and any(differs)


def test_masked_loss_trains_flux_lora_on_alpha_masks_and_sdxl_lora_on_a_mask_folder(
        tiny_flux_dir: Path, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    from PIL import Image
    from sdxl_testkit import write_images

    flux_images = tmp_path / "flux"
    flux_images.mkdir()
    for i in range(2):
        image = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
        image.paste((200, 40, 40, 255), (0, 0, 16, 32))  # only the left half is the subject
        image.save(flux_images / f"{i}.png")
    flux_toml = tmp_path / "flux.toml"
    flux_toml.write_text(f"[[datasets]]\nresolution = 32\n[[datasets.subsets]]\nimage_dir = "
                         f"'{flux_images.as_posix()}'\nclass_tokens = 'sks'\nalpha_mask = true\n")
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dir, "--output_dir",
                   tmp_path / "flux-out", "--dataset_config", flux_toml, "--masked_loss", "--max_train_steps", "2",
                   "--report_to", "none", "--checkpointing_steps", "0") == 0

    sdxl_images, masks = tmp_path / "sdxl", tmp_path / "masks"
    masks.mkdir()
    for path in write_images(sdxl_images, count=2):
        mask = Image.new("L", (64, 64), 0)
        mask.paste(255, (0, 0, 32, 64))
        mask.save(masks / path.name)
    sdxl_toml = tmp_path / "sdxl.toml"
    sdxl_toml.write_text(f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "
                         f"'{sdxl_images.as_posix()}'\nclass_tokens = 'sks'\n"
                         f"conditioning_data_dir = '{masks.as_posix()}'\n")
    out = tmp_path / "sdxl-out"
    assert run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir, "--dataset_config",
                   sdxl_toml, "--output_dir", out, "--masked_loss", "--max_train_steps", "2", "--log_with",
                   "none") == 0
    assert _resolved(out)["masked_loss"] is True and (out / "last.safetensors").is_file()
