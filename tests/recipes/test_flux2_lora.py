"""`dreamstep train flux2-lora` on the tiny FLUX.2 [klein]: a short run learns its images, the diffusers file loads in
``Flux2KleinPipeline.load_lora_weights`` and changes the output, the ComfyUI file gives the same image through
diffusers' FLUX.2 loader, reference editing trains from pairs, and bad input is one line before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from flux2_testkit import ROBOT_DIR, ROBOT_PROMPT, fixed_noise_loss, generate, load_images, tiny_klein, train_flux2
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import load_file

from dreamstep.errors import UserError
from dreamstep.models.tiny import write_tiny_model

BASE_ARGS = ("--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--resolution", "32",
             "--report_to", "none", "--checkpointing_steps", "0", "--max_sequence_length", "64")


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_klein(tmp_path_factory.mktemp("flux2") / "klein")


@pytest.fixture(scope="module")
def trained(klein_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flux2_lora") / "out"
    train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", out, *BASE_ARGS,
                "--lora_layers", "all-linear", "--rank", "8", "--lora_alpha", "4", "--learning_rate", "3e-3",
                "--max_train_steps", "100", "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", "1",
                "--validation_inference_steps", "2", "--validation_steps", "50")
    return out


def test_loss_on_the_instance_images_falls(trained: Path, klein_dir: Path) -> None:
    pixels = load_images(ROBOT_DIR, 32)
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    pipe.load_lora_weights(trained / "pytorch_lora_weights.safetensors")
    after = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    assert after < 0.95 * before, (before, after)


def test_outputs_are_written(trained: Path) -> None:
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors", "loss_curve.png",
                 "config.toml", "samples/validation-000050.png", "samples/final-000100.png"):
        assert (trained / name).is_file(), name


def test_diffusers_file_keeps_alpha_and_changes_the_output(trained: Path, klein_dir: Path) -> None:
    path = trained / "pytorch_lora_weights.safetensors"
    tensors = load_file(path)
    assert "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight" in tensors
    assert "transformer.transformer_blocks.0.ff_context.linear_out.lora_B.weight" in tensors
    with safe_open(path, "pt") as f:
        adapter = json.loads(f.metadata()["lora_adapter_metadata"])
    assert adapter["transformer.r"] == 8 and adapter["transformer.lora_alpha"] == 8  # alpha / rank folded into B
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    plain = generate(pipe)
    pipe.load_lora_weights(path)
    assert np.abs(generate(pipe) - plain).max() > 1e-2


def test_comfyui_file_has_bfl_names_and_gives_the_same_image_in_diffusers(trained: Path, klein_dir: Path) -> None:
    comfy = trained / "pytorch_lora_weights_comfyui.safetensors"
    keys = set(load_file(comfy))
    for name in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_mlp_0",
                 "lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"):
        assert {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"} <= keys
    images = []
    for path in (trained / "pytorch_lora_weights.safetensors", comfy):
        pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
        pipe.load_lora_weights(path)  # diffusers' FLUX.2 loader converts the Kohya / ComfyUI names itself
        images.append(generate(pipe))
    np.testing.assert_allclose(images[1], images[0], atol=2e-3)


def _pairs(root: Path, count: int = 4) -> tuple[Path, Path]:
    """Targets (a ball) and their conditions (the same ball's outline), same-named, with an instruction each."""
    targets, conditions = root / "after", root / "before"
    targets.mkdir(parents=True)
    conditions.mkdir()
    for i in range(count):
        target, condition = Image.new("RGB", (32, 32), "navy"), Image.new("RGB", (32, 32), "black")
        ImageDraw.Draw(target).ellipse((4 * i, 4 * i, 4 * i + 12, 4 * i + 12), fill="orange")
        ImageDraw.Draw(condition).rectangle((4 * i, 4 * i, 4 * i + 12, 4 * i + 12), outline="white")
        target.save(targets / f"{i}.png")
        condition.save(conditions / f"{i}.png")
        (targets / f"{i}.txt").write_text("fill the square in orange")
    return targets, conditions


def test_reference_editing_trains_from_pairs(klein_dir: Path, tmp_path: Path) -> None:
    targets, conditions = _pairs(tmp_path / "data")
    out = tmp_path / "out"
    result = train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", out,
                         "--instance_data_dir", targets, "--conditioning_data_dir", conditions, "--resolution", "32",
                         "--report_to", "none", "--checkpointing_steps", "0", "--max_sequence_length", "64",
                         "--max_train_steps", "4", "--save_kohya_format", "false")
    assert "LoRA (diffusers)" in result.written and "LoRA (ComfyUI)" not in result.written
    # The batches carry the condition images, which the conditioner encodes beside the targets.
    from dreamstep.config.flux2_lora import Flux2LoraConfig
    from dreamstep.config.schema import build_config
    from dreamstep.data.dataset import build_dataset, collate
    from dreamstep.models.flux2 import plumbing as flux2
    from dreamstep.recipes.flux2_lora import training_datasets

    config = build_config(Flux2LoraConfig, {"pretrained_model_name_or_path": str(klein_dir), "output_dir": "x",
                                            "instance_data_dir": str(targets), "resolution": "32",
                                            "conditioning_data_dir": str(conditions)})
    dataset = build_dataset(training_datasets(config), seed=0)
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    conditioner = flux2.Flux2Conditioner(pipe, latent_cache=None, text_cache=flux2.TensorCache(tmp_path / "t", "t"),
                                         max_sequence_length=64, device=torch.device("cpu"),
                                         text_encoder_out_layers=None)
    inputs = conditioner(collate([dataset[0], dataset[1]]))
    assert inputs["condition_dist"].shape == inputs["latent_dist"].shape == (2, 64, 2, 2)
    tensors = load_file(out / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)


