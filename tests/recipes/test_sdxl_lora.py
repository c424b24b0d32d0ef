"""`dreamstep train sdxl-lora` on the tiny SDXL: the seed 004 command as written, sd-scripts' files and
metadata, and a LoRA that diffusers loads to exactly the image of merging it ourselves."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from safetensors import safe_open
from sdxl_testkit import run_cli, write_method

from dreamstep.lora.kohya_network import NetworkOptions, create_network
from dreamstep.models.sdxl.tiny import build_tiny_sdxl
from dreamstep.png_text import read_parameters

# The seed's command with `python sdxl_train_network.py` replaced, as the seed writes it; only the paths
# and the two step counts (15000, 3000) are changed to fit a test.
SEED_FLAGS = (
    '--network_module=networks.lora', "--network_alpha=256", "--network_dim=256", "--save_model_as=ckpt",
    "--learning_rate=1e-4", "--network_train_unet_only", "--network_dropout=0.1", "--no_half_vae",
    "--lr_scheduler=constant", "--optimizer_type=AdamW", "--optimizer_args", "weight_decay=0.05",
    "betas=0.9,0.98", "--max_data_loader_n_workers=0", "--max_train_steps=4", "--save_precision=fp32",
    "--save_every_n_steps=2", "--gradient_checkpointing", "--flash_attn", "--min_snr_gamma=5",
    "--noise_offset=0.0357", "--adaptive_noise_scale=0.00357", "--output_name=pokemon",
)


@pytest.fixture(scope="module")
def seed_run(tiny_sdxl_single_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("seed")
    toml = write_method(root, "finetune")
    out = root / "sdxl_lora_pokemon"
    code = run_cli("train", "sdxl-lora", f"--pretrained_model_name_or_path={tiny_sdxl_single_file}",
                   f"--dataset_config={toml}", *SEED_FLAGS, f"--output_dir={out}")
    assert code == 0
    return out


def test_seed_command_writes_sd_scripts_files(seed_run: Path) -> None:
    assert sorted(p.name for p in seed_run.glob("pokemon*")) == ["pokemon-step00000002.ckpt", "pokemon.ckpt"]
    assert zipfile.is_zipfile(seed_run / "pokemon.ckpt")  # a torch.save archive, as sd-scripts writes .ckpt
    weights = torch.load(seed_run / "pokemon.ckpt", weights_only=True)
    name = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert weights[f"{name}.lora_down.weight"].shape == (256, 32)
    assert weights[f"{name}.lora_up.weight"].shape == (32, 256)
    assert weights[f"{name}.alpha"].item() == 256.0
    assert all(k.startswith("lora_unet_") for k in weights)  # --network_train_unet_only
    assert all(v.dtype == torch.float32 for v in weights.values())  # --save_precision fp32
    assert any(weights[k].abs().sum() > 0 for k in weights if k.endswith("lora_up.weight"))  # it trained
    config = (seed_run / "config.toml").read_text()
    assert 'optimizer_args = ["weight_decay=0.05", "betas=0.9,0.98"]' in config and "flash_attn = true" in config
    assert (seed_run / "loss_curve.png").is_file() and list(seed_run.glob("events.out.tfevents.*"))
    assert not (seed_run / "cache").exists()  # the latent and text caches are temporary by default


def test_config_toml_says_which_values_the_dataset_toml_set(seed_run: Path) -> None:
    """The flags' train_batch_size 1 is only the dataset TOML's default; its own batch_size 2 trained."""
    import tomllib

    text = (seed_run / "config.toml").read_text()
    assert "train_batch_size = 1" in text
    assert "toml: datasets[0]: batch_size = 2, resolution = 64x64\n" in text
    (subset,) = [line for line in text.splitlines() if line.startswith("#   ") and "datasets[0].subsets[0]: " in line]
    assert "num_repeats = 2" in subset and "metadata.json" in subset
    assert tomllib.loads(text)["train_batch_size"] == 1  # still a config --config reads


def test_seed_typo_costant_is_one_line_with_the_fix(tiny_sdxl_single_file: Path, tmp_path: Path, capsys) -> None:
    flags = [f for f in SEED_FLAGS if f != "--lr_scheduler=constant"] + ["--lr_scheduler=costant"]
    code = run_cli("train", "sdxl-lora", f"--pretrained_model_name_or_path={tiny_sdxl_single_file}",
                   f"--dataset_config={write_method(tmp_path, 'finetune')}", *flags, f"--output_dir={tmp_path / 'o'}")
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "--lr_scheduler" in err and "did you mean 'constant'" in err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def features_run(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Text encoders + LoCon, v-prediction, multires noise, epochs, Adafactor, warm-up, samples."""
    root = tmp_path_factory.mktemp("features")
    prompts = root / "prompts.txt"
    prompts.write_text("# samples\na red dog --n blurry --w 64 --h 64 --s 2 --l 5 --d 7\n"
                       "a blue cat --w 32 --h 64 --s 2 --ss euler_a\n")
    code = run_cli("train", "sdxl-lora", "--pretrained_model_name_or_path", tiny_sdxl_dir,
                   "--dataset_config", write_method(root, "captions"), "--output_dir", root / "out",
                   "--network_dim", "4", "--network_alpha", "2", "--network_args", "conv_dim=4", "conv_alpha=2",
                   "rank_dropout=0.1", "module_dropout=0.1", "--v_parameterization", "--multires_noise_iterations",
                   "4", "--max_train_epochs", "2", "--save_every_n_epochs", "1", "--optimizer_type", "Adafactor",
                   # a fixed learning rate, so the schedule (warm-up, restarts) drives it; sd-scripts' default
                   # relative step would ignore --learning_rate and --lr_scheduler
                   "--optimizer_args", "relative_step=False", "scale_parameter=False",
                   "--lr_scheduler", "cosine_with_restarts", "--lr_warmup_steps", "0.25", "--learning_rate", "1e-2",
                   "--sample_prompts", prompts, "--sample_every_n_steps", "4", "--sample_at_first", "--sdpa",
                   "--seed", "3",
                   "--cache_latents_to_disk")
    assert code == 0
    return root / "out"


