"""``dreamstep train qwen-image-lora`` on the tiny Qwen-Image: a short run lowers the loss on its images; the
diffusers file loads in ``QwenImagePipeline.load_lora_weights`` and changes the output as trained; the ComfyUI file
names only modules of the full-size Qwen-Image (built on the meta device) with ComfyUI's key rules, and diffusers'
own loader reads it to the same model; bad input is one line before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import init_empty_weights
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from flux_testkit import ROBOT_DIR, ROBOT_PROMPT, load_images, run_cli
from PIL import Image
from qwen_image_testkit import fixed_noise_loss, tiny_model
from safetensors.torch import load_file

from dreamstep.lora.comfyui_files import COMFYUI_WEIGHT_NAME, KOHYA_WEIGHT_NAME, LORA_WEIGHT_NAME
from dreamstep.models.qwen_image.configs import QWEN_IMAGE_TRANSFORMER

STEPS = 40


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model("qwen-image", tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def trained(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert run_cli("train", "qwen-image-lora", "--pretrained_model_name_or_path", tiny_qwen,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--output_dir", out,
                   "--resolution", 32, "--train_batch_size", 2, "--max_train_steps", STEPS, "--learning_rate", 2e-3,
                   "--rank", 8, "--lora_layers", "attention+ff", "--report_to", "none",
                   "--checkpointing_steps", 0, "--validation_prompt", ROBOT_PROMPT, "--num_validation_images", 1,
                   "--validation_inference_steps", 2, "--save_kohya_format") == 0
    return out


def _image(pipe: QwenImagePipeline) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(ROBOT_PROMPT, num_inference_steps=2, height=32, width=32, true_cfg_scale=1.0, output_type="np",
                generator=torch.Generator().manual_seed(0)).images[0]


def test_outputs_are_written(trained: Path) -> None:
    for name in (LORA_WEIGHT_NAME, COMFYUI_WEIGHT_NAME, KOHYA_WEIGHT_NAME, "config.toml", "loss_curve.png"):
        assert (trained / name).is_file(), name
    assert list((trained / "samples").glob("*.png"))


def test_loss_on_the_instance_images_falls(trained: Path, tiny_qwen: Path) -> None:
    pixels = load_images(ROBOT_DIR, 32)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    before = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    pipe.load_lora_weights(trained / LORA_WEIGHT_NAME)
    after = fixed_noise_loss(pipe, pixels, ROBOT_PROMPT)
    assert after < 0.9 * before, (before, after)


def test_the_diffusers_file_loads_in_the_pipeline_and_changes_the_output(trained: Path, tiny_qwen: Path) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    base = _image(pipe)
    pipe.load_lora_weights(trained / LORA_WEIGHT_NAME)
    assert "default_0" in pipe.transformer.peft_config or pipe.get_active_adapters()
    assert np.abs(_image(pipe) - base).max() > 1e-3


@pytest.mark.parametrize("name", [COMFYUI_WEIGHT_NAME, KOHYA_WEIGHT_NAME])
def test_diffusers_reads_the_comfyui_and_kohya_files_as_the_diffusers_one(name: str, trained: Path,
                                                                         tiny_qwen: Path) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    pipe.load_lora_weights(trained / LORA_WEIGHT_NAME)
    expected = _image(pipe)
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    pipe.load_lora_weights(trained / name)
    np.testing.assert_allclose(_image(pipe), expected, atol=1e-5)


def test_dreamstep_reads_its_own_comfyui_file_as_the_diffusers_one(trained: Path) -> None:
    from dreamstep.lora.convert import read_lora
    from dreamstep.lora.info import COMFYUI_LAYOUT_NAME, describe

    comfyui, diffusers = read_lora(trained / COMFYUI_WEIGHT_NAME), read_lora(trained / LORA_WEIGHT_NAME)
    assert comfyui.model == diffusers.model == "qwen-image" and comfyui.modules.keys() == diffusers.modules.keys()
    for name, weights in diffusers.modules.items():
        read = comfyui.modules[name]
        assert torch.equal(read.down, weights.down) and torch.equal(read.up, weights.up)
        assert read.scale == pytest.approx(weights.scale)
    assert COMFYUI_LAYOUT_NAME in describe(str(trained / COMFYUI_WEIGHT_NAME))


def _comfyui_key_map(model: torch.nn.Module) -> dict[str, str]:
    """ComfyUI's key map of a Qwen-Image model (``comfy/lora.py`` ``model_lora_keys_unet``): every weight
    ``diffusion_model.<module>.weight`` of the model is reachable as ``diffusion_model.<module>`` (the generic form),
    ``<module>``, ``transformer.<module>`` and ``lora_unet_<module with _>``. ComfyUI's Qwen-Image modules are named
    as diffusers names them."""
    key_map = {}
    for name, _ in model.named_parameters():
        if name.endswith(".weight"):
            module = name.removesuffix(".weight")
            weight = f"diffusion_model.{name}"
            for key in (f"diffusion_model.{module}", module, f"transformer.{module}",
                        "lora_unet_" + module.replace(".", "_")):
                key_map[key] = weight
    return key_map


def test_every_comfyui_key_lands_on_a_weight_of_the_full_size_model(trained: Path) -> None:
    tensors = load_file(trained / COMFYUI_WEIGHT_NAME)
    with init_empty_weights():
        full = QwenImageTransformer2DModel.from_config(QWEN_IMAGE_TRANSFORMER)
    key_map, shapes = _comfyui_key_map(full), {f"diffusion_model.{k}": v.shape for k, v in full.state_dict().items()}
    modules = {k.rsplit(".", 2)[0] for k in tensors if k.endswith((".lora_down.weight", ".lora_up.weight"))}
    assert modules and all(k.startswith("diffusion_model.transformer_blocks.") for k in modules)
    consumed = set()
    for module in modules:
        assert module in key_map, module
        down, up = tensors[f"{module}.lora_down.weight"], tensors[f"{module}.lora_up.weight"]
        # The tiny model's widths differ from the full size's: the module and its LoRA's structure are what map.
        assert len(shapes[key_map[module]]) == 2 and down.shape[0] == up.shape[1] == 8
        assert float(tensors[f"{module}.alpha"]) == 8.0
        consumed |= {f"{module}.lora_down.weight", f"{module}.lora_up.weight", f"{module}.alpha"}
    assert consumed == set(tensors)  # ComfyUI would log no "lora key not loaded"


@pytest.mark.parametrize(("case", "message"), [
    ("flux", r"--pretrained_model_name_or_path .*: holds a FluxPipeline, not a Qwen-Image pipeline .*flux-lora"),
    ("missing", r"--pretrained_model_name_or_path: model path '.*nowhere' does not exist"),
    ("resolution", r"--resolution must be a multiple of 16 .* \(got 40; try 32\)"),
    ("layers", r"--lora_layers: 'to_x' matches no linear layer of the Qwen-Image transformer"),
])
def test_bad_input_gives_one_line_and_writes_nothing(case: str, message: str, tiny_qwen: Path,
                                                     tiny_flux_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    base = {"flux": tiny_flux_dir, "missing": tmp_path / "nowhere"}.get(case, tiny_qwen)
    extra = {"resolution": ["--resolution", 40], "layers": ["--lora_layers", "to_x"]}.get(case, [])
    out = tmp_path / "out"
    code = run_cli("train", "qwen-image-lora", "--pretrained_model_name_or_path", base, "--instance_data_dir",
                   ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--output_dir", out, "--resolution", 32,
                   "--report_to", "none", "--max_train_steps", 1, *extra)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert re.search(message, errors[0]), errors[0]
    assert not out.exists()


def test_the_text_encoder_is_dropped_before_the_transformer_loads(tiny_qwen: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from dreamstep.models.qwen_image import plumbing

    seen = {}
    load = plumbing.load_transformer_for_training

    def recording(*args: object, **kwargs: object) -> torch.nn.Module:
        seen["captions cached"] = sorted(p.name for p in (tmp_path / "out" / "cache" / "text").rglob("*.safetensors"))
        return load(*args, **kwargs)

    real_free = plumbing.free_text_encoder_and_park_vae

    def freeing(pipeline: QwenImagePipeline, *args: object, **kwargs: object) -> object:
        result = real_free(pipeline, *args, **kwargs)
        seen["text encoder"] = pipeline.text_encoder
        return result

    monkeypatch.setattr(plumbing, "load_transformer_for_training", recording)
    monkeypatch.setattr(plumbing, "free_text_encoder_and_park_vae", freeing)
    assert run_cli("train", "qwen-image-lora", "--pretrained_model_name_or_path", tiny_qwen, "--instance_data_dir",
                   ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT, "--output_dir", tmp_path / "out", "--resolution", 32,
                   "--max_train_steps", 1, "--report_to", "none", "--checkpointing_steps", 0) == 0
    assert seen["text encoder"] is None and len(seen["captions cached"]) == 1


def test_eval_scores_the_run_against_the_base_model(trained: Path, tiny_qwen: Path, tiny_evaluators: dict[str, Path],
                                                    tmp_path: Path) -> None:
    out = tmp_path / "eval"
    assert run_cli("eval", "qwen-image", "--model", tiny_qwen, "--weights", trained, "--prompt", ROBOT_PROMPT,
                   "--instance_data_dir", ROBOT_DIR, "--output_dir", out, "--num_images", 1, "--steps", 2,
                   "--resolution", 32, "--dino_model", tiny_evaluators["dino"], "--clip_model",
                   tiny_evaluators["clip"], "--best_by", "clip_t") == 0
    rows = {r["label"]: r for r in json.loads((out / "scores.json").read_text())["candidates"]}
    assert list(rows)[0] == "base model" and len(rows) == 2
    final = next(r for label, r in rows.items() if label.endswith(LORA_WEIGHT_NAME))
    assert final["step"] == STEPS and final["dino"] != pytest.approx(rows["base model"]["dino"], abs=1e-6)


def test_class_images_made_within_the_plan_are_the_whole_pipelines(tiny_qwen: Path, tmp_path: Path) -> None:
    """From the class prompt's embedding, with the text encoder off the device: the images the whole pipeline makes
    from the class prompt (diffusers' script calls ``pipeline(prompt)``), seed for seed."""
    from dreamstep.config.qwen_image_lora import QwenImageLoraConfig
    from dreamstep.config.schema import build_config
    from dreamstep.recipes.qwen_image_lora import _generate_class_images

    classes = tmp_path / "class"
    config = build_config(QwenImageLoraConfig, {
        "pretrained_model_name_or_path": str(tiny_qwen), "output_dir": str(tmp_path / "out"),
        "instance_data_dir": str(ROBOT_DIR), "instance_prompt": ROBOT_PROMPT, "resolution": "32",
        "with_prior_preservation": "true", "class_data_dir": str(classes), "class_prompt": "a photo of robot",
        "num_class_images": "3", "sample_batch_size": "2", "seed": "5"})
    _generate_class_images(config, str(tiny_qwen), torch.device("cpu"))
    pipe = QwenImagePipeline.from_pretrained(tiny_qwen)
    for first, count in ((0, 2), (2, 1)):
        expected = pipe(prompt=["a photo of robot"] * count, height=32, width=32,
                        generator=torch.Generator("cpu").manual_seed(5 + first), output_type="np").images
        for i, image in enumerate(expected):
            made = np.asarray(Image.open(classes / f"class-{first + i:05d}.png"), dtype=np.float32) / 255
            assert np.abs(made - image).max() <= 1 / 255 + 1e-6


def test_prior_preservation_makes_the_missing_class_images_and_plans_them(tiny_qwen: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    classes = tmp_path / "class"
    classes.mkdir()
    Image.new("RGB", (32, 32), "gray").save(classes / "mine.png")  # one there already: one more is made
    assert run_cli("train", "qwen-image-lora", "--pretrained_model_name_or_path", tiny_qwen,
                   "--instance_data_dir", ROBOT_DIR, "--instance_prompt", ROBOT_PROMPT,
                   "--output_dir", tmp_path / "out", "--resolution", 32, "--max_train_steps", 2,
                   "--report_to", "none", "--with_prior_preservation", "--class_data_dir", classes,
                   "--class_prompt", "a photo of robot", "--num_class_images", 2) == 0
    assert sorted(p.name for p in classes.iterdir()) == ["class-00001.png", "mine.png"]
    assert "class images" in capsys.readouterr().out
