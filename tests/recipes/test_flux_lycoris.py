"""flux-lora with --lora_type lokr, loha and dora (LyCORIS): each lowers the fixed-noise loss of the instance
images, resumes exactly from a checkpoint, and writes LyCORIS' layout (transformer and CLIP) that generate applies;
bad combinations are one line before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, load_images, run_cli
from safetensors import safe_open
from safetensors.torch import load_file

from dreamstep.generation.loras import LoraSpec, apply_loras

TYPES = {"lokr": ("--lokr_factor", "4"), "loha": (), "dora": ()}
KEYS = {"lokr": ".lokr_w1", "loha": ".hada_w1_a", "dora": ".dora_scale"}


@pytest.mark.parametrize("kind", list(TYPES))
def test_lycoris_type_lowers_the_loss_and_resumes_exactly(kind: str, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    common = ("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir",
              ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none",
              "--lora_type", kind, *TYPES[kind], "--rank", "4", "--learning_rate", "1e-2", "--checkpointing_steps",
              "4", "--train_text_encoder", "--text_encoder_lr", "1e-3")
    straight = tmp_path / "straight"
    assert run_cli(*common, "--output_dir", straight, "--max_train_steps", "8") == 0
    split = tmp_path / "split"
    assert run_cli(*common, "--output_dir", split, "--max_train_steps", "4") == 0
    assert run_cli(*common, "--output_dir", split, "--max_train_steps", "8", "--resume_from_checkpoint", "latest") == 0

    trained = load_file(straight / "pytorch_lora_weights.safetensors")
    resumed = load_file(split / "pytorch_lora_weights.safetensors")
    assert trained.keys() == resumed.keys() and any(k.endswith(KEYS[kind]) for k in trained)
    assert any(k.startswith("lycoris_transformer_blocks_0_attn_to_q.") for k in trained)
    assert any(k.startswith("lora_te1_text_model_encoder_layers_0_self_attn_q_proj.") for k in trained)
    for key, value in trained.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0, msg=key)
    with safe_open(straight / "pytorch_lora_weights.safetensors", "pt") as f:
        assert f.metadata()["lycoris_algo"] == ("lora" if kind == "dora" else kind)

    pixels = load_images(ROBOT_DIR, 32)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    apply_loras(pipe, [LoraSpec(straight / "pytorch_lora_weights.safetensors")], "flux", merge=True)
    assert fixed_noise_loss(pipe, pixels, ROBOT_PROMPT) < before


@pytest.mark.parametrize(("flags", "expected"), [
    (("--lora_type", "lokr", "--save_kohya_format"), "--save_kohya_format: sd-scripts' FLUX LoRA layout fuses"),
    (("--lora_type", "loha", "--lora_dropout", "0.1"), "--lora_dropout: LyCORIS' loha has no plain dropout"),
    (("--lora_type", "loha", "--lokr_factor", "8"), "--lokr_factor has no effect with --lora_type loha"),
    (("--rank_dropout", "0.1"), "--rank_dropout has no effect with --lora_type lora"),
    (("--lora_type", "lokr", "--lokr_factor", "0"), "factor=0: the LoKr factor"),
    (("--lora_type", "dora", "--base_quantization", "int8"), "--base_quantization int8 with --lora_type dora: DoRA"),
    (("--lora_type", "lokra",), "--lora_type"),
])
def test_bad_lora_type_options_are_one_line(flags: tuple[str, ...], expected: str, tmp_path: Path, capsys) -> None:
    code = run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tmp_path / "no-model",
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--output_dir", tmp_path / "o",
                   *flags)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("kind", "mode"), [("lokr", "int8"), ("loha", "fp8")])
def test_lycoris_on_a_quantized_base_learns_and_loads_on_the_unquantized_base(
        kind: str, mode: str, tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    """torchao's quantized weights cannot be added to, so LyCORIS runs its bypass forward (layer(x) + dW x) there;
    the file is the one an unquantized base trains, and applied to the unquantized base it lowers the loss."""
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir",
                   ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none",
                   "--lora_type", kind, *TYPES[kind], "--rank", "4", "--learning_rate", "1e-2",
                   "--base_quantization", mode, "--output_dir", tmp_path, "--max_train_steps", "8") == 0
    lora = tmp_path / "pytorch_lora_weights.safetensors"
    assert all(k.startswith("lycoris_") for k in load_file(lora))  # LyCORIS' names, no quantizer internals
    pixels = load_images(ROBOT_DIR, 32)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dev_dir)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    apply_loras(pipe, [LoraSpec(lora)], "flux", merge=False)
    assert fixed_noise_loss(pipe, pixels, ROBOT_PROMPT) < before


def test_a_swapped_lycoris_run_gives_the_resident_one(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    """--blocks_to_swap moves the blocks' weights, never the LyCORIS modules (they live beside the transformer and
    go to the device with it); both blocks of the tiny model swapped give the resident run's losses and file."""
    common = ("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir",
              ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none",
              "--lora_type", "lokr", *TYPES["lokr"], "--rank", "4", "--learning_rate", "1e-2",
              "--gradient_checkpointing", "--max_train_steps", "3")
    assert run_cli(*common, "--output_dir", tmp_path / "resident") == 0
    assert run_cli(*common, "--output_dir", tmp_path / "swapped", "--blocks_to_swap", "2") == 0
    resident = load_file(tmp_path / "resident" / "pytorch_lora_weights.safetensors")
    swapped = load_file(tmp_path / "swapped" / "pytorch_lora_weights.safetensors")
    assert resident.keys() == swapped.keys()
    for key, value in resident.items():
        torch.testing.assert_close(swapped[key], value, rtol=0, atol=1e-7, msg=key)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in resident.items() if k.endswith(".lokr_w2"))


def test_an_ema_of_a_lycoris_network_is_saved_beside_it(tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    assert run_cli("train", "flux-lora", "--pretrained_model_name_or_path", tiny_flux_dev_dir, "--instance_data_dir",
                   ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none",
                   "--lora_type", "lokr", "--lokr_factor", "4", "--rank", "4", "--learning_rate", "1e-2",
                   "--ema_decay", "0.5", "--output_dir", tmp_path, "--max_train_steps", "3") == 0
    raw = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    average = load_file(tmp_path / "pytorch_lora_weights_ema.safetensors")
    assert raw.keys() == average.keys()
    assert any(not torch.equal(raw[k], average[k]) for k in raw)  # the average lags the trained weights