def test_features_run_writes_epochs_samples_and_metadata(features_run: Path) -> None:
    assert (features_run / "last-000001.safetensors").is_file() and (features_run / "last.safetensors").is_file()
    assert not (features_run / "last-000002.safetensors").exists()  # the last epoch is the final file
    samples = sorted(p.name for p in (features_run / "sample").iterdir())
    assert samples == [f"last_{step:06d}_{i:02d}.png" for step in (0, 4, 8) for i in (0, 1)] + [
        "validation-000004.png", "validation-000008.png"]  # the labelled grids, in the same one folder
    assert not (features_run / "samples").exists()
    _, params = read_parameters(features_run / "sample" / "last_000004_00.png")
    assert (params["prompt"], params["negative_prompt"], params["seed"], params["step"]) == (
        "a red dog", "blurry", 7, 4)
    _, grid = read_parameters(features_run / "sample" / "validation-000008.png")
    assert grid["step"] == 8 and [cell["prompt"] for cell in grid["images"]][0] == "a red dog"
    assert list((features_run / "cache" / "latents").rglob("*.safetensors"))  # --cache_latents_to_disk keeps it
    with safe_open(features_run / "last.safetensors", "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "4", "conv_alpha": "2.0", "rank_dropout": "0.1",
                                                   "module_dropout": "0.1"}
    assert meta["ss_steps"] == "8" and meta["ss_epoch"] == "2" and meta["ss_num_train_images"] == "8"
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0" and meta["ss_resolution"] == "(64, 64)"
    assert json.loads(meta["ss_tag_frequency"]) == {"butterfly": {"a red dog": 1, "a blue cat": 1, "a red cat": 1,
                                                                  "a blue dog": 1}}
    assert json.loads(meta["ss_dataset_dirs"]) == {"butterfly": {"n_repeats": 2, "img_count": 4}}
    assert len(meta["sshs_model_hash"]) == 64
    assert "lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight" in keys  # LoCon
    assert "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in keys


def _image(pipe: StableDiffusionXLPipeline) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red dog", num_inference_steps=2, height=64, width=64, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


