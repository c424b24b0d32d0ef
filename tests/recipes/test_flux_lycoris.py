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
from safetensors.torch import load_file, save_file

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


def _from_file_args(model: Path, out: Path, kind: str, *extra: object) -> tuple[object, ...]:
    flags = ("--lora_type", kind, "--lokr_factor", "4") if kind == "lokr" else ()
    return ("train", "flux-lora", "--pretrained_model_name_or_path", model, "--instance_data_dir", ROBOT_DIR,
            "--instance_prompt", ROBOT_PROMPT, "--resolution", "32", "--report_to", "none", "--rank", "4",
            "--train_text_encoder", "--output_dir", out, *flags, *extra)


@pytest.fixture(scope="module")
def saved_files(tiny_flux_dev_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A few-step plain LoRA (with its Kohya file) and LoKr run, transformer and CLIP, to continue from."""
    root = tmp_path_factory.mktemp("saved")
    for kind in ("lora", "lokr"):
        extra = ("--save_kohya_format",) if kind == "lora" else ()
        assert run_cli(*_from_file_args(tiny_flux_dev_dir, root / kind, kind, "--max_train_steps", "6",
                                        "--learning_rate", "1e-2", "--text_encoder_lr", "1e-3", "--lora_alpha", "2",
                                        *extra)) == 0
    return {"lora": root / "lora" / "pytorch_lora_weights.safetensors",
            "kohya": root / "lora" / "pytorch_lora_weights_kohya.safetensors",
            "lokr": root / "lokr" / "pytorch_lora_weights.safetensors"}


def _step0_val_loss(out: Path) -> float:
    lines = (out / "metrics.csv").read_text().splitlines()
    header, first = lines[0].split(","), lines[1].split(",")
    assert first[0] == "0"
    return float(first[header.index("val_loss")])


@pytest.mark.parametrize("source", ["lora", "kohya", "lokr"])
def test_network_weights_continue_from_a_saved_file(source: str, saved_files: dict[str, Path],
                                                    tiny_flux_dev_dir: Path, tmp_path: Path) -> None:
    kind = "lokr" if source == "lokr" else "lora"
    # At a learning rate of ~0 one step keeps the file's weights (and its alpha 2, with no --lora_alpha given).
    kept = tmp_path / "kept"
    assert run_cli(*_from_file_args(tiny_flux_dev_dir, kept, kind, "--network_weights", saved_files[source],
                                    "--max_train_steps", "1", "--learning_rate", "1e-12",
                                    "--text_encoder_lr", "1e-12")) == 0
    saved = load_file(saved_files["lokr" if kind == "lokr" else "lora"])
    again = load_file(kept / "pytorch_lora_weights.safetensors")
    assert again.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(again[key], value, atol=1e-6, rtol=0, msg=key)
    # A training run from the file starts at the file's loss, below the fresh init's.
    losses = {}
    for name, extra in (("fresh", ()), ("continued", ("--network_weights", saved_files[source]))):
        out = tmp_path / name
        assert run_cli(*_from_file_args(tiny_flux_dev_dir, out, kind, *extra, "--max_train_steps", "1",
                                        "--learning_rate", "1e-2", "--validation_data_dir", ROBOT_DIR,
                                        "--validation_steps", "1", "--lora_alpha", "2")) == 0
        losses[name] = _step0_val_loss(out)
    assert losses["continued"] < losses["fresh"], losses


@pytest.mark.parametrize(("source", "flags", "expected"), [
    ("lokr", ("--lora_type", "lora"), "a LoKr file, --lora_type is lora"),
    ("lora", ("--lora_type", "lokr", "--lokr_factor", "4"), "a plain LoRA file, --lora_type is lokr"),
    ("lora", ("--rank", "8"), "the file has rank 4, --rank is 8"),
    ("lora", ("--lora_layers", "attention+ff"), "the file has no adapter for 'transformer."),
    ("lora", ("--lora_layers", "attn.to_q"), "which --lora_layers does not"),
    ("lokr", ("--lora_type", "lokr", "--lokr_factor", "4", "--lora_layers", "attention+ff"), "has no module for"),
    ("lokr", ("--lora_type", "lokr", "--lokr_factor", "2"), "has shape"),
    ("lokr", ("--lora_type", "lokr", "--lokr_factor", "4", "--lokr_full_matrix", "false"),
     "is in full-matrix mode; drop --lokr_full_matrix false"),
    ("no-te", (), "has no text-encoder adapters; drop --train_text_encoder"),
    ("sdxl", (), "an adapter for SDXL"),
    ("corrupt", (), "not a readable safetensors file"),
    ("absent", (), "no such file"),
])
def test_a_network_weights_file_that_does_not_fit_is_one_line(
        source: str, flags: tuple[str, ...], expected: str, saved_files: dict[str, Path], tiny_flux_dev_dir: Path,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "file.safetensors"
    if source in saved_files:
        path = saved_files[source]
    elif source == "no-te":
        save_file({k: v for k, v in load_file(saved_files["lora"]).items() if k.startswith("transformer.")}, path)
    elif source == "sdxl":
        save_file({"lora_unet_input_blocks_4_1_proj_in.lora_down.weight": torch.zeros(4, 8),
                   "lora_unet_input_blocks_4_1_proj_in.lora_up.weight": torch.zeros(8, 4)}, path)
    elif source == "corrupt":
        path.write_bytes(saved_files["lora"].read_bytes()[:-100])
    capsys.readouterr()
    out = tmp_path / "out"
    code = run_cli(*_from_file_args(tiny_flux_dev_dir, out, "lora", "--network_weights", path,
                                    "--max_train_steps", "1", *flags))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "--network_weights" in errors[0] and expected in errors[0], err
    assert "Traceback" not in err and not out.exists()


def test_a_checkpoint_wins_over_network_weights(saved_files: dict[str, Path], tiny_flux_dev_dir: Path,
                                                tmp_path: Path) -> None:
    """Resuming a run that started from a file continues the checkpoint (the file is not loaded over it)."""
    common = ("--network_weights", saved_files["lokr"], "--learning_rate", "1e-2", "--text_encoder_lr", "1e-3",
              "--checkpointing_steps", "2")
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(*_from_file_args(tiny_flux_dev_dir, straight, "lokr", *common, "--max_train_steps", "4")) == 0
    assert run_cli(*_from_file_args(tiny_flux_dev_dir, split, "lokr", *common, "--max_train_steps", "2")) == 0
    assert run_cli(*_from_file_args(tiny_flux_dev_dir, split, "lokr", *common, "--max_train_steps", "4",
                                    "--resume_from_checkpoint", "latest")) == 0
    trained = load_file(straight / "pytorch_lora_weights.safetensors")
    resumed = load_file(split / "pytorch_lora_weights.safetensors")
    started = load_file(saved_files["lokr"])
    assert any(not torch.equal(value, started[key]) for key, value in trained.items())
    for key, value in trained.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0, msg=key)