@pytest.mark.parametrize(("flags", "message"), [
    (("--resolution", "40"), r"--resolution 40: FLUX.2 reads 2x2 patches .* multiple of 16 \(e.g. 32\)"),
    (("--text_encoder_out_layers", "9", "18", "30"),
     r"--text_encoder_out_layers 9 18 30: the text encoder has 27 layers"),
    (("--cond_image_column", "before"), r"--cond_image_column .*without --dataset_name"),
])
def test_bad_flags_are_one_line(klein_dir: Path, tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(UserError, match=message):
        train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", tmp_path / "out", *BASE_ARGS, *flags)
    assert not (tmp_path / "out").exists()


def test_another_familys_base_is_named(tmp_path: Path) -> None:
    flux = write_tiny_model("flux", tmp_path / "flux1")
    with pytest.raises(UserError, match=r"--pretrained_model_name_or_path .*a FluxPipeline folder \(FLUX.1: train it "
                                        r"with its own trainer\), not FLUX.2"):
        train_flux2("--pretrained_model_name_or_path", flux, "--output_dir", tmp_path / "out", *BASE_ARGS)
    with pytest.raises(UserError, match=r"--pretrained_model_name_or_path .*no such folder"):
        train_flux2("--pretrained_model_name_or_path", tmp_path / "nowhere", "--output_dir", tmp_path / "out",
                    *BASE_ARGS)
    assert not (tmp_path / "out").exists()


def test_a_run_on_the_cpu_in_bf16_trains(klein_dir: Path, tmp_path: Path) -> None:
    """Frozen weights in bf16 (the card's setting), LoRA weights fp32: the loss stays finite."""
    result = train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", tmp_path / "out", *BASE_ARGS,
                         "--mixed_precision", "bf16", "--max_train_steps", "3", "--gradient_checkpointing")
    assert len(result.result.losses) == 3 and torch.isfinite(torch.tensor(result.result.losses)).all()
    assert not result.result.skipped_steps


def test_a_dev_run_loads_in_flux2_pipeline(tmp_path: Path) -> None:
    """[dev]: the Mistral 3 encoder's captions, guidance fed to the guidance-distilled transformer; its LoRA loads in
    ``Flux2Pipeline.load_lora_weights`` and changes the output."""
    dev = write_tiny_model("flux2", tmp_path / "dev")
    out = tmp_path / "out"
    train_flux2("--pretrained_model_name_or_path", dev, "--output_dir", out, *BASE_ARGS, "--max_train_steps", "6",
                "--learning_rate", "1e-2", "--rank", "4")
    pipe = Flux2Pipeline.from_pretrained(dev)
    plain = generate(pipe)
    pipe.load_lora_weights(out / "pytorch_lora_weights.safetensors")
    assert np.abs(generate(pipe) - plain).max() > 1e-3


def test_pairs_from_a_metadata_table_and_a_dataset_toml(klein_dir: Path, tmp_path: Path) -> None:
    targets, conditions = _pairs(tmp_path / "data")
    table = tmp_path / "data" / "metadata.jsonl"
    table.write_text("".join(json.dumps({"image": f"after/{i}.png", "before": f"before/{i}.png",
                                         "text": "fill the square in orange"}) + "\n" for i in range(4)))
    toml = tmp_path / "dataset.toml"
    toml.write_text(f"[[datasets]]\nresolution = 32\nbatch_size = 2\n\n  [[datasets.subsets]]\n"
                    f"  image_dir = '{targets.as_posix()}'\n  conditioning_data_dir = '{conditions.as_posix()}'\n"
                    "  caption_extension = '.txt'\n")
    common = ("--pretrained_model_name_or_path", klein_dir, "--report_to", "none", "--checkpointing_steps", "0",
              "--max_sequence_length", "64", "--max_train_steps", "2", "--save_kohya_format", "false")
    table_run = train_flux2(*common, "--output_dir", tmp_path / "table", "--dataset_name", table, "--resolution", "32",
                            "--cond_image_column", "before", "--caption_column", "text")
    toml_run = train_flux2(*common, "--output_dir", tmp_path / "toml", "--dataset_config", toml)
    for result in (table_run, toml_run):
        assert len(result.result.losses) == 2 and not result.result.skipped_steps