@torch.no_grad()
def _merge(pipe: StableDiffusionXLPipeline, lora_file: Path) -> None:
    """Add scale · up @ down to each adapted weight, using the file's own alpha."""
    encoders = {"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2}
    network = create_network(pipe.unet, encoders, NetworkOptions(dim=4, alpha=2.0, conv_dim=4, conv_alpha=2.0))
    network.load_weights(lora_file)
    network.detach()
    for module in network.loras.values():
        weight = module._org[0].weight
        down, up = module.lora_down.weight.flatten(1), module.lora_up.weight.flatten(1)
        weight += (module.scale * up @ down).reshape(weight.shape)


def test_diffusers_loads_the_lora_to_the_image_of_merging_it(features_run: Path, tiny_sdxl_dir: Path) -> None:
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir)
    base = _image(pipe)
    pipe.load_lora_weights(features_run, weight_name="last.safetensors")
    loaded = _image(pipe)
    merged_pipe = build_tiny_sdxl(seed=0)
    _merge(merged_pipe, features_run / "last.safetensors")
    merged = _image(merged_pipe)
    assert (merged - base).abs().max() > 1e-2  # the LoRA changes the image
    torch.testing.assert_close(loaded, merged, atol=2e-4, rtol=0)


def test_network_weights_continue_from_a_file(features_run: Path, tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    shutil.copy(features_run / "config.toml", tmp_path / "base.toml")
    out = tmp_path / "more"
    code = run_cli("train", "sdxl-lora", "--config", tmp_path / "base.toml", "--output_dir", out,
                   "--network_weights", features_run / "last.safetensors", "--max_train_epochs", "1",
                   "--learning_rate", "1e-12", "--sample_prompts", "none", "--log_with", "none")
    assert code == 0
    with safe_open(features_run / "last.safetensors", "pt") as a, safe_open(out / "last.safetensors", "pt") as b:
        key = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_up.weight"
        torch.testing.assert_close(b.get_tensor(key), a.get_tensor(key), atol=1e-6, rtol=0)


@pytest.mark.parametrize("flags, refusal", [
    (("--network_dim", "8"), "has shape (4, 32), the network needs (8, 32); use the file's --network_dim / conv_dim"),
    (("--network_args", "conv_dim=4", "conv_alpha=2", "--network_train_unet_only"),
     "tensors do not belong to this network (first: 'lora_te1_"),
])
def test_network_weights_that_do_not_fit_are_refused_before_anything_is_written(
        flags: tuple[str, ...], refusal: str, features_run: Path, tmp_path: Path, capsys) -> None:
    shutil.copy(features_run / "config.toml", tmp_path / "base.toml")
    out = tmp_path / "more"
    assert run_cli("train", "sdxl-lora", "--config", tmp_path / "base.toml", "--output_dir", out, "--network_weights",
                   features_run / "last.safetensors", "--sample_prompts", "none", "--log_with", "none", *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --network_weights {features_run / 'last.safetensors'}: ") and refusal in err, err
    assert err.count("\n") == 1 and not out.exists()  # no cache/, no run status


def test_the_dashboard_captions_the_runs_samples_and_checks_its_lora_against_its_own_base(
        features_run: Path, tiny_sdxl_single_file: Path, tmp_path: Path) -> None:
    """The labelled grids and the sd-scripts sample files show their prompts (not "(prompt unknown)"); the LoRA
    fits the tiny base it was trained on, named by its folder or by its single file."""
    from dreamstep.dashboard.runs import RunIndex

    run = next(iter(RunIndex([features_run]).runs().values()))
    samples = {s["name"]: s for s in run.samples()}
    grid = samples["validation-000008.png"]
    assert (grid["step"], grid["prompt"], grid["seed"]) == (8, "a red dog | a blue cat", "7, 4")
    assert (samples["last_000004_00.png"]["prompt"], samples["last_000004_00.png"]["seed"]) == ("a red dog", 7)
    assert all(s.get("prompt") for s in samples.values())
    copy = tmp_path / "run"
    shutil.copytree(features_run, copy, ignore=shutil.ignore_patterns("cache"))
    (copy / "config.toml").write_text(f'pretrained_model_name_or_path = "{tiny_sdxl_single_file.as_posix()}"\n')
    for folder in (features_run, copy):
        loras = next(iter(RunIndex([folder]).runs().values())).loras()
        fits = [line for lora in loras for line in lora["info"].splitlines() if line.startswith("fits:")]
        assert fits and all(line.startswith("fits:      yes") and str(tiny_sdxl_single_file.parent) in line
                            for line in fits), fits