def test_prior_preservation_makes_the_class_images(klein_dir: Path, tmp_path: Path) -> None:
    classes = tmp_path / "class"
    result = train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", tmp_path / "out", *BASE_ARGS,
                         "--with_prior_preservation", "--class_data_dir", classes, "--class_prompt", "a photo of robot",
                         "--num_class_images", "2", "--max_train_steps", "2",
                         "--save_kohya_format", "false")
    assert len(list(classes.glob("*.png"))) == 2
    assert len(result.result.losses) == 2


def test_resume_equals_an_uninterrupted_run(klein_dir: Path, tmp_path: Path) -> None:
    common = ("--pretrained_model_name_or_path", klein_dir, "--instance_data_dir", ROBOT_DIR, "--instance_prompt",
              ROBOT_PROMPT, "--resolution", "32", "--report_to", "none", "--max_sequence_length", "64",
              "--train_batch_size", "2", "--random_flip", "--weighting_scheme", "logit_normal",
              "--learning_rate", "1e-3", "--checkpointing_steps", "2", "--ema_decay", "0.9",
              "--save_kohya_format", "false")
    train_flux2(*common, "--output_dir", tmp_path / "straight", "--max_train_steps", "4")
    train_flux2(*common, "--output_dir", tmp_path / "split", "--max_train_steps", "2")
    train_flux2(*common, "--output_dir", tmp_path / "split", "--max_train_steps", "4", "--resume_from_checkpoint",
                "latest")
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        straight, resumed = load_file(tmp_path / "straight" / name), load_file(tmp_path / "split" / name)
        assert straight.keys() == resumed.keys()
        for key in straight:
            torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=0)


def test_an_int8_base_and_encoder_with_block_swap_train(klein_dir: Path, tmp_path: Path) -> None:
    """The small-card options: the transformer and the Qwen3 encoder in int8, a block swapped, checkpointing."""
    result = train_flux2("--pretrained_model_name_or_path", klein_dir, "--output_dir", tmp_path / "out", *BASE_ARGS,
                         "--max_train_steps", "3", "--base_quantization", "int8", "--text_encoder_quantization",
                         "int8", "--gradient_checkpointing", "--blocks_to_swap", "1", "--save_kohya_format", "false")
    assert len(result.result.losses) == 3 and torch.isfinite(torch.tensor(result.result.losses)).all()
    tensors = load_file(tmp_path / "out" / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if "lora_B" in k)


def test_class_images_made_within_the_plan_are_the_whole_pipelines(klein_dir: Path, tmp_path: Path) -> None:
    """From the class and empty negative prompts' embeddings (the base [klein]'s guidance), with the text encoder off
    the device: the images the whole pipeline makes from the class prompt, seed for seed."""
    from dreamstep.config.flux2_lora import Flux2LoraConfig
    from dreamstep.config.schema import build_config
    from dreamstep.recipes.flux2_lora import _generate_class_images

    classes = tmp_path / "class"
    config = build_config(Flux2LoraConfig, {
        "pretrained_model_name_or_path": str(klein_dir), "output_dir": str(tmp_path / "out"),
        "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT, "resolution": "32",
        "max_sequence_length": "64", "with_prior_preservation": "true", "class_data_dir": str(classes),
        "class_prompt": "a photo of robot", "num_class_images": "3", "sample_batch_size": "2", "seed": "5"})
    _generate_class_images(config, torch.device("cpu"))
    pipe = Flux2KleinPipeline.from_pretrained(klein_dir)
    assert config.guidance_scale > 1 and not pipe.config.is_distilled  # classifier-free guidance: the negative runs
    steps = 50  # the base's own (models.flux2.generation.BASE_SAMPLING)
    for first, count in ((0, 2), (2, 1)):
        expected = pipe(prompt=["a photo of robot"] * count, height=32, width=32, num_inference_steps=steps,
                        guidance_scale=config.guidance_scale, max_sequence_length=64,
                        generator=torch.Generator("cpu").manual_seed(5 + first), output_type="np").images
        for i, image in enumerate(expected):
            made = np.asarray(Image.open(classes / f"class-{first + i:05d}.png"), dtype=np.float32) / 255
            assert np.abs(made - image).max() <= 1 / 255 + 1e-6
